"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476, Sec. 3.2 and eq. 11's constraint
0 < |{o_i : is_equivalent(a, o_i)}| < G): a prompt group whose G rewards are all equal has zero
advantage everywhere under group normalisation, so it trains nothing; it is dropped before the
learner sees it and more prompts are drawn until the batch holds `prompts_per_batch` groups that
carry signal. verl's `algorithm.filter_groups` (metric std > 0, groups of one kept,
`max_num_gen_batches`) is the reference code; prose and code agree.

`runtime.dynamic_sampling=True` turns it on; `runtime.dynamic_min_std` > 0 asks for a reward
standard deviation of at least that instead of "not all equal". A batch may take at most
`runtime.dynamic_max_draws` draws; short of groups after them, it is filled with the dropped
groups of its last draws (zero advantage: they train nothing, and the batch keeps its shape, so
nothing recompiles and every process steps together), and `dynamic/capped` says so. verl raises
instead; a run that has solved its task would then stop.

Where a mode runs it: the sequential modes refill in the learner's thread (`Refill`); the async
mode's sampler threads drop groups before the queue (`Gate`), delivering them to the data
position as consumed, so a resumed run draws them neither again nor twice.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jaxrl_llm import advantages
from jaxrl_llm.batch import TrajectoryBatch


def informative(rewards_B, group_size: int, min_std: float = 0.0) -> np.ndarray:
    """bool[groups]: which groups (rows group-major, `group_size` each) carry a learning signal:
    rewards not all equal (`advantages.nonzero_variance`, the rule `mask_zero_variance` and the
    `tokens/informative` metric use), or (min_std > 0) a population standard deviation >= min_std.
    A group of one is always kept (verl's rule: its std is undefined, and GRPO gives it its own value)."""
    r = np.asarray(rewards_B, np.float64).reshape(-1, group_size)
    if group_size == 1:
        return np.ones(len(r), bool)
    if min_std > 0:
        return r.std(1) >= min_std
    groups = np.repeat(np.arange(len(r)), group_size)
    return np.asarray(advantages.nonzero_variance(r.ravel(), groups))[::group_size] > 0


def groups_of(batch: TrajectoryBatch, group_size: int) -> list:
    """A batch's prompt groups, each a batch of `group_size` rows."""
    batch = jax.tree.map(np.asarray, batch)
    return [jax.tree.map(lambda x, i=i: x[i * group_size:(i + 1) * group_size], batch)
            for i in range(batch.shape[0] // group_size)]


class Refill:
    """The groups gathered toward one learner batch in the learner's thread: `add` each draw's
    scored batch until `full` (or `max_draws` draws), then `batch()`."""

    def __init__(self, groups: int, group_size: int, min_std: float, max_draws: int):
        self.groups, self.group_size, self.min_std, self.max_draws = groups, group_size, min_std, max_draws
        self.kept: list = []
        self.dropped: list = []
        self.draws = 0

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.groups

    @property
    def done(self) -> bool:
        return self.full or self.draws >= self.max_draws

    def add(self, batch: TrajectoryBatch) -> None:
        self.draws += 1
        keep = informative(batch.rewards, self.group_size, self.min_std)
        for group, k in zip(groups_of(batch, self.group_size), keep):
            (self.kept if k else self.dropped).append(group)

    def batch(self) -> TrajectoryBatch:
        """`groups` informative groups (the first drawn; extras of the last draw are discarded,
        as verl does), or, capped, all of them and the most recently dropped groups after."""
        short = max(self.groups - len(self.kept), 0)
        chosen = self.kept[:self.groups] + (self.dropped[len(self.dropped) - short:] if short else [])
        return TrajectoryBatch.concat(chosen)

    def metrics(self) -> dict:
        return {"dynamic/draws": float(self.draws), "dynamic/dropped_groups": float(len(self.dropped)),
                "dynamic/fill": min(len(self.kept), self.groups) / self.groups,
                "dynamic/capped": float(not self.full)}


class Gate:
    """An async sampler thread's filter before the queue: `passes(group)` is False for a group to
    drop, except that after `limit` drops in a row one goes through (counted `forced`), so a run
    whose prompts are all solved still trains instead of waiting forever."""

    def __init__(self, group_size: int, min_std: float, limit: int):
        self.group_size, self.min_std, self.limit = group_size, min_std, limit
        self.seen = self.dropped = self.forced = 0  # groups, over the run; only the thread writes them
        self._streak = 0

    def passes(self, group: TrajectoryBatch) -> bool:
        self.seen += 1
        if informative(group.rewards, self.group_size, self.min_std)[0]:
            self._streak = 0
            return True
        if self._streak >= self.limit:
            self._streak, self.forced = 0, self.forced + 1
            return True
        self._streak += 1
        self.dropped += 1
        return False


def gate_metrics(gates, before: Optional[dict], groups: int) -> tuple[dict, dict]:
    """(this step's metrics, the totals to diff against next step) over the async threads' gates."""
    now = {k: sum(getattr(g, k) for g in gates) for k in ("seen", "dropped", "forced")}
    before = before or dict.fromkeys(now, 0)
    d = {k: now[k] - before[k] for k in now}
    return {"dynamic/dropped_groups": float(d["dropped"]), "dynamic/draws": d["seen"] / groups,
            "dynamic/forced": float(d["forced"])}, now
