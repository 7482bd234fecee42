"""Rollout: the jitted sampler that produces version-tagged TrajectoryBatches, behind the
rollout backend interface the runtime uses (`backend.RolloutBackend`, backends by name).

It imports `models`, `parallel`, `batch` and `validation`; never the learner, the runtime, a run
or its files (a backend serves any driver)."""

from jaxrl_llm.rollout.decode import DecodeState  # noqa: F401
from jaxrl_llm.rollout.sampler import Sampler  # noqa: F401
from jaxrl_llm.rollout.sampling import SamplerConfig, sampling_logprobs  # noqa: F401
