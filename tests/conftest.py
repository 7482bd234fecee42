import os

# Fake 8 CPU devices for sharding tests; must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network (hub ids resolve from local caches only)
# One persistent compilation cache for the session, this process and the subprocesses it starts
# (launcher tests, fresh-process resumes): identical programs compile once (~7 s per launch).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl_llm_test_xla_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

from hypothesis import settings  # noqa: E402

# jit compilation makes first examples slow; correctness, not speed, is under test.
settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")

import jax  # noqa: E402

# Implicit rank promotion hides shape bugs ([B] + [B, L] broadcasting silently): make it an error.
jax.config.update("jax_numpy_rank_promotion", "raise")
