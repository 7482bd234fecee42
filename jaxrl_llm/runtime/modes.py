"""The sequential modes, one small object each, with the interface every mode has (the async
one too, `async_mode.AsyncMode`):

    start()                 before a run() call's steps
    next_batch(version)     the batch the learner trains at `version`
    trained(batch) -> dict  after that step was trained and published: the mode's metrics
    stop()                  after the run() call (also on errors)
    reward_failures         rewards that raised, over the whole run

Schedules follow the learner version, not the position within one run() call, so chunked runs
(eval / checkpoint boundaries) and resumed runs keep them; prompts are drawn per version.
"""

from __future__ import annotations

import abc
import time

import numpy as np

from jaxrl_llm.runtime.delay import DelayModel
from jaxrl_llm.runtime.producer import Producer
from jaxrl_llm.runtime.weights import WeightStore


class Sequential(abc.ABC):
    """Sampling in the learner's thread: the learner waits while a batch is produced."""

    def __init__(self, producer: Producer, store: WeightStore):
        self.producer, self.store = producer, store
        self.reward_failures = 0
        self._start, self._sampling, self._scoring, self._steps = 0.0, 0.0, 0.0, 0  # per run() call (`start`)

    def start(self) -> None:
        self._start, self._sampling, self._scoring, self._steps = time.perf_counter(), 0.0, 0.0, 0

    def stop(self) -> None:
        pass

    def next_batch(self, version: int):
        t = time.perf_counter()
        batch = self.batch(version)
        self._sampling += time.perf_counter() - t
        return batch

    def trained(self, batch) -> dict:
        """Cumulative over this run() call, like async: the learner idles while sampling."""
        self._steps += 1
        elapsed = time.perf_counter() - self._start
        return {"runtime/sampler_busy": self._sampling / elapsed, "runtime/learner_idle": self._sampling / elapsed,
                "runtime/score_wait": self._scoring / elapsed,
                "runtime/samples_per_s": self._steps * batch.shape[0] / elapsed}

    @abc.abstractmethod
    def batch(self, version: int):
        """The batch this mode trains at learner `version`."""

    def _produce(self, params, version: int, counter: int):
        pending = self.producer.generate(params, version, 0, counter)
        batch, failures = pending.result()
        self._scoring += pending.score_s
        self.reward_failures += failures
        return batch


class Sync(Sequential):
    """v = 1, i = 1: generate with the newest params, train, repeat (on-policy baseline)."""

    def batch(self, version):
        v, params = self.store.latest()
        return self._produce(params, v, version)


class OffPolicy(Sequential):
    """v > 1, i = 1: sampler params refreshed every `refresh_every` steps (Mroueh et al.,
    "Revisiting Group Relative Policy Optimization", arXiv:2505.22257)."""

    def __init__(self, producer, store, refresh_every: int):
        super().__init__(producer, store)
        self.every, self._sampled = refresh_every, None

    def batch(self, version):
        if version % self.every == 0 or self._sampled is None:  # None mid-cycle: resumed
            self._sampled = self.store.latest()
        return self._produce(self._sampled[1], self._sampled[0], version)


class Iterative(Sequential):
    """v = 1, i > 1: each batch is trained on `reuse` times (staleness 0 .. i - 1)."""

    def __init__(self, producer, store, reuse: int):
        super().__init__(producer, store)
        self.reuse, self._held = reuse, None

    def batch(self, version):
        if version % self.reuse == 0 or self._held is None:  # None mid-cycle: resumed; same prompts, restored params
            self._held = self._produce(self.store.latest()[1], version, version - version % self.reuse)
        return self._held


class Simulated(Sequential):
    """Each batch's staleness d is drawn from the delay model (in learner steps, capped by
    `max_staleness`) and realised by sampling with the params of version k - d, retained in the
    weight store: deterministic, bit-reproducible sweeps."""

    def __init__(self, producer, store, delay: DelayModel, rng: np.random.Generator, step_seconds: float,
                 max_staleness: int):
        super().__init__(producer, store)
        self.delay, self.rng, self.step_seconds, self.max_staleness = delay, rng, step_seconds, max_staleness

    def batch(self, version):
        # Capped by the oldest params retained: right after a resume only the restored
        # version is (past params are not checkpointed), so the first steps run fresher.
        d = min(int(self.delay.steps(self.rng, self.step_seconds, self.max_staleness)),
                version - self.store.versions[0])
        return self._produce(self.store.get(version - d), version - d, version)
