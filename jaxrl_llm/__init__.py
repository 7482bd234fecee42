"""jaxrl_llm: asynchronous RL post-training of language models in JAX/Flax."""

import os

# XLA:CPU's concurrency-optimised scheduler orders a backward pass for parallelism and keeps
# every layer's activations live at once, so rematerialisation would save nothing (the memory
# plan's remat figures assume it off). Set here, before JAX starts its CPU backend, unless the
# user chose a value; no effect on other platforms.
_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_FLAG}=false".strip()

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: scoring worker processes import a task module without paying for JAX.
    if name in ("PolicyOutput", "TrajectoryBatch"):
        from jaxrl_llm import batch

        return getattr(batch, name)
    raise AttributeError(f"module 'jaxrl_llm' has no attribute {name!r}")
