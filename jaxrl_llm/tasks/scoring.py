"""The scoring stage: rewards of whole prompt groups, beside decoding.

A task either scores in-process (`task.reward(prompt, completion)`: cheap rewards such as the
embedded arithmetic task) or names a checker to run in worker processes with a hard per-sample
timeout (`pool.WorkerPool`):

    task.checker                  a module-level function: checker(*args) -> float
    task.checker_imports          modules a worker imports before its first check
    task.check_args(prompt, completion) -> float | tuple
                                  a reward decided in-process (a fast path), or the args of
                                  one checker call

`Scorer.submit` returns at once; the groups are checked in parallel by `task.reward_workers`
processes while the sampler goes on decoding. A check that raises, returns a non-finite value
or overruns the timeout scores 0 and is counted; it never stops the run.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from jaxrl_llm.tasks.pool import WorkerPool


def default_workers() -> int:
    return min(2, os.cpu_count() or 1)


def uses_workers(task) -> bool:
    return hasattr(task, "checker")


class Scored:
    """Rewards being computed: `result()` -> (rewards [rows] float32, failures); `done()`."""

    def __init__(self, rewards: np.ndarray, failures: int, parts: Sequence[tuple] = ()):
        self._rewards, self._failures, self._parts = rewards, failures, list(parts)  # (future, rows)

    def done(self) -> bool:
        return all(f.done() for f, _ in self._parts)

    def result(self):
        for future, rows in self._parts:
            for row, (value, error) in zip(rows, future.result()):
                self._put(row, value, error)
        self._parts = []
        return self._rewards, self._failures

    def _put(self, row: int, value, error) -> None:
        try:
            value = float(value) if error is None else float("nan")
        except (TypeError, ValueError):
            value = float("nan")
        if np.isfinite(value):
            self._rewards[row] = value
        else:
            self._failures += 1


class Scorer:
    """Rewards of sampled rows, row i answering prompts[i // group_size]. In this thread for
    tasks without a checker or with `workers=0` (`task.reward`: no timeout), else in a
    `WorkerPool` of `workers` processes, one job per prompt group."""

    def __init__(self, task, workers: int = 0, timeout: float = 5.0):
        self.task = task
        self.pool = None
        if uses_workers(task) and workers > 0:
            self.pool = WorkerPool(workers, timeout, preload=getattr(task, "checker_imports", ()))

    @property
    def timeouts(self) -> int:
        return 0 if self.pool is None else self.pool.timeouts

    def submit(self, prompts, tokens, mask, group_size: int) -> Scored:
        """Start scoring `tokens[i][mask[i]]` (numpy [rows, L]); returns at once when a pool
        checks them, else after scoring in this thread."""
        rows = len(tokens)
        scored = Scored(np.zeros(rows, np.float32), 0)
        if self.pool is None:
            for i in range(rows):
                try:
                    value, error = self.task.reward(prompts[i // group_size], tokens[i][mask[i]].tolist()), None
                except Exception as e:
                    value, error = None, repr(e)
                scored._put(i, value, error)
            return scored
        for start in range(0, rows, group_size):  # one job per group: groups spread over the workers
            jobs, job_rows = [], []
            for i in range(start, min(start + group_size, rows)):
                try:
                    args = self.task.check_args(prompts[i // group_size], tokens[i][mask[i]].tolist())
                except Exception as e:
                    scored._put(i, None, repr(e))
                    continue
                if isinstance(args, tuple):
                    jobs.append(args)
                    job_rows.append(i)
                else:  # decided without the checker (the fast path)
                    scored._put(i, args, None)
            if jobs:
                scored._parts.append((self.pool.submit(self.task.checker, jobs), job_rows))
        return scored

    def score(self, prompts, tokens, mask, group_size: int):
        """(rewards, failures) of a batch, waiting for them."""
        return self.submit(prompts, tokens, mask, group_size).result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
