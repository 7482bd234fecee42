"""Multi-turn generation: a sampler, an environment and the prompts -> the episodes as one
version-tagged TrajectoryBatch with their rewards (`tasks.envs.Episodes` combines each row's
turn rewards) and the episode and tool metrics."""

from __future__ import annotations

import numpy as np

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.rollout.turns import Turns
from jaxrl_llm.tasks import envs


def generate(sampler, env, params, prompts, key, version: int = 0, refresh=None, max_turns: int = 4,
             turn_reward: str = "last", max_obs_tokens: int = 64) -> tuple[TrajectoryBatch, dict]:
    """Episodes of `prompts` (G rows each). Static batching holds a waiting row's slot; continuous
    batching frees it and parks the row's cache (`rollout.turns`)."""
    g = sampler.cfg.num_samples
    episodes = envs.Episodes(env, lambda row: prompts[row // g], max_turns, turn_reward, max_obs_tokens)
    turns = Turns(episodes.respond, release=sampler.cfg.batching == "continuous", max_obs=max_obs_tokens)
    batch = sampler.generate(params, prompts, key, version, refresh, turns=turns)
    tokens, real = np.asarray(batch.tokens), np.asarray(batch.input_mask) > 0
    obs = real & (np.asarray(batch.loss_mask) == 0)
    p = tokens.shape[1] - sampler.cfg.max_new_tokens
    rows = range(len(tokens))
    for r in rows:
        keep = real[r, p:]
        episodes.finish(r, tokens[r, p:][keep], obs[r, p:][keep])
    truncated = np.asarray(batch.truncated) | np.isin(np.arange(len(tokens)), sorted(episodes.truncated))
    metrics = episodes.metrics(list(rows))
    metrics["episode/obs_tokens"] = float(obs[:, p:].sum(1).mean())
    return batch.replace(rewards=episodes.rewards(rows), truncated=truncated), metrics
