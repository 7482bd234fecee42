"""jaxrl_llm: asynchronous RL post-training of language models in JAX/Flax."""

from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch  # noqa: F401

__version__ = "0.1.0"
