"""Training modes: who samples with which policy version, and when the learner sees it.

  sync        v=1, i=1: generate with the newest params, train, repeat (on-policy baseline).
  iterative   v=1, i>1: each batch is trained on `reuse` times (staleness 0..i-1).
  offpolicy   v>1, i=1: sampler params refreshed every `refresh_every` steps (seed 003).
  simulated   each batch's staleness d is drawn from the delay model (in learner steps, capped
              by max_staleness) and realised by sampling with the params of version k - d,
              retained in the weight store: deterministic, bit-reproducible sweeps.
  async       `num_samplers` sampler threads and the learner run concurrently through the
              bounded VersionedQueue; samplers pick up new weights between batches (and, with
              refresh_mid_generation, between decode segments), after the delay model's delay
              (seconds) has elapsed since publication.

A task supplies prompts and rewards: `task.prompts(rng, n) -> list[list[int]]` and
`task.reward(prompt, completion) -> float`. A reward that raises scores 0 and is counted.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import advantages, tasks
from jaxrl_llm.runtime import delay as delay_lib
from jaxrl_llm.runtime.queue import QueueClosed, QueueTimeout, VersionedQueue
from jaxrl_llm.runtime.weights import WeightStore

MODES = ("sync", "iterative", "offpolicy", "simulated", "async")


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "sync"
    c.prompts_per_batch = 4
    c.reuse = 1  # i (iterative)
    c.refresh_every = 1  # v (offpolicy)
    c.max_staleness = 8  # -1: unbounded
    c.staleness_policy = "drop"  # drop | keep (async queue)
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
    if c.advantage not in advantages.names():
        raise ValueError(f"unknown advantage {c.advantage!r}; valid: {', '.join(advantages.names())}")
    _delay(c)  # unknown delay kinds / bad bounds fail here


def _delay(c) -> delay_lib.DelayModel:
    d = c.delay
    return delay_lib.make(d.kind, min=d.min, max=d.max, value=d.value, weibull_shape=d.weibull_shape)


class Orchestrator:
    def __init__(self, learner, sampler, task, cfg=None, placement=None):
        self.cfg = cfg or default_config()
        validate(self.cfg)
        self.learner, self.sampler, self.task = learner, sampler, task
        self.delay = _delay(self.cfg)
        keep = self.cfg.max_staleness + 1 if self.cfg.mode == "simulated" else 1
        self.store = WeightStore(keep=keep, placement=placement)
        self.reward_failures = 0
        self.schedule: list[int] = []  # simulated: the staleness drawn for each step
        self.state = None
        self._key = jax.random.key(self.cfg.seed)

    # ------------------------------------------------------------------ one batch
    def produce(self, params, version: int, worker: int, counter: int, refresh=None):
        """Prompts -> completions (policy `version`; `refresh` may swap weights mid-generation,
        see Sampler.generate) -> rewards -> advantages."""
        rng = np.random.default_rng([self.cfg.seed, worker, counter])
        prompts = self.task.prompts(rng, self.cfg.prompts_per_batch)
        key = jax.random.fold_in(jax.random.fold_in(self._key, worker), counter)
        batch = self.sampler.generate(params, prompts, key, version, refresh=refresh)
        rewards, failures = tasks.score(self.task, prompts, np.asarray(batch.tokens),
                                        np.asarray(batch.loss_mask) > 0, self.sampler.cfg.num_samples)
        self.reward_failures += failures  # a failing reward scores 0 and is counted
        adv = advantages.compute(self.cfg.advantage, rewards, batch.group_ids, batch.loss_mask,
                                 mask_zero_variance=self.cfg.mask_zero_variance)
        return batch.replace(rewards=jnp.asarray(rewards), advantages=adv)

    def _train(self, state, batch, extra):
        state, m = self.learner.train_step(state, batch)
        self.state = state  # newest live state (the previous one was donated), e.g. for Ctrl-C saves
        self.store.publish(int(state.version), self.learner.rollout_params(state))
        d = np.asarray(int(state.version) - 1 - np.asarray(batch.versions))[np.asarray(batch.loss_mask) > 0]
        m.update(extra)
        m["staleness/hist"] = np.bincount(np.maximum(d, 0), minlength=1).tolist()
        m["reward/mean"] = float(np.mean(np.asarray(batch.rewards)))
        m["reward/failures"] = float(self.reward_failures)
        return state, m

    # ------------------------------------------------------------------ modes
    def run(self, state, num_steps: int, on_metrics: Optional[Callable] = None):
        """Train for `num_steps` learner steps; returns (state, [metrics per step])."""
        self.store.publish(int(state.version), self.learner.rollout_params(state))
        history = []
        emit = (lambda m: (history.append(m), on_metrics and on_metrics(m)))
        if self.cfg.mode == "async":
            return self._run_async(state, num_steps, emit), history
        rng = np.random.default_rng([self.cfg.seed, 10_007])
        batch, sampler_version = None, None
        start, sampling = time.perf_counter(), 0.0
        for step in range(num_steps):
            t0 = time.perf_counter()
            version = int(state.version)
            mode = self.cfg.mode
            if mode == "simulated":
                d = min(int(self.delay.steps(rng, self.cfg.step_seconds, self.cfg.max_staleness)), version)
                self.schedule.append(d)
                batch = self.produce(self.store.get(version - d), version - d, 0, step)
            elif mode == "iterative":
                if step % self.cfg.reuse == 0:
                    batch = self.produce(self.store.latest()[1], version, 0, step)
            else:
                if mode == "sync" or step % self.cfg.refresh_every == 0:
                    sampler_version = self.store.latest()
                batch = self.produce(sampler_version[1], sampler_version[0], 0, step)
            t1 = time.perf_counter()
            state, m = self._train(state, batch, {})
            sampling += t1 - t0
            elapsed = time.perf_counter() - start
            # Cumulative over this run() call, like async: the learner waits while sampling.
            m.update({"runtime/sampler_busy": sampling / elapsed, "runtime/learner_idle": sampling / elapsed,
                      "runtime/samples_per_s": (step + 1) * batch.shape[0] / elapsed})
            emit(m)
        return state, history

    def _run_async(self, state, num_steps, emit):
        c = self.cfg
        queue = VersionedQueue(c.queue_size, None if c.max_staleness < 0 else c.max_staleness, c.staleness_policy)
        stop, errors, busy = threading.Event(), [], [0.0] * c.num_samplers
        published_at = {int(state.version): time.monotonic()}

        def sampler_loop(worker):
            rng = np.random.default_rng([c.seed, worker, 99])
            version, params = self.store.latest()
            delay = self.delay.sample(rng)
            counter = 0

            def refresh():
                """Newer weights once the delay since their publication has passed."""
                nonlocal version, params, delay
                newest, newest_params = self.store.latest()
                if newest > version and time.monotonic() >= published_at.get(newest, 0.0) + delay:
                    version, params, delay = newest, newest_params, self.delay.sample(rng)
                    return version, params
                return None

            try:
                while not stop.is_set():
                    refresh()
                    first = version
                    t = time.perf_counter()
                    batch = self.produce(params, version, worker + 1, counter,
                                         refresh=refresh if c.refresh_mid_generation else None)
                    busy[worker] += time.perf_counter() - t
                    counter += 1
                    while not stop.is_set():
                        try:
                            queue.put(batch, first, timeout=0.1)  # the oldest version in the batch
                            break
                        except QueueTimeout:
                            continue
            except QueueClosed:
                pass
            except BaseException as e:  # surfaced in the learner thread
                errors.append((worker, e))
                stop.set()
                queue.close()

        threads = [threading.Thread(target=sampler_loop, args=(w,), daemon=True, name=f"sampler-{w}")
                   for w in range(c.num_samplers)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        idle, trained = 0.0, 0
        try:
            for _ in range(num_steps):
                t0 = time.perf_counter()
                while True:
                    if errors:
                        w, e = errors[0]
                        raise RuntimeError(f"sampler {w} failed: {type(e).__name__}: {e}") from e
                    try:
                        batch, _ = queue.get(int(state.version), timeout=0.1)
                        break
                    except QueueTimeout:
                        continue
                    except QueueClosed:
                        continue  # errors is set; raised above
                idle += time.perf_counter() - t0
                state, m = self._train(state, batch, {})
                published_at[int(state.version)] = time.monotonic()
                elapsed = time.perf_counter() - start
                trained += batch.shape[0]
                m.update({"runtime/queue_depth": float(len(queue)), "runtime/dropped": float(queue.stats.dropped),
                          "runtime/samples_per_s": trained / elapsed,
                          "runtime/learner_idle": idle / elapsed,
                          "runtime/sampler_busy": sum(busy) / (elapsed * c.num_samplers)})
                emit(m)
        finally:
            stop.set()
            queue.close()
            for t in threads:
                t.join(timeout=30)
        return state
