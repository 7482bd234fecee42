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
  remote      sampler nodes on other machines lease prompts, fetch weights and send scored
              groups over the network into the same queue (`jaxrl_llm.remote`, docs/sampler_nodes.md).

Staleness (`jaxrl_llm.staleness`) means the same in every mode: `max_staleness` bounds it and
`staleness_policy` drops or keeps (and counts) batches beyond it. Where a mode's schedule fixes
the staleness (iterative: up to reuse - 1, offpolicy: up to refresh_every - 1) a bound below
it cannot be met by dropping, so that combination fails at start-up.

A task supplies prompts and rewards: `task.prompts(rng, n) -> list[list[int]]` and
`task.reward(prompt, completion) -> float`, or a checker run in worker processes beside decoding
(`tasks/scoring.py`). A reward that raises scores 0 and is counted.

The parts: a `Producer` (producer.py: draw, generate, score), the `WeightStore` (weights.py),
one `Mode` per run giving the learner its next batch (built by name from the registry in
modes.py; the modes live in modes.py, async_mode.py and `jaxrl_llm.remote`), and here the
`Orchestrator`, which trains on those batches, publishes each version and keeps the run-long
counters a checkpoint saves.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from jaxrl_llm import advantages, staleness
from jaxrl_llm.parallel import distributed
from jaxrl_llm import validation as V
from jaxrl_llm.runtime import delay as delay_lib
from jaxrl_llm.runtime import modes  # the package's __init__ registers its own modes first
from jaxrl_llm.runtime.lengths import LengthCounts
from jaxrl_llm.runtime.position import DataPosition
from jaxrl_llm.runtime.producer import Producer, Rollout
from jaxrl_llm.runtime.weights import WeightStore
from jaxrl_llm.tasks import envs

def section() -> V.Section:
    """The `runtime` section: the fields every mode reads, then each registered mode's own
    subsection (`runtime.remote` once `jaxrl_llm.remote` is imported)."""
    return V.Section(
        mode=("sync", V.one_of(*modes.names())),
        prompts_per_batch=(4, V.integer(1)),
        reuse=(1, V.integer(1)),  # i (iterative)
        refresh_every=(1, V.integer(1)),  # v (offpolicy)
        max_staleness=(8, V.integer(0, extra=(-1,))),  # bound on d = v(learner) - v(token), every mode; -1: unbounded
        # drop | keep (and count) batches beyond max_staleness | admit (hold prompts back)
        staleness_policy=("drop", V.one_of(*staleness.POLICIES)),
        queue_size=(2, V.integer(1)),
        num_samplers=(1, V.integer(1)),
        refresh_mid_generation=(False, V.boolean()),  # async: also swap weights between decode segments
        sampler_devices=(0, V.integer(0)),  # 0: samplers share the learner's devices; n: the last n devices are theirs
        delay=V.Section(kind=("none", V.one_of(*delay_lib.KINDS)), min=(1.0, V.non_negative()),
                        max=(8.0, V.non_negative()), value=(1.0, V.non_negative()),
                        weibull_shape=(1.5, V.positive())),
        step_seconds=(1.0, V.positive()),  # simulated: seconds of delay per learner step
        advantage=("grpo", V.one_of(*advantages.names())),
        # grpo: A = (r - mean) / (std + advantage_eps) (verl 1e-6, AReaL 1e-5); a prompt group of one
        # gets 0 (zero) or its reward over 1 + eps (reward: verl's mean 0 / std 1 for singletons).
        advantage_eps=(1e-6, V.positive()), singleton_groups=("zero", V.one_of("zero", "reward")),
        mask_zero_variance=(False, V.boolean()),
        # DAPO's dynamic sampling (dynamic.py): drop groups whose rewards are all equal (or whose std is
        # below dynamic_min_std > 0) and draw more prompts, at most dynamic_max_draws draws per batch
        dynamic_sampling=(False, V.boolean()), dynamic_min_std=(0.0, V.non_negative()),
        dynamic_max_draws=(8, V.integer(1)),
        seed=(0, V.integer(0)),
        **{name: spec.section for name, spec in modes.registered() if spec.section is not None})


def default_config():
    """The `runtime` section's defaults."""
    return section().config()


def rules() -> dict:
    return section().rules


