"""The training modes: one interface (`Mode`), a registry by name, and the sequential modes.

A mode decides who samples with which policy version and when the learner sees the batch:

    start()                 before a run() call's steps
    next_batch(version)     the batch the learner trains at `version` (the time spent here is idle)
    trained(batch) -> dict  after that step was trained and published: the mode's metrics
    stop()                  after the run() call (also on errors)
    close()                 at the end of the run (what outlives run() calls, e.g. a service)
    reward_failures         rewards that raised, over the whole run
    state() / load(state)   what a checkpoint keeps of the mode itself (the counters the modes
                            share, e.g. the data position, live in the orchestrator's `Context`)

Modes register by name (`register`), with their own config subsection and cross-field rules;
the orchestrator builds the configured one from the registry and imports none of them by name
beyond its own package (the remote mode registers itself from `jaxrl_llm.remote`).

Schedules follow the learner version, not the position within one run() call, so chunked runs
(eval / checkpoint boundaries) and resumed runs keep them; prompts are drawn per version.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any, Callable, Optional

import numpy as np

from jaxrl_llm import staleness
from jaxrl_llm import validation as V
from jaxrl_llm.runtime import dynamic
from jaxrl_llm.runtime.delay import DelayModel
from jaxrl_llm.runtime.lengths import LengthCounts
from jaxrl_llm.runtime.position import DataPosition
from jaxrl_llm.runtime.producer import Producer, Rollout
from jaxrl_llm.runtime.weights import WeightStore


@dataclasses.dataclass(frozen=True)
class Context:
    """What a mode is built from: the orchestrator's parts and the run-long counters it shares."""
    producer: Producer
    store: WeightStore
    cfg: Any  # the runtime section
    position: DataPosition  # what each sampler stream has delivered (async and remote share it)
    lengths: LengthCounts
    delay: DelayModel
    on_drop: Callable  # a queue dropped an item as over-stale
    learner: Any = None  # e.g. what a served node is told about the adapters
    node_config: Optional[dict] = None  # what a served node needs to build the task


class Mode(abc.ABC):
    """The interface above; keeps the time and rows of the current run() call."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._start, self._idle, self._rows = 0.0, 0.0, 0  # per run() call (`start`)

    @property
    @abc.abstractmethod
    def reward_failures(self) -> int:
        """Rewards that raised, over the whole run."""

    @abc.abstractmethod
    def _next(self, version: int):
        """The batch this mode trains at learner `version`."""

    def _metrics(self, batch, elapsed: float) -> dict:
        """The mode's own metrics after a trained step (`elapsed`: seconds into this run() call)."""
        return {}

    def start(self) -> None:
        self._start, self._idle, self._rows = time.perf_counter(), 0.0, 0

    def next_batch(self, version: int):
        t = time.perf_counter()
        batch = self._next(version)
        self._idle += time.perf_counter() - t
        return batch

    def trained(self, batch) -> dict:
        """Cumulative over this run() call."""
        self._rows += batch.shape[0]
        elapsed = time.perf_counter() - self._start
        m = {"runtime/samples_per_s": self._rows / elapsed, "runtime/learner_idle": self._idle / elapsed}
        m.update(self._metrics(batch, elapsed))
        return m

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    def state(self) -> dict:
        return {}

    def load(self, state: dict) -> None:
        pass


class QueueFed(Mode):
    """A mode whose learner takes what others produce from a `VersionedQueue` (sampler threads,
    sampler nodes): `items` entries per batch. Once trained, the entries in hand are delivered
    to the data position (not generated again after a stop or a resume) and admission is told."""

    def __init__(self, ctx: Context, items: int):
        super().__init__(ctx)
        self.items = items
        self.admission = None  # runtime.staleness_policy="admit": the gate that lets prompts in
        self._got: list[Rollout] = []  # the entries of the batch in hand

    @abc.abstractmethod
    def _take(self, version: int) -> tuple:
        """(the queue entries, this process's batch of them) for learner `version`."""

    def _queue_depth(self) -> Optional[int]:
        """Entries waiting (None where this process holds no queue)."""
        return None

    def _served(self, batch, elapsed: float) -> dict:
        """The producers' metrics for this step."""
        return {}

    def _next(self, version):
        self._got, batch = self._take(version)
        self.ctx.lengths.add("trained", batch)
        return batch

    def _metrics(self, batch, elapsed):
        for item in self._got:
            self.ctx.position.deliver(*item.origin)
        if self.admission is not None:  # after the new version is published: admission reads both
            self.admission.trained(len(self._got))
        m = self.ctx.lengths.metrics()
        m["runtime/learner_idle_s"] = self._idle
        depth = self._queue_depth()
        if depth is not None:
            m["runtime/queue_depth"] = float(depth)
        m.update(self._served(batch, elapsed))
        return m


@dataclasses.dataclass(frozen=True)
class Spec:
    """A registered mode."""
    make: Callable[[Context], Mode]
    concurrent: bool = False  # samples beside the learner: mid-generation refresh and admission apply
    retains_past: bool = False  # samples with past params: the weight store keeps max_staleness + 1 versions
    section: Optional[V.Section] = None  # its own subsection, `runtime.<name>`
    validate: Optional[Callable] = None  # (runtime section, sampler batching) -> None; raises ValueError


_REGISTRY: dict[str, Spec] = {}


def register(name: str, spec: Spec) -> None:
    if name in _REGISTRY and _REGISTRY[name] != spec:
        raise ValueError(f"mode {name!r} is already registered")
    _REGISTRY[name] = spec


