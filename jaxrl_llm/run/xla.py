"""What a run asks of JAX and XLA, process-wide: CPU devices, determinism, matmul precision,
the persistent compilation cache, and a log of what was compiled and how long it took.

`set_cpu_devices` and `set_deterministic` must run before the backend starts; the context
managers restore JAX's previous settings on exit (tests and sweeps run many runs in one process).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading

import jax

# JAX's events: one program compiled or loaded from the persistent cache (its seconds and
# `fun_name`), and one such load.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def set_cpu_devices(n: int) -> None:
    """Expose `n` CPU devices to JAX (-1: one per core; 0: leave JAX's default). Must run before
    the first JAX computation; samplers and the learner then split rows over them."""
    if n:
        jax.config.update("jax_num_cpu_devices", os.cpu_count() if n < 0 else n)


def set_deterministic(on: bool) -> None:
    """GPU: deterministic XLA ops (the embedding gradient's scatter-add among them). Must run
    before the backend starts, like `set_cpu_devices`; CPUs are deterministic already."""
    flag = "--xla_gpu_deterministic_ops=true"
    if on and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


@contextlib.contextmanager
def matmul_precision(value: str):
    """Within: float32 matmuls at `value` (jax_default_matmul_precision), process-wide, so that
    sampler threads trace with the learner's precision (JAX's context manager is per thread)."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None if value == "default" else value)
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@contextlib.contextmanager
def compilation_cache(directory: str, min_compile_s: float = 0.0):
    """Within: every program that took at least `min_compile_s` to compile is kept in
    `directory` (JAX's persistent cache), so a restarted run, or runs that differ only in seed
    or in values the programs take as inputs (a sweep's cells), compile once. Inside an outer
    cache (a sweep's, shared by its cells) the outer one stays. JAX's settings come back on exit."""
    if jax.config.jax_compilation_cache_dir:
        yield
        return
    settings = {"jax_compilation_cache_dir": directory, "jax_persistent_cache_min_compile_time_secs": min_compile_s,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {k: getattr(jax.config, k) for k in settings}
    try:
        for k, v in settings.items():
            jax.config.update(k, v)
        cc.reset_cache()  # JAX decides whether to use the cache once, at its first compile
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        cc.reset_cache()


class CompileLog:
    """Within: every program this process compiles or loads from the persistent cache (any
    thread), by function name. `drain()` gives the count, the loads among them and the seconds
    since the last drain (a step's metrics); `slowest(k)` the programs that took longest over
    the whole run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._new = {"compile/programs": 0, "compile/cache_hits": 0, "compile/seconds": 0.0}
        self.total = collections.Counter()

    def _timed(self, event: str, seconds: float, **kw) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self._new["compile/programs"] += 1
                self._new["compile/seconds"] += seconds
                self.total[kw.get("fun_name", "?")] += seconds

    def _event(self, event: str, **kw) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self._new["compile/cache_hits"] += 1

    def __enter__(self) -> "CompileLog":
        jax.monitoring.register_event_duration_secs_listener(self._timed)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._timed)
        jax.monitoring.unregister_event_listener(self._event)

    def drain(self) -> dict:
        with self._lock:
            out, self._new = self._new, {k: type(v)(0) for k, v in self._new.items()}
        return out

    def slowest(self, k: int = 5) -> list:
        with self._lock:
            return self.total.most_common(k)
