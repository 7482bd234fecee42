"""The async mode: sampler threads and the learner loop, joined by a bounded VersionedQueue.

Each `SamplerWorker` thread drives a `Producer` with the newest weights it may use: a version
becomes usable once the delay model's delay (seconds) has passed since its publication, checked
between batches and, with `refresh_mid_generation`, between decode segments. `AsyncMode` gives
the learner loop acceptable batches from the queue. A failing worker stops the run with its
error and traceback; nothing hangs. Each queue item is a `Rollout` with its `Origin`; what the
learner trains or the queue drops is delivered to the `DataPosition` (position.py), and workers
start each run() call at their first undelivered draw, so what was queued or decoding when the
previous call stopped is generated again, never skipped.

With continuous batching (`sampler.batching="continuous"`) a worker streams instead: its
decode slots never wait for a batch to end, each prompt group goes to the queue as soon as its
last member finishes (scored, with its group advantages), and the learner assembles a batch
from `prompts_per_batch` whole groups. Weights are then refreshed at every segment boundary
(in-flight updates, as PipelineRL and AReaL do): every token still carries the version of the
params that produced it, and staleness is judged per group.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

import jax
import numpy as np

from jaxrl_llm import staleness
from jaxrl_llm.parallel import preemption
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.runtime import dynamic
from jaxrl_llm.runtime.admission import Admission
from jaxrl_llm.runtime.delay import DelayModel
from jaxrl_llm.runtime.lengths import LengthCounts
from jaxrl_llm.runtime.modes import Context, QueueFed, Spec, register
from jaxrl_llm.runtime.producer import Origin, Producer, Rollout
from jaxrl_llm.runtime.queue import QueueClosed, QueueTimeout, VersionedQueue
from jaxrl_llm.runtime.weights import WeightStore

POLL_S = 0.1  # how often blocked calls re-check for a stop or a failed worker
SCORING_AHEAD = 1  # static batching: draws being scored while the next one decodes


class SamplerWorker(threading.Thread):
    """One sampler thread. Only this thread writes its counters: `busy_s` (working, i.e. not
    waiting on a full queue), `score_wait_s` (scoring in this thread or waiting on the scorer), `reward_failures`."""

    def __init__(self, index: int, producer: Producer, store: WeightStore, delay: DelayModel, todo,
                 queue: VersionedQueue, stop: threading.Event, lengths: LengthCounts,
                 admission: Optional[Admission], refresh_mid_generation: bool,
                 gate: Optional[dynamic.Gate] = None, consumed=None):
        """`gate` (dynamic sampling): groups it stops are handed to `consumed(origin)` (delivered:
        never generated again) instead of the queue."""
        super().__init__(daemon=True, name=f"sampler-{index}")
        self.gate, self.consumed = gate, consumed
        self.index, self.producer, self.store, self.delay_model = index, producer, store, delay
        self.todo, self.queue, self.stop, self.lengths, self.admission = todo, queue, stop, lengths, admission
        self.mid = refresh_mid_generation
        self.rng = np.random.default_rng([producer.seed, index, 99])
        self.version, self.params, _ = store.latest_timed()
        self.delay = delay.sample(self.rng)
        self.busy_s = self.score_wait_s = self.put_wait_s = 0.0
        self.reward_failures, self.error = 0, None

    def refresh(self):
        """Switch to the newest weights once their delay has passed; returns (version, params)
        when it switched, else None (the sampler's mid-generation hook)."""
        newest, params, published = self.store.latest_timed()
        if newest > self.version and time.monotonic() >= published + self.delay:
            self.version, self.params, self.delay = newest, params, self.delay_model.sample(self.rng)
            return self.version, self.params
        return None

    def run(self):
        try:
            if self.producer.streams:
                return self._stream()
            self._batches()
        except QueueClosed:
            pass
        except BaseException as e:  # surfaced by the learner loop
            self.error = e
            self.stop.set()
            self.queue.close()

    def _batches(self):
        """Static batching: decode draw d + 1 while draw d is scored; enqueue in draw order."""
        g, scoring = self.producer.group_size, collections.deque()
        start = time.perf_counter()
        for draw, groups in self.todo:
            if self.stop.is_set():
                break
            self.refresh()
            scoring.append((draw, groups, self.producer.generate(self.params, self.version, self.index + 1, draw,
                                                                 refresh=self.refresh if self.mid else None)))
            while scoring and (scoring[0][2].done() or len(scoring) > SCORING_AHEAD):
                self._deliver(g, *scoring.popleft())
            self.busy_s = time.perf_counter() - start - self.put_wait_s
        while scoring and not self.stop.is_set():
            self._deliver(g, *scoring.popleft())

    def _deliver(self, g, draw, groups, pending):
        batch, failures = pending.result()
        self.score_wait_s += pending.score_s
        self.reward_failures += failures
        if len(groups) < self.producer.prompts_per_batch:  # partly delivered (e.g. before a batching change)
            rows = np.concatenate([k * g + np.arange(g) for k in groups])
            batch = jax.tree.map(lambda x: x[rows], batch)
        self.lengths.add("generated", batch)
        if self.gate is None:
            self.put_wait_s += self._put(Rollout(Origin(self.index, draw, groups), batch))
            return
        for k, group in zip(groups, dynamic.groups_of(batch, g)):  # dynamic sampling: group by group
            self._offer(Rollout(Origin(self.index, draw, (k,)), group))

    def _offer(self, item: Rollout) -> None:
        """Enqueue `item`, or (dropped by the gate) deliver it as consumed."""
        if self.gate is not None and not self.gate.passes(item.batch):
            self.consumed(item.origin)
        else:
            self.put_wait_s += self._put(item)

    def _put(self, item: Rollout) -> float:
        """Enqueue `item` under its batch's oldest token version; waits while the queue is full.
        Returns the seconds it waited."""
        version = staleness.oldest_version(item.batch.versions, item.batch.loss_mask)
        t = time.perf_counter()
        while not self.stop.is_set():
            try:
                self.queue.put(item, version, timeout=POLL_S)
                break
            except QueueTimeout:
                continue
        return time.perf_counter() - t

    def _stream(self):
        """Continuous batching: each group is enqueued as the producer hands it over."""
        admit = None
        if self.admission is not None:
            admit = lambda v, groups: self.admission.try_admit(v, self.store.latest_timed()[0], groups)  # noqa: E731
        self.refresh()
        start = time.perf_counter()
        for item, admitted, failures, score_wait in self.producer.stream(self.index, self.params, self.version,
                                                                         self.todo, self.refresh, self.stop.is_set, admit):
            self.reward_failures += failures
            self.score_wait_s += score_wait
            self.lengths.add("generated", item.batch)
            self._offer(item)
            if self.admission is not None:
                self.admission.enqueued(admitted)
            self.busy_s = time.perf_counter() - start - self.put_wait_s


class AsyncMode(QueueFed):
    """`num_samplers` sampler threads per run() call, the learner taking from their queue."""

    def __init__(self, ctx: Context):
        by_group = ctx.producer.streams or ctx.cfg.dynamic_sampling
        super().__init__(ctx, ctx.cfg.prompts_per_batch if by_group else 1)  # queue entries per batch
        self.cfg = ctx.cfg
        self._gates: list = []  # dynamic sampling: each worker's, over the run
        self._gated = None  # their totals at the last step
        self.workers: list[SamplerWorker] = []
        self._retired_failures = 0
        self.queue, self.stop_event = None, None  # per run() call (`start`): its workers' queue and stop flag

    @property
    def reward_failures(self) -> int:
        return self._retired_failures + sum(w.reward_failures for w in self.workers)

    def start(self) -> None:
        c, ctx = self.cfg, self.ctx
        admit = c.staleness_policy == "admit"
        self.admission = Admission(c.max_staleness, self.items) if admit else None
        # Under admission every admitted group fits in the queue (no producer blocks the oldest group).
        size = max(c.queue_size, c.max_staleness + 1 if admit else 0) * self.items
        self.queue = VersionedQueue(size, None if c.max_staleness < 0 else c.max_staleness, c.staleness_policy,
                                    on_drop=ctx.on_drop)
        self.stop_event = threading.Event()
        if c.dynamic_sampling and not self._gates:
            limit = c.dynamic_max_draws * c.prompts_per_batch  # groups dropped in a row before one goes through
            self._gates = [dynamic.Gate(ctx.producer.group_size, c.dynamic_min_std, limit)
                           for _ in range(c.num_samplers)]
        gates = self._gates or [None] * c.num_samplers
        self.workers = [SamplerWorker(w, ctx.producer, ctx.store, ctx.delay, ctx.position.todo(w), self.queue,
                                      self.stop_event, ctx.lengths, self.admission, c.refresh_mid_generation,
                                      gates[w], lambda origin: ctx.position.deliver(*origin))
                        for w in range(c.num_samplers)]
        super().start()
        for w in self.workers:
            w.start()

    def _take(self, version: int):
        got = _gather(self.queue, self.workers, version, self.items, self.admission)
        return got, got[0].batch if self.items == 1 else TrajectoryBatch.concat([r.batch for r in got])

    def _queue_depth(self):
        return len(self.queue)

    def _served(self, batch, elapsed) -> dict:
        busy = self.cfg.num_samplers * elapsed
        m = {"runtime/sampler_busy": sum(w.busy_s for w in self.workers) / busy,
             "runtime/score_wait": sum(w.score_wait_s for w in self.workers) / busy}
        if self._gates:
            filtered, self._gated = dynamic.gate_metrics(self._gates, self._gated, self.cfg.prompts_per_batch)
            keep = dynamic.informative(np.asarray(batch.rewards), self.ctx.producer.group_size, self.cfg.dynamic_min_std)
            m.update(filtered, **{"dynamic/fill": float(keep.mean())})
        return m

    def stop(self) -> None:
        self.stop_event.set()
        self.queue.close()
        for w in self.workers:
            w.join(timeout=30)
        self._retired_failures += sum(w.reward_failures for w in self.workers)
        self.workers = []  # and the params they hold


def _validate(c, batching) -> None:
    if c.staleness_policy == "admit" and batching != "continuous":
        raise ValueError("runtime.staleness_policy='admit' holds prompts back from decode slots: it needs "
                         "--config.sampler.batching=continuous")


register("async", Spec(AsyncMode, concurrent=True, validate=_validate))


def _raise_failed(workers) -> None:
    for w in workers:
        if w.error is not None:
            raise RuntimeError(f"sampler {w.index} failed: {type(w.error).__name__}: {w.error}") from w.error


def _gather(queue: VersionedQueue, workers, learner_version: int, items: int = 1, admission=None) -> list[Rollout]:
    """The next acceptable `items` queue entries (e.g. prompt groups) for the learner, once every
    process holds them (one small collective per poll, so no process enters a learner step another
    will not); a failed worker, here or in another process, raises instead of waiting, and a
    preemption signal, here or in another process, raises `Preempted` (the run saves). With
    `admission`, groups are taken only once the step may run (`Admission.may_step`), oldest first."""
    got = []
    while True:
        failed = any(w.error is not None for w in workers)
        held = admission is not None and not got and not admission.ready(learner_version, len(queue), items)
        if held and not failed:
            time.sleep(POLL_S / 10)
        elif len(got) < items and not failed:
            try:
                got.append(queue.get(learner_version, timeout=POLL_S)[0])
            except (QueueTimeout, QueueClosed):  # closed only after a worker failed
                pass
        status = preemption.agree(-1 if failed else int(len(got) == items))
        if (status < 0).any():
            _raise_failed(workers)
            raise RuntimeError(f"process {int(np.argmin(status))}'s sampler failed; see its log")
        if (status == 1).all():
            return got
