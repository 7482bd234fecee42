"""Multi-turn tasks: the settings they share (`TurnConfig`), their environment built on first use
(`Environments`: its tool workers start then), and generation of episodes with a sampler.

A task is multi-turn when it has `turn` (a `TurnConfig`), `turn_stop_ids` (tokens that end a
model turn) and `environment()`. Everything downstream reads the episode as one row exactly as
sampled (`rollout.turns`): observation tokens carry loss mask 0 and version -1, so the learner,
every objective and every staleness policy see a single-turn batch whose masked spans sit inside it.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.rollout.turns import Turns
from jaxrl_llm.tasks import envs


@dataclasses.dataclass(frozen=True)
class TurnConfig:
    """A multi-turn task's settings (the `task` section's fields of the same names)."""

    env: str = "calculator"  # the registered environment (`envs.names()`)
    max_turns: int = 4  # model turns per episode; the last one allowed ends it (flagged truncated)
    turn_reward: str = "last"  # sum | last: how the turns' rewards make the episode's
    max_obs_tokens: int = 64  # tokens an observation may append (longer ones are cut, counted)
    tool_timeout: float = 5.0  # seconds a tool call may run before it is killed
    tool_workers: int = 1  # sandboxed tool processes
    tool_isolation: str = "full"  # full: refuse tool workers without namespaces | weak: run them anyway


def is_multi_turn(task) -> bool:
    return getattr(task, "turn", None) is not None


class Environments:
    """A task's environment, made on first use (`get`) with a sandboxed `ToolRunner` of its
    own, closed with the task."""

    def __init__(self, task, cfg: TurnConfig):
        self.task, self.cfg, self._env, self._runner = task, cfg, None, None
        self._lock = threading.Lock()

    def get(self) -> envs.Environment:
        from jaxrl_llm.tasks.sandbox import ToolRunner

        with self._lock:
            if self._env is None:
                self._runner = ToolRunner(self.cfg.tool_workers, self.cfg.tool_timeout,
                                          require=self.cfg.tool_isolation == "full")
                self._env = envs.make(self.cfg.env, self.task, self._runner)
            return self._env

    def close(self) -> None:
        with self._lock:
            if self._env is not None and hasattr(self._env, "close"):
                self._env.close()
            if self._runner is not None:
                self._runner.close()
            self._env = self._runner = None


def episodes(task, prompt_of) -> envs.Episodes:
    """Bookkeeping for a generation or a stream of `task`'s episodes (`prompt_of(row)`: prompt ids)."""
    c = task.turn
    return envs.Episodes(task.environment(), prompt_of, c.max_turns, c.turn_reward, c.max_obs_tokens)


def turns(eps: envs.Episodes, release: bool, max_obs: int) -> Turns:
    return Turns(eps.respond, release=release, max_obs=max_obs)


def settle(eps: envs.Episodes, batch: TrajectoryBatch, rows, prompt_width: int):
    """Rows `rows` of `batch` (host arrays; `rows[i]` is batch row i's id in `eps`) have ended:
    their final turns are scored and their episodes handed over. Returns (the batch with rewards
    and truncation flags, `envs.TOTALS` sums)."""
    for row, (episode, obs) in zip(rows, episode_rows(batch.tokens, batch.input_mask, batch.loss_mask, prompt_width)):
        eps.finish(row, episode, obs)
    rewards, cut, totals = eps.take(rows)
    truncated = np.asarray(batch.truncated) | cut
    return batch.replace(rewards=rewards, truncated=truncated), totals


def episode_rows(tokens_BxL, input_mask_BxL, loss_mask_BxL, prompt_width: int):
    """Each row's episode after its prompt: (token ids, observation flags), padding dropped
    (observations: real tokens without loss)."""
    real = np.asarray(input_mask_BxL) > 0
    obs = real & (np.asarray(loss_mask_BxL) == 0)
    for toks, keep, o in zip(np.asarray(tokens_BxL)[:, prompt_width:], real[:, prompt_width:], obs[:, prompt_width:]):
        yield toks[keep], o[keep]


def generate(sampler, task, params, prompts, key, version: int = 0, refresh=None):
    """Episodes of `prompts` (G rows each) -> (batch with each episode's reward, `envs.TOTALS`
    sums). Static batching holds a waiting row's slot; continuous batching frees it and parks
    the row's cache (`rollout.turns`)."""
    g = sampler.cfg.num_samples
    eps = episodes(task, lambda row: prompts[row // g])
    t = turns(eps, sampler.cfg.batching == "continuous", task.turn.max_obs_tokens)
    batch = jax.tree.map(np.asarray, sampler.generate(params, prompts, key, version, refresh, turns=t))
    p = batch.tokens.shape[1] - sampler.cfg.max_new_tokens
    return settle(eps, batch, list(range(len(batch.tokens))), p)



def replay(task, prompt, episode, obs, budget: int, timeout: float = 60.0):
    """Play a claimed episode (from a sampler node) against the task's environment again: every
    model turn that called a tool is answered anew, and the answer must be the observation the
    row holds (cut only where the row's `budget` of new tokens ran out), the episode must end
    where the environment or the turn limit ends it, and its reward is recomputed. Returns
    (reward, None), or (nan, what differs)."""
    env, c = task.environment(), task.turn
    episode, obs = [int(t) for t in episode], [bool(o) for o in obs]
    n, i, turn, rewards = len(episode), 0, 0, []
    while i < n:
        j = next((k for k in range(i, n) if obs[k]), n)  # the model turn is [i, j)
        called = j > i and episode[j - 1] in env.stop_ids
        if j < n and not called:
            return float("nan"), f"an observation at token {j} follows no tool call"
        if not called or j >= budget:  # EOS or the budget ended the episode
            break
        turn += 1
        if turn >= c.max_turns:  # the turn limit: the episode ends with this turn
            if j < n:
                return float("nan"), f"the episode goes on past task.max_turns={c.max_turns}"
            break
        reply = env.reply(prompt, episode[:j], obs[:j]).result(timeout=timeout)
        want = tuple(reply.obs_ids)[:min(c.max_obs_tokens, budget - j)]
        k = next((m for m in range(j, n) if not obs[m]), n)
        if reply.done or not want:
            if j < n:
                return float("nan"), f"the episode goes on after the environment ended it at token {j}"
            if reply.done:
                return envs.combine(rewards + [reply.reward], c.turn_reward), None
            break
        if tuple(episode[j:k]) != want:
            return float("nan"), f"the observation at token {j} is not the environment's answer"
        rewards.append(float(reply.reward))
        i = k
    return envs.combine(rewards + [float(env.final(prompt, episode, obs))], c.turn_reward), None
