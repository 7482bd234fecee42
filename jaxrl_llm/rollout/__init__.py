"""Rollout: the jitted sampler that produces version-tagged TrajectoryBatches."""

from jaxrl_llm.rollout.sampler import Sampler, SamplerConfig, sampling_logprobs  # noqa: F401
