"""The scoring stage: rewards of whole prompt groups, beside decoding.

A task either scores in-process (`task.reward(prompt, completion)`: cheap rewards such as the
embedded arithmetic task) or names a checker to run in worker processes with a hard per-sample
timeout (`pool.WorkerPool`):

    task.checker                  a module-level function: checker(*args) -> float
    task.checker_imports          modules a worker imports before its first check
    task.checker_warmup           (optional) args of one call a fresh worker makes first
    task.check_args(prompt, completion) -> float | tuple
                                  a reward decided in-process (a fast path), or the args of
                                  one checker call

`Scorer.submit` returns at once: a scorer thread computes in-process rewards (and fast paths)
and hands the rest to `task.reward_workers` processes, one job per prompt group, while the
sampler goes on decoding. A check that raises, returns a non-finite value or overruns the
timeout scores 0 and is counted; it never stops the run.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np

from jaxrl_llm.tasks.pool import WorkerPool


def default_workers() -> int:
    return min(2, os.cpu_count() or 1)


class Scored:
    """Rewards being computed: `result()` -> (rewards [rows] float32, failures); `done()`.
    `seconds`: what scoring cost the caller's thread (waiting in `result`, or scoring in it)."""

    def __init__(self, rows: int):
        self._rewards, self._failures = np.zeros(rows, np.float32), 0
        self._parts: list = []  # (worker-pool future, rows)
        self._started: Optional[Future] = None  # the scorer thread's pass over the rows
        self.seconds = 0.0

    @classmethod
    def given(cls, rewards) -> "Scored":
        """Rewards known already (a multi-turn episode's, settled as it ended)."""
        out = cls(len(rewards))
        out._rewards[:] = rewards
        return out

    def done(self) -> bool:
        return (self._started is None or self._started.done()) and all(f.done() for f, _ in self._parts)

    def result(self):
        t = time.perf_counter()
        if self._started is not None:
            self._started.result()  # re-raises what broke the scorer thread
            self._started = None
        for future, rows in self._parts:
            for row, (value, error) in zip(rows, future.result()):
                self._put(row, value, error)
        self._parts = []
        self.seconds += time.perf_counter() - t
        return self._rewards, self._failures

    def _put(self, row: int, value, error) -> None:
        try:
            value = float(value) if error is None else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if math.isfinite(value):
            self._rewards[row] = value
        else:
            self._failures += 1


class Scorer:
    """Rewards of sampled rows, row i answering prompts[i // group_size]: `task.reward` for
    tasks without a checker or with `workers=0` (no timeout), else the checker in a
    `WorkerPool` of `workers` processes. With `background` a scorer thread does the in-process
    part, so `submit` returns at once; else `submit` does it in the caller's thread."""

    def __init__(self, task, workers: int = 0, timeout: float = 5.0, background: bool = True):
        self.task = task
        self.pool = None
        self.in_process = self.in_workers = 0  # samples scored in this process / sent to the workers
        if hasattr(task, "checker") and workers > 0:
            warmup = getattr(task, "checker_warmup", None)
            self.pool = WorkerPool(workers, timeout, preload=getattr(task, "checker_imports", ()),
                                   warmup=warmup and (task.checker, warmup))
        self._background, self._thread, self._lock = background, None, threading.Lock()

    def submit(self, prompts, tokens, mask, group_size: int) -> Scored:
        """Start scoring `tokens[i][mask[i]]` (numpy [rows, L])."""
        scored = Scored(len(tokens))
        if not self._background:
            t = time.perf_counter()
            self._fill(scored, prompts, tokens, mask, group_size)
            scored.seconds = time.perf_counter() - t
            return scored
        with self._lock:  # sampler threads share the scorer
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="scorer")
            scored._started = self._thread.submit(self._fill, scored, prompts, tokens, mask, group_size)
        return scored

    def _fill(self, scored: Scored, prompts, tokens, mask, group_size: int) -> None:
        if not len(tokens):
            return
        lengths = mask.sum(1)
        completions = np.split(tokens[mask], np.cumsum(lengths)[:-1])  # row i's completion tokens
        if self.pool is None:
            for i, completion in enumerate(completions):
                try:
                    value, error = self.task.reward(prompts[i // group_size], completion.tolist()), None
                except Exception as e:
                    value, error = None, repr(e)
                scored._put(i, value, error)
            self.in_process += len(completions)
            return
        for start in range(0, len(completions), group_size):  # one job per group: groups spread over the workers
            jobs, job_rows = [], []
            for i in range(start, min(start + group_size, len(completions))):
                try:
                    args = self.task.check_args(prompts[i // group_size], completions[i].tolist())
                except Exception as e:
                    scored._put(i, None, repr(e))
                    continue
                if isinstance(args, tuple):
                    jobs.append(args)
                    job_rows.append(i)
                else:  # decided without the checker (the fast path)
                    scored._put(i, args, None)
                    self.in_process += 1
            self.in_workers += len(jobs)
            if jobs:
                scored._parts.append((self.pool.submit(self.task.checker, jobs), job_rows))

    def score(self, prompts, tokens, mask, group_size: int):
        """(rewards, failures) of a batch, waiting for them."""
        return self.submit(prompts, tokens, mask, group_size).result()

    def pause(self) -> None:
        """Let the scorer thread finish what it has and end (between runs); the next `submit`
        starts another. The worker processes stay warm."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)

    def close(self) -> None:
        self.pause()
        if self.pool is not None:
            self.pool.close()
