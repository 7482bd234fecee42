"""`n` samples per problem drawn from a policy through a rollout backend, scored by the task's
scoring stage, and summarised (`estimators`): what `python -m jaxrl_llm.evaluate` reports, and
`train.eval_samples` during training.

Problems go through the backend in chunks of `chunk` prompts (each chunk `chunk * n` rows; with
`sampler.batching=continuous` the rows stream through decode slots). Chunk j draws with
`fold_in(key, j)`, so the same key, weights and settings give the same samples on any run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

from jaxrl_llm import tasks
from jaxrl_llm.tasks import estimators
from jaxrl_llm.tasks import multiturn


@dataclasses.dataclass(frozen=True)
class Drawn:
    """Per problem (rows) and sample (columns)."""

    rewards: np.ndarray  # f32[P, N]
    lengths: np.ndarray  # i32[P, N]: generated tokens (a multi-turn episode's model turns)
    truncated: np.ndarray  # bool[P, N]: ended at the token limit (or the turn limit) without EOS
    answers: Optional[list]  # P lists of N final answers (None: none given); None when the task extracts none
    failed: int  # reward calls that raised or timed out (scored 0)


def draw(backend, params, task, scorer, prompts: Sequence[Sequence[int]], key, chunk: int = 64) -> Drawn:
    """`backend.cfg.num_samples` samples of every prompt, scored."""
    n, params = backend.cfg.num_samples, backend.place_params(params)
    extract = None if multiturn.is_multi_turn(task) else getattr(task, "final_answer", None)
    rewards, lengths, truncated, answers, failed = [], [], [], [], 0
    for j, start in enumerate(range(0, len(prompts), chunk)):
        part, k = list(prompts[start:start + chunk]), jax.random.fold_in(key, j)
        if multiturn.is_multi_turn(task):
            batch, _ = multiturn.generate(backend, task, params, part, k)
            r = np.asarray(batch.rewards, np.float32)
        else:
            batch = jax.tree.map(np.asarray, backend.generate(params, part, k))
            r, bad = scorer.score(part, batch.tokens, batch.loss_mask > 0, n)
            failed += int(bad)
        mask = np.asarray(batch.loss_mask) > 0
        rewards.append(np.asarray(r, np.float32).reshape(-1, n))
        lengths.append(mask.sum(1).reshape(-1, n))
        cut = np.zeros(len(mask), bool) if batch.truncated is None else np.asarray(batch.truncated, bool)
        truncated.append(cut.reshape(-1, n))
        if extract is not None:
            toks = np.asarray(batch.tokens)
            said = [extract(toks[i][mask[i]].tolist()) for i in range(len(toks))]
            answers += [said[i:i + n] for i in range(0, len(said), n)]
    return Drawn(np.concatenate(rewards), np.concatenate(lengths), np.concatenate(truncated),
                 answers if extract is not None else None, failed)


def success_threshold(task) -> float:
    """A sample succeeds (pass@k, maj@k) at the task's highest declared reward."""
    return float(getattr(task, "reward_range", tasks.UNDECLARED_RANGE)[1])


def report(drawn: Drawn, ks: Sequence[int], success: float, seed: int = 0) -> dict:
    """Mean reward, pass@k and maj@k (`estimators.summarise`), lengths and truncation, failures."""
    ok = drawn.rewards >= success
    out = estimators.summarise(drawn.rewards, ok, ks, drawn.answers, seed)
    out.update(estimators.lengths(drawn.lengths, drawn.truncated), success_threshold=success,
               reward_failures=drawn.failed)
    return out
