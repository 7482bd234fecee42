"""Where a test's time goes: with JAXRL_TEST_TIMING=FILE, one JSON line per test with its wall
time, the in-process seconds spent tracing, lowering and compiling (XLA compilation includes
persistent-cache reads), persistent-cache hits and misses, and subprocesses started.
`python -m experiments.test_timing FILE` summarises the file by test file."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import jax

FILE = os.environ.get("JAXRL_TEST_TIMING")
DURATIONS = {"/jax/core/compile/backend_compile_duration": "compile_s",
             "/jax/core/compile/jaxpr_trace_duration": "trace_s",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s"}
COUNTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}
_current: dict = {}


def _on_duration(event, duration, **_):
    if event in DURATIONS and _current:
        _current[DURATIONS[event]] += duration


def _on_event(event, **_):
    if event in COUNTS and _current:
        _current[COUNTS[event]] += 1


_popen_init = subprocess.Popen.__init__


def _counting_init(self, *args, **kwargs):
    if _current:
        _current["subprocesses"] += 1
    _popen_init(self, *args, **kwargs)


if FILE:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    subprocess.Popen.__init__ = _counting_init


@contextlib.contextmanager
def record(nodeid: str):
    if not FILE:
        yield
        return
    _current.update(nodeid=nodeid, worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), start=time.time(),
                    **{k: 0.0 for k in DURATIONS.values()}, **{k: 0 for k in COUNTS.values()}, subprocesses=0)
    start = time.perf_counter()
    try:
        yield
    finally:
        _current["wall_s"] = time.perf_counter() - start
        with open(FILE, "a") as f:
            f.write(json.dumps(_current) + "\n")
        _current.clear()
