"""Rollout: the jitted sampler that produces version-tagged TrajectoryBatches."""

from jaxrl_llm.rollout.decode import DecodeState  # noqa: F401
from jaxrl_llm.rollout.sampler import Sampler  # noqa: F401
from jaxrl_llm.rollout.sampling import SamplerConfig, sampling_logprobs  # noqa: F401