def get(name: str) -> Spec:
    if name not in _REGISTRY:
        raise ValueError(f"runtime.mode={name!r} is not a registered mode; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> tuple:
    return tuple(_REGISTRY)


def registered() -> tuple:
    """(name, Spec) of every registered mode, in registration order."""
    return tuple(_REGISTRY.items())


def concurrent() -> tuple:
    return tuple(n for n, s in registered() if s.concurrent)


REFILL_STREAM = 1 << 20  # the sequential modes' refill draws' stream (async workers are 1 .. num_samplers)


class Sequential(Mode):
    """Sampling in the learner's thread: the learner waits while a batch is produced."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.producer, self.store = ctx.producer, ctx.store
        self._failures = 0
        self._scoring = 0.0  # per run() call
        self._refilled: dict = {}  # runtime.dynamic_sampling: the last batch's refill metrics

    @property
    def reward_failures(self) -> int:
        return self._failures

    def start(self) -> None:
        super().start()
        self._scoring = 0.0

    def _metrics(self, batch, elapsed):
        """The learner idles exactly while the sampler works."""
        return {"runtime/sampler_busy": self._idle / elapsed, "runtime/score_wait": self._scoring / elapsed,
                **self._refilled}

    def _produce(self, params, version: int, counter: int):
        """The batch of draw `counter`; with dynamic sampling, refilled from draws of their own
        stream (`REFILL_STREAM`, `counter * max_draws + j`: a function of the counter alone, so a
        resumed run draws exactly what this one would have)."""
        c = self.ctx.cfg
        if not c.dynamic_sampling:
            return self._one(params, version, 0, counter)
        refill = dynamic.Refill(c.prompts_per_batch, self.producer.group_size, c.dynamic_min_std, c.dynamic_max_draws)
        while not refill.done:
            j = refill.draws
            refill.add(self._one(params, version, *((0, counter) if j == 0 else
                                                    (REFILL_STREAM, counter * c.dynamic_max_draws + j))))
        self._refilled = refill.metrics()
        return refill.batch()

    def _one(self, params, version: int, worker: int, counter: int):
        pending = self.producer.generate(params, version, worker, counter)
        batch, failures = pending.result()
        self._scoring += pending.score_s
        self._failures += failures
        return batch


class Sync(Sequential):
    """v = 1, i = 1: generate with the newest params, train, repeat (on-policy baseline)."""

    def _next(self, version):
        v, params = self.store.latest()
        return self._produce(params, v, version)


class OffPolicy(Sequential):
    """v > 1, i = 1: sampler params refreshed every `refresh_every` steps (Mroueh et al.,
    "Revisiting Group Relative Policy Optimization", arXiv:2505.22257)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.every, self._sampled = ctx.cfg.refresh_every, None

    def _next(self, version):
        if version % self.every == 0 or self._sampled is None:  # None mid-cycle: resumed
            self._sampled = self.store.latest()
        return self._produce(self._sampled[1], self._sampled[0], version)


class Iterative(Sequential):
    """v = 1, i > 1: each batch is trained on `reuse` times (staleness 0 .. i - 1)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.reuse, self._held = ctx.cfg.reuse, None

    def _next(self, version):
        if version % self.reuse == 0 or self._held is None:  # None mid-cycle: resumed; same prompts, restored params
            self._held = self._produce(self.store.latest()[1], version, version - version % self.reuse)
        return self._held


class Simulated(Sequential):
    """Each batch's staleness d is drawn from the delay model (in learner steps, capped by
    `max_staleness`) and realised by sampling with the params of version k - d, retained in the
    weight store: deterministic, bit-reproducible sweeps. The delay stream is checkpointed."""

    def __init__(self, ctx):
        super().__init__(ctx)
        c = ctx.cfg
        self.delay, self.step_seconds, self.max_staleness = ctx.delay, c.step_seconds, c.max_staleness
        self.rng = np.random.default_rng([c.seed, 10_007])

    def _next(self, version):
        # Capped by the oldest params retained: right after a resume only the restored
        # version is (past params are not checkpointed), so the first steps run fresher.
        d = min(int(self.delay.steps(self.rng, self.step_seconds, self.max_staleness)),
                version - self.store.versions[0])
        return self._produce(self.store.get(version - d), version - d, version)

    def state(self) -> dict:
        return {"delay_rng": self.rng.bit_generator.state}

    def load(self, state: dict) -> None:
        if "delay_rng" in state:
            self.rng.bit_generator.state = state["delay_rng"]


def _fixed_staleness(field: str):
    """The rule of a mode whose schedule fixes the staleness (up to `field` - 1): a bound below it
    cannot be met by dropping."""

    def validate(c, batching):
        value = c[field]
        if c.staleness_policy == "drop" and staleness.exceeds(value - 1, c.max_staleness):
            raise ValueError(
                f"mode {c.mode!r} with runtime.{field}={value} trains on batches up to {value - 1} steps stale, beyond "
                f"runtime.max_staleness={c.max_staleness}; dropping them cannot yield fresher ones in this mode. Set "
                f"max_staleness >= {value - 1} (or -1), or staleness_policy='keep' to train on them (runtime/over_stale)")
    return validate


def _finite_staleness(c, batching):
    if c.max_staleness < 0:
        raise ValueError("mode='simulated' needs a finite runtime.max_staleness (past params are retained)")


register("sync", Spec(Sync))
register("iterative", Spec(Iterative, validate=_fixed_staleness("reuse")))
register("offpolicy", Spec(OffPolicy, validate=_fixed_staleness("refresh_every")))
register("simulated", Spec(Simulated, retains_past=True, validate=_finite_staleness))
