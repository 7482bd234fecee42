"""run/xla.py: a run's process-wide JAX settings and its compile log."""

import os
import threading

import jax
import jax.numpy as jnp

from jaxrl_llm.run import xla


def test_matmul_precision_reaches_programs_traced_on_any_thread():
    """model.matmul_precision is process-wide for the run (sampler threads trace too), restored after."""
    x = jnp.ones((4, 4))
    lowered = lambda: jax.jit(lambda a, b: a @ b * 2.0).lower(x, x).as_text()  # noqa: E731
    seen = []
    with xla.matmul_precision("highest"):
        t = threading.Thread(target=lambda: seen.append(lowered()))
        t.start()
        t.join()
        assert "precision = [HIGHEST, HIGHEST]" in lowered()
    assert "precision = [HIGHEST, HIGHEST]" in seen[0] and "precision = [DEFAULT, DEFAULT]" in lowered()


def test_deterministic_asks_xla_gpu_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    xla.set_deterministic(True)
    xla.set_deterministic(True)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true"


def test_compile_log_counts_programs_on_any_thread_and_cache_hits(tmp_path):
    """Compilations on any thread are counted by name; with the persistent cache a second,
    identical program (new jit object, same computation) is loaded, and counted as a hit."""
    x = jnp.arange(6.0)
    session = jax.config.jax_compilation_cache_dir  # the test session's own cache (tests/processes.py)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with xla.compilation_cache(str(tmp_path)), xla.CompileLog() as log:
            jax.jit(lambda v: jnp.sin(v) * 3.0)(x).block_until_ready()
            t = threading.Thread(target=lambda: jax.jit(lambda v: jnp.cos(v) - 1.0)(x).block_until_ready())
            t.start()
            t.join()
            first = log.drain()
            jax.jit(lambda v: jnp.sin(v) * 3.0)(x).block_until_ready()  # the same program: from the cache
            again = log.drain()
            with xla.compilation_cache(str(tmp_path / "inner")):  # inside a sweep's cache: the outer one stays
                assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    finally:
        jax.config.update("jax_compilation_cache_dir", session)
    assert first["compile/programs"] == 2 and first["compile/cache_hits"] == 0 and first["compile/seconds"] > 0
    assert again["compile/programs"] == 1 and again["compile/cache_hits"] == 1
    assert len(os.listdir(tmp_path)) == 2 and log.slowest() == [("jit(<lambda>)", log.total["jit(<lambda>)"])]
