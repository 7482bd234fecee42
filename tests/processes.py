"""What the test session's processes share: one environment, one compilation cache, one CPU.

The README's command runs the suite in two pytest-xdist workers. Each worker, and each
subprocess a test starts (launcher runs, fresh-process resumes, sampler nodes), inherits the
environment `configure_session` sets in the first process, so they all read and write one
persistent XLA compilation cache. Tests marked `serial` start several JAX processes at once or
depend on wall-clock deadlines; `turn` runs each of them with no other test beside it, so the
two cores are never shared by more than one test's processes.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = "JAXRL_TEST_SHARED"
FAKE_DEVICES = "--xla_force_host_platform_device_count=8"  # sharding tests on one CPU
# The programs under test are the same HLO; XLA:CPU codegen without LLVM optimisation and with its
# older fusion emitters compiles them about 3x faster, and compilation is most of the suite's time.
# Neither changes a result: LLVM without fast-math does not reassociate floating-point arithmetic.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def configure_session() -> None:
    """Environment for this process and everything it starts; the first process creates the
    shared directory and removes it when it exits."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network (hub ids resolve from local caches only)
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_force_host_platform_device_count") for f in flags):
        flags.append(FAKE_DEVICES)
    flags += [f for f in FAST_COMPILE if f.split("=")[0] not in " ".join(flags)]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if SHARED not in os.environ:
        shared = tempfile.mkdtemp(prefix="jaxrl_llm_tests_")
        os.environ[SHARED] = shared
        atexit.register(shutil.rmtree, shared, ignore_errors=True)
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # a user's own cache dir is respected
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ[SHARED], "xla_cache")
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def env() -> dict:
    """The environment for a subprocess that sets its own device count (`cpu_devices`)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FAKE_DEVICES.split("=")[0])]
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": " ".join(flags)}


def _lock(name: str, mode: int):
    fd = os.open(os.path.join(os.environ[SHARED], name), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, mode)
    return fd


@contextlib.contextmanager
def turn(serial: bool):
    """Hold the CPU for one test: shared by ordinary tests, exclusive for a serial one. A serial
    test waiting at the gate keeps new ordinary tests out, so it is not starved."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    gate = _lock("gate.lock", fcntl.LOCK_EX)
    try:
        cpu = _lock("cpu.lock", fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    finally:
        os.close(gate)  # closing the descriptor releases its lock
    try:
        yield
    finally:
        os.close(cpu)
