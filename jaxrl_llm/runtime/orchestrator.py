"""Training modes: who samples with which policy version, and when the learner sees it.

  sync        v=1, i=1: generate with the newest params, train, repeat (on-policy baseline).
  iterative   v=1, i>1: each batch is trained on `reuse` times (staleness 0..i-1).
  offpolicy   v>1, i=1: sampler params refreshed every `refresh_every` steps (Mroueh et al.,
              "Revisiting Group Relative Policy Optimization", arXiv:2505.22257).
  simulated   each batch's staleness d is drawn from the delay model (in learner steps, capped
              by max_staleness) and realised by sampling with the params of version k - d,
              retained in the weight store: deterministic, bit-reproducible sweeps.
  async       `num_samplers` sampler threads and the learner run concurrently through the
              bounded VersionedQueue (see async_mode.py).

Staleness (`jaxrl_llm.staleness`) means the same in every mode: `max_staleness` bounds it and
`staleness_policy` drops or keeps (and counts) batches beyond it. Where a mode's schedule fixes
the staleness (iterative: up to reuse - 1, offpolicy: up to refresh_every - 1) a bound below
it cannot be met by dropping, so that combination fails at start-up.

A task supplies prompts and rewards: `task.prompts(rng, n) -> list[list[int]]` and
`task.reward(prompt, completion) -> float`. A reward that raises scores 0 and is counted.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import advantages, distributed, staleness, tasks
from jaxrl_llm import validation as V
from jaxrl_llm.runtime import async_mode
from jaxrl_llm.runtime import delay as delay_lib
from jaxrl_llm.runtime.lengths import LengthCounts
from jaxrl_llm.runtime.position import DataPosition
from jaxrl_llm.runtime.weights import WeightStore

MODES = ("sync", "iterative", "offpolicy", "simulated", "async")


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "sync"
    c.prompts_per_batch = 4
    c.reuse = 1  # i (iterative)
    c.refresh_every = 1  # v (offpolicy)
    c.max_staleness = 8  # bound on d = v(learner) - v(token), every mode; -1: unbounded
    c.staleness_policy = "drop"  # drop | keep (and count) batches beyond max_staleness | admit (hold prompts back)
    c.queue_size = 2
    c.num_samplers = 1
    c.refresh_mid_generation = False  # async: also swap weights between decode segments
    c.sampler_devices = 0  # 0: samplers share the learner's devices; n: the last n devices are theirs
    c.delay = ml_collections.ConfigDict(dict(kind="none", min=1.0, max=8.0, value=1.0, weibull_shape=1.5))
    c.step_seconds = 1.0  # simulated: seconds of delay per learner step
    c.advantage = "grpo"
    c.mask_zero_variance = False
    c.seed = 0
    return c


RULES = {
    "mode": V.one_of(*MODES), "prompts_per_batch": V.integer(1), "reuse": V.integer(1), "refresh_every": V.integer(1),
    "max_staleness": V.integer(0, extra=(-1,)), "staleness_policy": V.one_of(*staleness.POLICIES),
    "queue_size": V.integer(1), "num_samplers": V.integer(1), "refresh_mid_generation": V.boolean(),
    "sampler_devices": V.integer(0),
    "delay": {"kind": V.one_of(*delay_lib.KINDS), "min": V.non_negative(), "max": V.non_negative(),
              "value": V.non_negative(), "weibull_shape": V.positive()},
    "step_seconds": V.positive(), "advantage": V.one_of(*advantages.names()), "mask_zero_variance": V.boolean(),
    "seed": V.integer(0),
}


def validate(c) -> None:
    if c.mode not in MODES:
        raise ValueError(f"unknown runtime mode {c.mode!r}; valid: {', '.join(MODES)}")
    if c.reuse != 1 and c.mode != "iterative":
        raise ValueError(f"runtime.reuse={c.reuse} needs mode='iterative' (mode is {c.mode!r})")
    if c.refresh_every != 1 and c.mode != "offpolicy":
        raise ValueError(f"runtime.refresh_every={c.refresh_every} needs mode='offpolicy' (mode is {c.mode!r})")
    if c.reuse < 1 or c.refresh_every < 1 or c.queue_size < 1 or c.num_samplers < 1:
        raise ValueError("runtime.reuse, refresh_every, queue_size and num_samplers must be >= 1")
    if c.sampler_devices < 0:
        raise ValueError(f"runtime.sampler_devices must be >= 0; got {c.sampler_devices}")
    if c.refresh_mid_generation and c.mode != "async":
        raise ValueError(f"runtime.refresh_mid_generation needs mode='async' (mode is {c.mode!r})")
    if c.mode == "simulated" and c.max_staleness < 0:
        raise ValueError("mode='simulated' needs a finite runtime.max_staleness (past params are retained)")
    _validate_staleness(c)
    if c.advantage not in advantages.names():
        raise ValueError(f"unknown advantage {c.advantage!r}; valid: {', '.join(advantages.names())}")
    _delay(c)  # unknown delay kinds / bad bounds fail here


def _validate_staleness(c) -> None:
    if c.staleness_policy not in staleness.POLICIES:
        raise ValueError(f"unknown runtime.staleness_policy {c.staleness_policy!r}; "
                         f"valid: {', '.join(staleness.POLICIES)}")
    if c.max_staleness < -1:
        raise ValueError(f"runtime.max_staleness must be >= 0, or -1 for unbounded; got {c.max_staleness}")
    if c.staleness_policy == "admit" and (c.mode != "async" or c.max_staleness < 0):
        raise ValueError("runtime.staleness_policy='admit' needs mode='async' (with sampler.batching='continuous') "
                         f"and a finite runtime.max_staleness (mode is {c.mode!r}, max_staleness {c.max_staleness})")
    fixed = {"iterative": ("reuse", c.reuse), "offpolicy": ("refresh_every", c.refresh_every)}.get(c.mode)
    if fixed and c.staleness_policy == "drop" and staleness.exceeds(fixed[1] - 1, c.max_staleness):
        name, value = fixed
        raise ValueError(
            f"mode {c.mode!r} with runtime.{name}={value} trains on batches up to {value - 1} steps stale, beyond "
            f"runtime.max_staleness={c.max_staleness}; dropping them cannot yield fresher ones in this mode. Set "
            f"max_staleness >= {value - 1} (or -1), or staleness_policy='keep' to train on them (runtime/over_stale)")


def _delay(c) -> delay_lib.DelayModel:
    d = c.delay
    return delay_lib.make(d.kind, min=d.min, max=d.max, value=d.value, weibull_shape=d.weibull_shape)


class Orchestrator:
    """Runs the learner on batches produced by `sampler` from `task`, in the configured mode."""

    def __init__(self, learner, sampler, task, cfg=None, placement=None):
        self.cfg = cfg or default_config()
        validate(self.cfg)
        self.learner, self.sampler, self.task = learner, sampler, task
        if self.cfg.staleness_policy == "admit" and sampler.cfg.batching != "continuous":
            raise ValueError("runtime.staleness_policy='admit' holds prompts back from decode slots: it needs "
                             "sampler.batching='continuous'")
        self.delay = _delay(self.cfg)
        keep = self.cfg.max_staleness + 1 if self.cfg.mode == "simulated" else 1
        self.store = WeightStore(keep=keep, placement=placement, dtype=learner.rollout_model_cfg.dtype)
        self.schedule: list[int] = []  # simulated: the staleness drawn for each step
        self.state = None
        self.over_stale = 0  # batches trained beyond max_staleness (policy keep)
        self._reward_failures = 0  # from this (the learner's) thread; sampler threads count their own
        self._workers: list = []
        self._key = jax.random.key(self.cfg.seed)
        self._delay_rng = np.random.default_rng([self.cfg.seed, 10_007])  # simulated delays
        self._held = self._sampled = None  # iterative: the reused batch; offpolicy: its sampler params
        self.position = DataPosition(self.cfg.prompts_per_batch)  # async: what each worker has delivered
        self.dropped = 0  # async: queue items dropped as over-stale, across run() calls
        self.admission = None  # async with staleness_policy="admit" (runtime/admission.py)
        self.lengths = LengthCounts()  # async: completion lengths generated / trained / dropped, across run() calls

    @property
    def reward_failures(self) -> int:
        return self._reward_failures + sum(w.reward_failures for w in self._workers)

    def add_workers(self, workers) -> None:
        """Sampler threads whose reward-failure counts belong to this run's total."""
        self._workers.extend(workers)

    def retire_workers(self, workers) -> None:
        """Joined threads: fold their counts in and drop them (and the params they hold)."""
        for w in workers:
            self._workers.remove(w)
            self._reward_failures += w.reward_failures

    def dropped_item(self, item) -> None:
        """The queue dropped `(origin, batch)` as over-stale: counted, and delivered (not
        generated again)."""
        origin, batch = item
        self.dropped += 1
        self.lengths.add("dropped", batch)
        self.position.deliver(*origin)

    def runtime_state(self) -> dict:
        """What a checkpoint keeps besides the TrainState so that a resumed run continues as
        this one would have (JSON-able, per process): the async data position, the simulated
        mode's delay stream, and run-long counters."""
        return {"position": self.position.state(), "delay_rng": self._delay_rng.bit_generator.state,
                "over_stale": self.over_stale, "dropped": self.dropped, "lengths": self.lengths.state()}

    def load_runtime_state(self, s: dict) -> Optional[str]:
        """Continue from `runtime_state()`; returns a note where it cannot be exact."""
        self._delay_rng.bit_generator.state = s["delay_rng"]
        self.over_stale, self.dropped = s["over_stale"], s["dropped"]
        self.lengths.load(s["lengths"])
        return self.position.load(s["position"])

    # ------------------------------------------------------------------ one batch
    def produce(self, params, version: int, worker: int, counter: int, refresh=None):
        """Prompts -> completions (policy `version`; `refresh` may swap weights mid-generation,
        see Sampler.generate) -> rewards -> advantages. Returns (batch, failed rewards); a
        failing reward scores 0 and is counted by the caller."""
        prompts, key = self.draw(worker, counter)
        return self.score(self.sampler.generate(params, prompts, key, version, refresh=refresh), prompts)

    def draw(self, worker: int, counter: int):
        """Draw `counter` of sampler `worker`: (prompts, sampling key). With many processes each
        draws prompts and samples of its own (`distributed.seed_ids`)."""
        rng = np.random.default_rng(distributed.seed_ids(self.cfg.seed, worker, counter))
        prompts = self.task.prompts(rng, self.cfg.prompts_per_batch)
        key = self._key
        for i in distributed.seed_ids(worker, counter):
            key = jax.random.fold_in(key, i)
        return prompts, key

    def score(self, batch, prompts):
        """Rewards and advantages of sampled rows (row i answers prompts[i // G]; advantages
        within each group) -> (batch, failed rewards)."""
        rewards, failures = tasks.score(self.task, prompts, np.asarray(batch.tokens),
                                        np.asarray(batch.loss_mask) > 0, self.sampler.cfg.num_samples)
        adv = advantages.compute(self.cfg.advantage, rewards, batch.group_ids, batch.loss_mask,
                                 mask_zero_variance=self.cfg.mask_zero_variance)
        return batch.replace(rewards=jnp.asarray(rewards), advantages=adv), failures

    def train(self, state, batch):
        """One learner step on `batch` (with many processes: this process's rows of the global
        batch), then publish the new version. Host-side metrics are over every process.
        Returns (state, metrics)."""
        d = staleness.of_batch(int(state.version), batch.versions, batch.loss_mask)
        hist = np.bincount(d, minlength=1)
        rewards = np.asarray(batch.rewards, np.float64)
        # One gather for every process's scalars: [max staleness, reward sum, rows, failures,
        # dropped, histogram length] (each host collective costs ~1-2 ms over gloo).
        g = distributed.gather(np.array([d.max(initial=0), rewards.sum(), rewards.size, self.reward_failures,
                                         self.dropped, hist.size], np.float64))
        self.over_stale += int(staleness.exceeds(int(g[:, 0].max()), self.cfg.max_staleness))
        totals = g[:, 1:5].sum(0)
        state, m = self.learner.train_step(state, batch)
        self.state = state  # newest live state (the previous one was donated), e.g. for Ctrl-C saves
        self.store.publish(int(state.version), self.learner.rollout_params(state))
        m["staleness/hist"] = distributed.host_sum(np.pad(hist, (0, int(g[:, 5].max()) - hist.size))).tolist()
        m["reward/mean"] = float(totals[0] / totals[1])
        m["reward/failures"] = float(totals[2])
        m["runtime/dropped"] = float(totals[3])
        m["runtime/over_stale"] = float(self.over_stale)
        m["processes"] = distributed.count()
        return state, m

    # ------------------------------------------------------------------ modes
    def run(self, state, num_steps: int, on_metrics: Optional[Callable] = None):
        """Train for `num_steps` learner steps; returns (state, [metrics per step])."""
        self.store.publish(int(state.version), self.learner.rollout_params(state))
        history = []
        emit = (lambda m: (history.append(m), on_metrics and on_metrics(m)))
        if self.cfg.mode == "async":
            return async_mode.run(self, state, num_steps, emit), history
        start, sampling = time.perf_counter(), 0.0
        for step in range(num_steps):
            t0 = time.perf_counter()
            batch = self._next_batch(int(state.version))
            t1 = time.perf_counter()
            state, m = self.train(state, batch)
            sampling += t1 - t0
            elapsed = time.perf_counter() - start
            # Cumulative over this run() call, like async: the learner waits while sampling.
            m.update({"runtime/sampler_busy": sampling / elapsed, "runtime/learner_idle": sampling / elapsed,
                      "runtime/samples_per_s": (step + 1) * batch.shape[0] / elapsed})
            emit(m)
        return state, history

    def _next_batch(self, version: int):
        """The batch the sequential modes train on at learner `version`. Schedules follow the
        version, not the position within one run() call, so chunked runs (eval / checkpoint
        boundaries) and resumed runs keep them; prompts are drawn per version."""
        c = self.cfg
        if c.mode == "simulated":
            # Capped by the oldest params retained: right after a resume only the restored
            # version is (past params are not checkpointed), so the first steps run fresher.
            d = min(int(self.delay.steps(self._delay_rng, c.step_seconds, c.max_staleness)),
                    version - self.store.versions[0])
            self.schedule.append(d)
            return self._produce(self.store.get(version - d), version - d, version)
        if c.mode == "iterative":
            if version % c.reuse == 0 or self._held is None:  # None mid-cycle: resumed; same prompts, restored params
                self._held = self._produce(self.store.latest()[1], version, version - version % c.reuse)
            return self._held
        if c.mode == "sync" or version % c.refresh_every == 0 or self._sampled is None:
            self._sampled = self.store.latest()  # offpolicy: sampler params of the last refresh
        return self._produce(self._sampled[1], self._sampled[0], version)

    def _produce(self, params, version, counter):
        batch, failures = self.produce(params, version, 0, counter)
        self._reward_failures += failures
        return batch