def validate(c, batching: str = "static") -> None:
    """Each field against its declared rule, then the runtime's cross-field rules and the mode's
    own (`batching`: the sampler's, which admission needs)."""
    V.raise_all(V.check(c, V.flatten(rules(), "runtime."), "runtime."), what="invalid runtime option")
    spec = modes.get(c.mode)
    if c.reuse != 1 and c.mode != "iterative":
        raise ValueError(f"runtime.reuse={c.reuse} needs mode='iterative' (mode is {c.mode!r})")
    if c.refresh_every != 1 and c.mode != "offpolicy":
        raise ValueError(f"runtime.refresh_every={c.refresh_every} needs mode='offpolicy' (mode is {c.mode!r})")
    defaults = section().fields
    for key in ("advantage_eps", "singleton_groups"):  # GRPO's std and its groups of one
        if c.advantage != "grpo" and c[key] != defaults[key][0]:
            raise ValueError(f"runtime.{key}={c[key]!r} has no effect with runtime.advantage={c.advantage!r} (it "
                             "has no std normalisation and gives a group of one 0); it applies to 'grpo' only")
    beside = " or ".join(repr(n) for n in modes.concurrent())
    if c.refresh_mid_generation and not spec.concurrent:
        raise ValueError(f"runtime.refresh_mid_generation needs mode={beside} (mode is {c.mode!r})")
    if c.staleness_policy == "admit" and (not spec.concurrent or c.max_staleness < 0):
        raise ValueError(f"runtime.staleness_policy='admit' needs mode={beside} (async with "
                         "sampler.batching='continuous') and a finite runtime.max_staleness (mode is "
                         f"{c.mode!r}, max_staleness {c.max_staleness})")
    if c.dynamic_sampling and (c.mode not in _DYNAMIC or c.staleness_policy == "admit"):
        raise ValueError(f"runtime.dynamic_sampling works in modes {', '.join(_DYNAMIC)} and not with "
                         f"staleness_policy='admit' (mode {c.mode!r}, staleness_policy {c.staleness_policy!r})")
    if spec.validate is not None:
        spec.validate(c, batching)
    _delay(c)  # bad delay bounds fail here


_DYNAMIC = ("sync", "iterative", "offpolicy", "simulated", "async", "remote")  # the modes that refill (dynamic.py)


def _delay(c) -> delay_lib.DelayModel:
    d = c.delay
    return delay_lib.make(d.kind, min=d.min, max=d.max, value=d.value, weibull_shape=d.weibull_shape)


def expert_load(batch, experts: int) -> dict:
    """How evenly the sampler spread this batch's trained tokens over the experts: per sparse
    layer, the busiest expert's share over the mean share (1: even; `experts`: one expert took
    all), the mean and the worst over layers (this process's rows)."""
    ids = np.asarray(batch.routing)[np.asarray(batch.loss_mask) > 0]  # [tokens, layers, k]
    if not ids.size:
        return {}
    load = [np.bincount(ids[:, j].ravel(), minlength=experts) for j in range(ids.shape[1])]
    ratio = [c.max() / max(c.mean(), 1e-9) for c in load]
    return {"moe/expert_load_max_over_mean": float(np.mean(ratio)), "moe/expert_load_worst_layer": float(np.max(ratio))}


