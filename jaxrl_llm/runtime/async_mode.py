"""The async mode: sampler threads and the learner loop, joined by a bounded VersionedQueue.

Each `SamplerWorker` thread generates and scores batches with the newest weights it may use:
a version becomes usable once the delay model's delay (seconds) has passed since its
publication, checked between batches and, with `refresh_mid_generation`, between decode
segments. The learner loop (`run`) takes acceptable batches from the queue, trains, and
publishes. A failing worker stops the run with its error and traceback; nothing hangs.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from jaxrl_llm import distributed, staleness
from jaxrl_llm.runtime.queue import QueueClosed, QueueTimeout, VersionedQueue

POLL_S = 0.1  # how often blocked calls re-check for a stop or a failed worker


class SamplerWorker(threading.Thread):
    """One sampler thread. Only this thread writes its counters (`busy_s`, `reward_failures`)."""

    def __init__(self, orch, index: int, queue: VersionedQueue, stop: threading.Event):
        super().__init__(daemon=True, name=f"sampler-{index}")
        self.orch, self.index, self.queue, self.stop = orch, index, queue, stop
        self.rng = np.random.default_rng([orch.cfg.seed, index, 99])
        self.version, self.params, _ = orch.store.latest_timed()
        self.delay = orch.delay.sample(self.rng)
        self.busy_s, self.reward_failures, self.error = 0.0, 0, None
        self.produced = orch.produced.get(index, 0)

    def refresh(self):
        """Switch to the newest weights once their delay has passed; returns (version, params)
        when it switched, else None (the sampler's mid-generation hook)."""
        newest, params, published = self.orch.store.latest_timed()
        if newest > self.version and time.monotonic() >= published + self.delay:
            self.version, self.params, self.delay = newest, params, self.orch.delay.sample(self.rng)
            return self.version, self.params
        return None

    def run(self):
        mid = self.refresh if self.orch.cfg.refresh_mid_generation else None
        try:
            while not self.stop.is_set():  # `produced` continues across run() calls
                self.refresh()
                t = time.perf_counter()
                batch, failures = self.orch.produce(self.params, self.version, self.index + 1, self.produced,
                                                    refresh=mid)
                self.busy_s += time.perf_counter() - t
                self.reward_failures += failures
                self.produced += 1
                self._put(batch)
        except QueueClosed:
            pass
        except BaseException as e:  # surfaced by the learner loop
            self.error = e
            self.stop.set()
            self.queue.close()

    def _put(self, batch):
        """Enqueue under the batch's oldest token version; waits while the queue is full."""
        version = staleness.oldest_version(batch.versions, batch.loss_mask)
        while not self.stop.is_set():
            try:
                return self.queue.put(batch, version, timeout=POLL_S)
            except QueueTimeout:
                continue


def _raise_failed(workers) -> None:
    for w in workers:
        if w.error is not None:
            raise RuntimeError(f"sampler {w.index} failed: {type(w.error).__name__}: {w.error}") from w.error


def _next_batch(queue: VersionedQueue, workers, learner_version: int):
    """The next acceptable batch for the learner, once every process holds one (one small
    collective per poll, so no process enters a learner step another will not); a failed
    worker, here or in another process, raises instead of waiting."""
    batch = None
    while True:
        failed = any(w.error is not None for w in workers)
        if batch is None and not failed:
            try:
                batch = queue.get(learner_version, timeout=POLL_S)[0]
            except (QueueTimeout, QueueClosed):  # closed only after a worker failed
                pass
        status = distributed.agree(-1 if failed else int(batch is not None))
        if (status < 0).any():
            _raise_failed(workers)
            raise RuntimeError(f"process {int(np.argmin(status))}'s sampler failed; see its log")
        if (status == 1).all():
            return batch


def run(orch, state, num_steps: int, emit):
    """The learner loop of the async mode; returns the final state."""
    c = orch.cfg
    queue = VersionedQueue(c.queue_size, None if c.max_staleness < 0 else c.max_staleness, c.staleness_policy)
    stop = threading.Event()
    workers = [SamplerWorker(orch, w, queue, stop) for w in range(c.num_samplers)]
    orch.add_workers(workers)
    start, idle, trained = time.perf_counter(), 0.0, 0
    for w in workers:
        w.start()
    try:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            batch = _next_batch(queue, workers, int(state.version))
            idle += time.perf_counter() - t0
            state, m = orch.train(state, batch, dropped=queue.stats.dropped)
            elapsed = time.perf_counter() - start
            trained += batch.shape[0]
            m.update({"runtime/queue_depth": float(len(queue)), "runtime/samples_per_s": trained / elapsed,
                      "runtime/learner_idle": idle / elapsed,
                      "runtime/sampler_busy": sum(w.busy_s for w in workers) / (elapsed * c.num_samplers)})
            emit(m)
    finally:
        stop.set()
        queue.close()
        for w in workers:
            w.join(timeout=30)
        orch.retire_workers(workers)
    return state
