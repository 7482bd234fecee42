"""The async mode: sampler threads and the learner loop, joined by a bounded VersionedQueue.

Each `SamplerWorker` thread generates and scores batches with the newest weights it may use:
a version becomes usable once the delay model's delay (seconds) has passed since its
publication, checked between batches and, with `refresh_mid_generation`, between decode
segments. The learner loop (`run`) takes acceptable batches from the queue, trains, and
publishes. A failing worker stops the run with its error and traceback; nothing hangs.
Each queue item carries its origin (worker, draw, groups); what the learner trains or the queue
drops is delivered to the orchestrator's `DataPosition` (position.py), and workers start each
run() call at their first undelivered draw, so what was queued or decoding when the previous
call stopped is generated again, never skipped.

With continuous batching (`sampler.batching="continuous"`) a worker streams instead: its
decode slots never wait for a batch to end, each prompt group goes to the queue as soon as its
last member finishes (scored, with its group advantages), and the learner assembles a batch
from `prompts_per_batch` whole groups. Weights are then refreshed at every segment boundary
(in-flight updates, as PipelineRL and AReaL do): every token still carries the version of the
params that produced it, and staleness is judged per group.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from jaxrl_llm import distributed, staleness
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.rollout.sampler import to_batch
from jaxrl_llm.runtime.admission import Admission
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
        self.todo = orch.position.todo(index)  # draws (and groups) not yet delivered, in order

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
            if streams(self.orch):
                return self._stream()
            g = self.orch.sampler.cfg.num_samples
            for draw, groups in self.todo:
                if self.stop.is_set():
                    break
                self.refresh()
                t = time.perf_counter()
                batch, failures = self.orch.produce(self.params, self.version, self.index + 1, draw, refresh=mid)
                self.busy_s += time.perf_counter() - t
                self.reward_failures += failures
                if len(groups) < self.orch.cfg.prompts_per_batch:  # partly delivered (e.g. before a batching change)
                    rows = np.concatenate([k * g + np.arange(g) for k in groups])
                    batch = jax.tree.map(lambda x: x[rows], batch)
                self.orch.lengths.add("generated", batch)
                self._put((self.index, draw, groups), batch)
        except QueueClosed:
            pass
        except BaseException as e:  # surfaced by the learner loop
            self.error = e
            self.stop.set()
            self.queue.close()

    def _put(self, origin, batch):
        """Enqueue `(origin, batch)` under the batch's oldest token version (origin: (worker,
        draw, groups), what the learner delivers once it trains on it); waits while the queue
        is full. Returns the seconds it waited."""
        version = staleness.oldest_version(batch.versions, batch.loss_mask)
        t = time.perf_counter()
        while not self.stop.is_set():
            try:
                self.queue.put((origin, batch), version, timeout=POLL_S)
                break
            except QueueTimeout:
                continue
        return time.perf_counter() - t

    def _stream(self):
        """Continuous batching: draws of `prompts_per_batch` prompts feed the decode slots; each
        group is scored and enqueued once its G rows have finished."""
        orch, sampler = self.orch, self.orch.sampler
        g, per_draw = sampler.cfg.num_samples, orch.cfg.prompts_per_batch * sampler.cfg.num_samples
        engine = sampler.slots(per_draw)
        p = sampler.bucket(getattr(orch.task, "max_prompt_len", sampler.cfg.prompt_buckets[-1]))
        # draw -> [prompts, tokens, mask, groups not yet emitted, params version at admission];
        # group -> {row id: outputs}
        drawn, parts = {}, {}
        admission = orch.admission

        upcoming = [next(self.todo)]  # the next draw, taken from `todo` once admitted

        def feed():
            draw, groups = upcoming[0]
            if admission is not None and not admission.try_admit(self.version, orch.store.latest_timed()[0],
                                                                 len(groups)):
                return ()  # held back: the learner could not train these tokens within the bound
            upcoming[0] = next(self.todo)
            prompts, key = orch.draw(self.index + 1, draw)
            toks, mask, _ = sampler.pad_prompts(prompts, width=p)
            if toks.shape[1] != p:
                raise ValueError(f"a prompt is longer than the task's max_prompt_len bucket {p}")
            drawn[draw] = [prompts, toks, mask, len(groups), self.version]
            rows = np.concatenate([k * g + np.arange(g) for k in groups])  # only groups not yet delivered
            return (draw * per_draw + rows, toks[rows], mask[rows], np.full(len(rows), sampler.cfg.max_new_tokens),
                    engine.row_keys(key, rows))

        self.refresh()
        start, waited = time.perf_counter(), 0.0
        for ids, got in engine.stream(self.params, p, self.version, feed, refresh=self.refresh, stop=self.stop.is_set):
            for i, row in enumerate(ids.tolist()):
                parts.setdefault(row // g, {})[row] = {f: x[i] for f, x in got.items()}
            complete = [k for k, v in parts.items() if len(v) == g]
            if not complete:
                continue
            # Score the groups that completed together in one batch (advantages stay within
            # each group), then enqueue them one by one.
            prompts, sel = [], []
            for group in complete:
                draw, prompt = divmod(group, orch.cfg.prompts_per_batch)
                prompts.append(drawn[draw][0][prompt])
                sel.append((draw, prompt * g + np.arange(g)))
                drawn[draw][3] -= 1
            rows = [r for group in complete for _, r in sorted(parts.pop(group).items())]
            out = {f: np.stack([r[f] for r in rows]) for f in rows[0]}
            toks = np.concatenate([drawn[d][1][r] for d, r in sel])
            mask = np.concatenate([drawn[d][2][r] for d, r in sel])
            batch, failures = orch.score(to_batch(toks, mask, np.repeat(np.arange(len(complete)), g),
                                                  engine.outputs(out)), prompts)
            batch = jax.tree.map(np.asarray, batch)
            self.reward_failures += failures
            admitted = [drawn[d][4] for d, _ in sel]
            for draw in {d for d, _ in sel if drawn[d][3] == 0}:
                del drawn[draw]
            for i, (draw, rows) in enumerate(sel):
                group = jax.tree.map(lambda x: x[i * g:(i + 1) * g], batch)
                orch.lengths.add("generated", group)
                waited += self._put((self.index, draw, [int(rows[0]) // g]), group)
                if admission is not None:
                    admission.enqueued(admitted[i])
            self.busy_s = time.perf_counter() - start - waited


def _raise_failed(workers) -> None:
    for w in workers:
        if w.error is not None:
            raise RuntimeError(f"sampler {w.index} failed: {type(w.error).__name__}: {w.error}") from w.error


def streams(orch) -> bool:
    """Whether the sampler workers stream prompt groups (continuous batching)."""
    return orch.sampler.cfg.batching == "continuous"


def _next_batch(queue: VersionedQueue, workers, learner_version: int, items: int = 1, admission=None):
    """The next acceptable `items` queue entries ((origin, batch) each; e.g. prompt groups)
    for the learner, once every process holds one (one small collective per poll, so no process
    enters a learner step another will not); a failed worker, here or in another process,
    raises instead of waiting. With `admission`, groups are taken only once the step may run
    (`Admission.may_step`), oldest first."""
    got = []
    while True:
        failed = any(w.error is not None for w in workers)
        held = admission is not None and not got and not (len(queue) >= items and admission.may_step(learner_version))
        if held and not failed:
            time.sleep(POLL_S / 10)
        elif len(got) < items and not failed:
            try:
                got.append(queue.get(learner_version, timeout=POLL_S)[0])
            except (QueueTimeout, QueueClosed):  # closed only after a worker failed
                pass
        status = distributed.agree(-1 if failed else int(len(got) == items))
        if (status < 0).any():
            _raise_failed(workers)
            raise RuntimeError(f"process {int(np.argmin(status))}'s sampler failed; see its log")
        if (status == 1).all():
            return got


def run(orch, state, num_steps: int, emit):
    """The learner loop of the async mode; returns the final state."""
    c = orch.cfg
    items = c.prompts_per_batch if streams(orch) else 1  # queue entries per learner batch
    admit = c.staleness_policy == "admit"
    orch.admission = Admission(c.max_staleness, items) if admit else None
    # Under admission every admitted group fits in the queue (no producer blocks the oldest group).
    size = max(c.queue_size, c.max_staleness + 1 if admit else 0) * items
    queue = VersionedQueue(size, None if c.max_staleness < 0 else c.max_staleness, c.staleness_policy,
                           on_drop=orch.dropped_item)
    stop = threading.Event()
    workers = [SamplerWorker(orch, w, queue, stop) for w in range(c.num_samplers)]
    orch.add_workers(workers)
    start, idle, trained = time.perf_counter(), 0.0, 0
    for w in workers:
        w.start()
    try:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            got = _next_batch(queue, workers, int(state.version), items, orch.admission)
            batch = got[0][1] if items == 1 else TrajectoryBatch.concat([b for _, b in got])
            orch.lengths.add("trained", batch)
            idle += time.perf_counter() - t0
            state, m = orch.train(state, batch)
            for origin, _ in got:  # trained: not generated again after a stop or a resume
                orch.position.deliver(*origin)
            if orch.admission is not None:  # after the new version is published: admission reads both
                orch.admission.trained(items)
            elapsed = time.perf_counter() - start
            trained += batch.shape[0]
            m.update(orch.lengths.metrics())
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