class Orchestrator:
    """Runs the learner on batches that the configured mode takes from the producer."""

    def __init__(self, learner, sampler, task, cfg=None, placement=None, scorer=None, node_config=None):
        """`scorer`: the task's scoring stage (`tasks.scorer`; default: `task.reward` in a scorer thread);
        `node_config`: a mode that serves sampler nodes tells them this (`{"task", "hf_path"}`)."""
        self.cfg = c = cfg or default_config()
        validate(c, sampler.cfg.batching)
        self.learner, self.sampler, self.task = learner, sampler, task
        self.producer = Producer(sampler, task, c, scorer)
        keep = c.max_staleness + 1 if modes.get(c.mode).retains_past else 1
        self.store = WeightStore(keep=keep, placement=placement, dtype=learner.rollout_model_cfg.dtype,
                                 lora_scale=learner.model_cfg.lora_scale)
        self.state = None  # the newest live state (the previous one was donated), e.g. for Ctrl-C saves
        # Run-long counters, saved with every checkpoint (`runtime_state`).
        self.over_stale = 0  # batches trained beyond max_staleness (policy keep)
        self.dropped = 0  # async: queue items dropped as over-stale
        self.position = DataPosition(c.prompts_per_batch)  # async: what each worker has delivered
        self.lengths = LengthCounts()  # async: completion lengths generated / trained / dropped
        on_drop = lambda item: self.dropped_item(item)  # noqa: E731  looked up per call (tests replace it)
        ctx = modes.Context(self.producer, self.store, c, self.position, self.lengths, _delay(c), on_drop,
                            learner, node_config)
        self.mode: modes.Mode = modes.get(c.mode).make(ctx)

    @property
    def reward_failures(self) -> int:
        return self.mode.reward_failures

    def close(self) -> None:
        """End what outlives run() calls (the remote mode's service)."""
        self.mode.close()

    def dropped_item(self, item: Rollout) -> None:
        """The queue dropped `item` as over-stale: counted, and delivered (not generated again)."""
        self.dropped += 1
        self.lengths.add("dropped", item.batch)
        self.position.deliver(*item.origin)

    def runtime_state(self) -> dict:
        """What a checkpoint keeps besides the TrainState so that a resumed run continues as
        this one would have (JSON-able, per process): the async data position, the simulated
        mode's delay stream, and run-long counters."""
        return {**self.mode.state(), "position": self.position.state(), "over_stale": self.over_stale, "dropped": self.dropped, "lengths": self.lengths.state(),
                "episodes": self.producer.episode_totals().tolist()}

    def load_runtime_state(self, s: dict) -> Optional[str]:
        """Continue from `runtime_state()`; returns a note where it cannot be exact."""
        self.mode.load(s)
        self.over_stale, self.dropped = s["over_stale"], s["dropped"]
        self.lengths.load(s["lengths"])
        self.producer.load_episode_totals(s.get("episodes"))
        return self.position.load(s["position"])

    def train(self, state, batch):
        """One learner step on `batch` (with many processes: this process's rows of the global
        batch), then publish the new version. Host-side metrics are over every process.
        Returns (state, metrics)."""
        version = int(state.version)  # the version this batch trains
        d = staleness.of_batch(version, batch.versions, batch.loss_mask)
        hist = np.bincount(d, minlength=1)
        rewards = np.asarray(batch.rewards, np.float64)
        # Loss tokens of groups whose rewards differ: what a group-normalised advantage can train on.
        spread = np.asarray(advantages.nonzero_variance(batch.rewards, batch.group_ids))
        informative = float((np.asarray(batch.loss_mask).sum(1) * spread).sum())
        # One gather for every process's scalars: [max staleness, reward sum, rows, failures,
        # dropped, histogram length, nonzero rewards, informative tokens] (each host collective
        # costs a round trip over gloo).
        g = distributed.gather(np.array([d.max(initial=0), rewards.sum(), rewards.size, self.reward_failures,
                                         self.dropped, hist.size, np.count_nonzero(rewards), informative],
                                        np.float64))
        self.over_stale += int(staleness.exceeds(int(g[:, 0].max()), self.cfg.max_staleness))
        totals = g[:, 1:5].sum(0)
        state, m = self.learner.train_step(state, batch)
        self.state = state
        self.publish(state)
        m["weights/publish_bytes"] = float(self.store.published_bytes)
        m["staleness/hist"] = distributed.host_sum(np.pad(hist, (0, int(g[:, 5].max()) - hist.size))).tolist()
        m["reward/mean"] = float(totals[0] / totals[1])
        m["reward/nonzero"] = float(g[:, 6].sum() / totals[1])  # the fraction of samples with any reward
        m["tokens/informative"] = float(g[:, 7].sum())
        m["reward/failures"] = float(totals[2])
        m["runtime/dropped"] = float(totals[3])
        m["runtime/over_stale"] = float(self.over_stale)
        m["processes"] = distributed.count()
        if self.producer.episodes:
            m.update(self._episode_metrics(version, batch))
        if batch.routing is not None:
            m.update(expert_load(batch, self.learner.model_cfg.num_experts))
        if hasattr(self.producer.task, "metrics"):  # a task that plays its own rows (the agent gateway)
            m.update(self.producer.task.metrics())
        return state, m

    def _episode_metrics(self, version: int, batch) -> dict:
        """A multi-turn run's episode and tool counters so far (`envs.summary`), this batch's
        staleness by turn (a weight update mid-episode makes later turns fresher) and, with
        sampler.turn_cache="recompute", the rebuilt caches' log-prob gap to the recorded one."""
        task = self.producer.task
        turns = task.max_turns if hasattr(task, "rollouts") else task.turn.max_turns
        per_turn = staleness.by_turn(version, batch.versions, batch.loss_mask, turns)
        r = self.producer.sampler.reprefill
        g = distributed.gather(np.concatenate([self.producer.episode_totals(), per_turn.ravel(),
                                               [r["rows"], r["tokens"], r["abs_sum"], r["abs_max"]]]))
        both = g.sum(0)
        m = envs.summary(both[:len(envs.TOTALS)])
        sums, counts = both[len(envs.TOTALS):-4].reshape(2, turns)
        m["staleness/turn"] = [float(s / c) if c else None for s, c in zip(sums, counts)]
        if self.producer.sampler.cfg.turn_cache == "recompute":
            m["sampler/reprefill_rows"] = float(both[-4])
            m["sampler/reprefill_logp_gap_mean"] = float(both[-2] / max(both[-3], 1.0))
            m["sampler/reprefill_logp_gap_max"] = float(g[:, -1].max())
        return m

    def publish(self, state) -> None:
        """The samplers' weights of `state` to the store (LoRA: the adapters, with the base)."""
        self.store.publish(int(state.version), self.learner.rollout_params(state), base=self.learner.rollout_base)

    def run(self, state, num_steps: int, on_metrics: Optional[Callable] = None):
        """Train for `num_steps` learner steps; returns (state, [metrics per step])."""
        self.publish(state)
        history = []
        self.mode.start()
        try:
            for _ in range(num_steps):
                batch = self.mode.next_batch(int(state.version))
                state, m = self.train(state, batch)
                m.update(self.mode.trained(batch))
                history.append(m)
                if on_metrics is not None:
                    on_metrics(m)
        finally:
            self.mode.stop()
            self.producer.scorer.pause()
        return state, history
