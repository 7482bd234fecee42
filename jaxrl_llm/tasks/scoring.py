"""Rewards with a hard per-sample timeout.

Symbolic checkers (sympy behind math-verify) can take unbounded time on adversarial output,
and their own signal-based timeouts only work in the main thread, while async samplers score
from worker threads. So a reward runs in a separate process: a call that overruns is
abandoned, its worker killed and replaced, and the sample scores the default (counted).
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any, Callable


class TimeoutPool:
    """`call(fn, *args)` -> (value, error) with `error` in {None, "timeout", "<ExcType>: msg"}.

    `fn` must be picklable (a module-level function). Thread-safe; calls are serialised, which
    keeps a timed-out worker from taking innocent calls down with it."""

    def __init__(self, timeout: float = 5.0, default: Any = 0.0, preload: tuple = ()):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout}")
        self.timeout, self.default, self.preload = timeout, default, tuple(preload)
        self.timeouts = 0
        self.errors = 0
        self._lock = threading.Lock()
        self._pool = None

    def _ensure(self):
        if self._pool is None:
            # spawn: never fork a process that holds JAX/XLA threads.
            self._pool = multiprocessing.get_context("spawn").Pool(1)
            # Import heavy modules (sympy) before the clock starts, not inside the first call.
            self._pool.apply(_import, (self.preload,))
        return self._pool

    def call(self, fn: Callable, *args):
        with self._lock:
            result = self._ensure().apply_async(fn, args)
            try:
                return result.get(self.timeout), None
            except multiprocessing.TimeoutError:
                self.timeouts += 1
                self._pool.terminate()  # the worker may be stuck in C code: kill it
                self._pool = None
                return self.default, "timeout"
            except Exception as e:  # raised inside fn
                self.errors += 1
                return self.default, f"{type(e).__name__}: {e}"

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _import(modules: tuple) -> None:
    import importlib
    import logging

    for m in modules:
        importlib.import_module(m)
    logging.disable(logging.WARNING)  # math-verify warns on every call that timeouts are ours
