"""Each runtime mode realises the staleness it promises; async runs finish and fail loudly."""

import threading
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm.learner import learner as L
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.runtime import orchestrator as O
from jaxrl_llm.tasks.scoring import Scorer
from tests import checkers

CFG = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8)


class TargetTask:
    """Reward: fraction of completion tokens equal to `target`."""

    def __init__(self, target=5, fail_prompts_after=None, fail_reward_every=0):
        self.target, self.calls = target, 0
        self.fail_prompts_after, self.fail_reward_every = fail_prompts_after, fail_reward_every

    def prompts(self, rng, n):
        self.calls += 1
        if self.fail_prompts_after is not None and self.calls > self.fail_prompts_after:
            raise OSError("prompt source went away")
        return [rng.integers(1, 16, rng.integers(1, 4)).tolist() for _ in range(n)]

    def reward(self, prompt, completion):
        if self.fail_reward_every and sum(completion) % self.fail_reward_every == 0:
            raise ValueError("unparseable answer")
        return float(np.mean(np.asarray(completion) == self.target)) if completion else 0.0


def _orch(mode, task=None, mesh=None, placement=None, sampler_kw=None, reward_workers=0, **rc):
    c = L.default_config()
    c.lr, c.num_minibatches = 1e-3, 2
    lrn = L.Learner(CFG, {"name": "a3po"}, c, mesh=mesh)
    sampler = Sampler(CFG, SamplerConfig(**{**dict(max_new_tokens=4, num_samples=4, capture_topk=0, prompt_buckets=(4,)),
                                            **(sampler_kw or {})}))
    cfg = O.default_config()
    cfg.mode, cfg.prompts_per_batch = mode, 2
    cfg.update(rc)
    task = task or TargetTask()
    orch = O.Orchestrator(lrn, sampler, task, cfg, placement=placement, scorer=Scorer(task, reward_workers, 30.0))
    return orch, lrn.init(jax.random.key(0))


def _staleness(history):
    return [m["staleness/mean"] for m in history]


def test_sync_is_on_policy():
    orch, st = _orch("sync")
    st, hist = orch.run(st, 3)
    assert _staleness(hist) == [0.0] * 3 and int(st.version) == 3
    assert hist[-1]["staleness/hist"] == [sum(hist[-1]["staleness/hist"])]


def test_iterative_reuses_each_batch():
    orch, st = _orch("iterative", reuse=3)
    st, hist = orch.run(st, 6)
    assert _staleness(hist) == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_offpolicy_refresh_every_v_cycles_staleness():
    orch, st = _orch("offpolicy", refresh_every=4)
    st, hist = orch.run(st, 8)
    assert _staleness(hist) == [0.0, 1.0, 2.0, 3.0] * 2
    assert all(m["staleness/max"] == m["staleness/mean"] for m in hist)


def _drawn(orch, steps):
    """The delays (in steps, capped at max_staleness) the simulated mode draws, redrawn here
    from its delay model and seed."""
    c = orch.cfg
    model, rng = O._delay(c), np.random.default_rng([c.seed, 10_007])
    return [int(model.steps(rng, c.step_seconds, c.max_staleness)) for _ in range(steps)]


def test_simulated_matches_schedule_and_is_bit_reproducible():
    kw = dict(max_staleness=3, step_seconds=1.0, delay=dict(kind="lognormal", min=0.5, max=6.0, value=1.0,
                                                            weibull_shape=1.5))
    runs = []
    for _ in range(2):
        orch, st = _orch("simulated", **kw)
        st, hist = orch.run(st, 7)
        drawn = _drawn(orch, 7)
        assert _staleness(hist) == [float(min(d, k)) for k, d in enumerate(drawn)]  # never older than version 0
        assert max(drawn) <= 3 and len(set(drawn)) > 1
        runs.append((_staleness(hist), jax.tree_util.tree_map(np.asarray, st.params)))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(jax.tree_util.tree_leaves(runs[0][1]), jax.tree_util.tree_leaves(runs[1][1])):
        np.testing.assert_array_equal(a, b)


BATCHING = pytest.mark.parametrize("batching", ["static", "continuous"])


@BATCHING
def test_async_two_samplers_finish_and_shut_down(batching):
    before = threading.active_count()
    orch, st = _orch("async", num_samplers=2, queue_size=2, max_staleness=4, sampler_kw=dict(batching=batching))
    t = time.perf_counter()
    st, hist = orch.run(st, 5)
    assert time.perf_counter() - t < 120 and len(hist) == 5 and int(st.version) == 5
    assert all(0.0 <= m["staleness/max"] <= 4.0 for m in hist)
    assert all(0.0 <= m["runtime/learner_idle"] <= 1.0 for m in hist)
    time.sleep(0.5)
    assert threading.active_count() <= before  # sampler threads are gone


def test_async_mid_generation_refresh_mixes_versions_within_a_batch():
    orch, st = _orch("async", sampler_kw=dict(max_new_tokens=6, decode_segment=2), queue_size=1, max_staleness=4,
                     refresh_mid_generation=True)
    real, calls = orch.sampler.generate, []

    def generate(params, prompts, key, version=0, refresh=None):
        calls.append(refresh)
        if len(calls) == 2:  # hold the second batch between segments until the learner publishes

            got = []

            def waiting():  # the first boundary waits for v1; later ones just ask (no 60 s idle)
                deadline = time.monotonic() + (60 if not got else 0)
                while True:
                    newer = refresh()
                    if newer is not None or time.monotonic() >= deadline:
                        got.append(newer)
                        return newer
                    time.sleep(0.01)

            return real(params, prompts, key, version, refresh=waiting)
        return real(params, prompts, key, version, refresh=refresh)

    orch.sampler.generate = generate
    st, hist = orch.run(st, 3)
    assert all(callable(r) for r in calls)
    # Step 2 trains the second batch: its first segment came from v0 (staleness 1 at v1), the
    # rest from v1 (staleness 0).
    hist2 = hist[1]["staleness/hist"]
    assert len(hist2) == 2 and hist2[0] > 0 and hist2[1] > 0, hist2
    with pytest.raises(ValueError, match="refresh_mid_generation needs mode='async'"):
        _orch("sync", refresh_mid_generation=True)


@BATCHING
def test_sampler_exception_surfaces_quickly(batching):
    orch, st = _orch("async", task=TargetTask(fail_prompts_after=1), sampler_kw=dict(batching=batching))
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="sampler 0 failed: OSError: prompt source went away"):
        orch.run(st, 50)
    assert time.perf_counter() - t < 60


def test_failing_rewards_are_counted_not_fatal():
    orch, st = _orch("sync", task=TargetTask(fail_reward_every=3))
    st, hist = orch.run(st, 2)
    assert hist[-1]["reward/failures"] > 0 and int(st.version) == 2


def test_sampler_and_learner_on_disjoint_devices():
    devices = jax.devices()
    assert len(devices) == 8
    learner_mesh = sharding.make_mesh(dict(data=4, fsdp=1, tensor=1, rules=sharding.DEFAULT_RULES), devices[:4])
    placement = NamedSharding(Mesh(np.asarray(devices[4:]), ("replica",)), P())
    orch, st = _orch("sync", mesh=learner_mesh, placement=placement)
    st, hist = orch.run(st, 2)
    _, params = orch.store.latest()
    assert set(jax.tree_util.tree_leaves(params)[0].devices()) == set(devices[4:])
    assert set(jax.tree_util.tree_leaves(st.params)[0].devices()) == set(devices[:4])
    assert len(hist) == 2


@pytest.mark.parametrize("over,match", [
    (dict(mode="hogwild"), "runtime.mode='hogwild': expected one of 'sync', 'iterative', 'offpolicy', 'simulated', 'async'"),
    (dict(mode="sync", reuse=2), "reuse=2 needs mode='iterative'"),
    (dict(mode="sync", refresh_every=3), "refresh_every=3 needs mode='offpolicy'"),
    (dict(mode="simulated", max_staleness=-1), "finite runtime.max_staleness"),
    (dict(delay=dict(kind="gamma")), "runtime.delay.kind='gamma': expected one of 'none', 'fixed', 'lognormal'"),
    (dict(advantage="gae"), "runtime.advantage='gae': expected one of 'grpo', 'dr_grpo', 'rloo'"),
    (dict(advantage="dr_grpo", advantage_eps=1e-5), "runtime.advantage_eps=1e-05 has no effect with "
                                                    "runtime.advantage='dr_grpo'"),
    (dict(advantage="rloo", singleton_groups="reward"), "runtime.singleton_groups='reward' has no effect with "
                                                        "runtime.advantage='rloo'"),
])
def test_incompatible_runtime_options_fail_at_startup(over, match):
    cfg = O.default_config()
    cfg.update(over)
    with pytest.raises(ValueError, match=match):
        O.validate(cfg)


@pytest.mark.parametrize("mode,kw", [("iterative", dict(reuse=3)), ("offpolicy", dict(refresh_every=3))])
def test_a_bound_below_the_schedule_is_refused_with_drop_and_counted_with_keep(mode, kw):
    with pytest.raises(ValueError, match=f"mode '{mode}' .* up to 2 steps stale, beyond runtime.max_staleness=1"):
        _orch(mode, max_staleness=1, **kw)
    orch, st = _orch(mode, max_staleness=1, staleness_policy="keep", **kw)
    st, hist = orch.run(st, 6)
    assert _staleness(hist) == [0.0, 1.0, 2.0] * 2
    assert [m["runtime/over_stale"] for m in hist] == [0, 0, 1, 1, 1, 2]  # cumulative
    assert all(m["runtime/dropped"] == 0 for m in hist)


def test_sync_and_simulated_respect_the_bound_in_every_step():
    for mode, bound in (("sync", 0), ("simulated", 2)):
        orch, st = _orch(mode, max_staleness=bound, delay=dict(kind="fixed", value=5.0, min=1.0, max=8.0,
                                                               weibull_shape=1.5))
        st, hist = orch.run(st, 4)
        assert all(m["staleness/max"] <= bound and m["runtime/over_stale"] == 0 for m in hist), mode
    assert [m["staleness/max"] for m in hist] == [0.0, 1.0, 2.0, 2.0]  # min(5 steps, bound, version)


def test_async_drop_trains_nothing_beyond_the_bound():  # streaming: test_admission_...
    orch, st = _orch("async", max_staleness=0, queue_size=2, num_samplers=2)
    st, hist = orch.run(st, 4)
    assert all(m["staleness/max"] == 0.0 and m["runtime/over_stale"] == 0 for m in hist)
    dropped = [m["runtime/dropped"] for m in hist]
    assert dropped == sorted(dropped) and int(st.version) == 4  # cumulative count from the queue


def test_streaming_sampler_enqueues_whole_groups_as_they_finish():
    """Continuous batching in async mode: the queue holds prompt groups (G rows each), the
    learner's batch is `prompts_per_batch` whole groups, and every token's version tag names
    params the learner had published by then (in-flight updates)."""
    orch, st = _orch("async", sampler_kw=dict(batching="continuous", slots=3, max_new_tokens=6, decode_segment=2,
                                              eos_token_id=5), queue_size=1, max_staleness=-1)
    trained = []
    real = orch.train

    def train(state, batch):
        trained.append((int(state.version), batch))
        return real(state, batch)

    orch.train = train
    st, hist = orch.run(st, 4)
    assert int(st.version) == 4
    for version, batch in trained:
        assert batch.shape == (2 * 4, 4 + 6)
        ids = np.asarray(batch.group_ids)
        assert sorted(np.unique(ids, return_counts=True)[1].tolist()) == [4, 4]  # two whole groups of G = 4
        gen = np.asarray(batch.loss_mask) > 0
        tags = np.asarray(batch.versions)[gen]
        assert tags.min() >= 0 and tags.max() <= version
        adv = np.asarray(batch.advantages)
        for g in np.unique(ids):  # GRPO advantages are centred within each group
            row_adv = [adv[r][gen[r]][0] for r in np.flatnonzero(ids == g)]
            assert abs(sum(row_adv)) < 1e-4
    assert orch.sampler.slots(0).slots == 3


def _lengths_under(policy, steps=8):
    # 32 slots hold 16 groups of G = 2 while a learner step takes 4: short groups keep the learner
    # moving while long ones are still decoding, the way heavy-tailed reasoning lengths do.
    orch, st = _orch("async", sampler_kw=dict(batching="continuous", slots=32, num_samples=2, max_new_tokens=32,
                                              decode_segment=2, eos_token_id=5),
                     prompts_per_batch=4, queue_size=8, max_staleness=1, staleness_policy=policy)
    st, hist = orch.run(st, steps)
    assert int(st.version) == steps  # nothing hangs at the bound
    return {k: orch.lengths.samples(k) for k in ("generated", "trained", "dropped")}, hist


def test_admission_trains_the_lengths_the_sampler_generated():
    """staleness_policy="admit": prompts wait outside the slots instead of finished groups being
    dropped, so every trained token is within the bound and the trained completion lengths
    follow the generated ones (two-sample KS test). "drop" under the same bound discards the
    long groups (they span more learner versions) and trains the short ones: the bias that
    admission avoids."""
    from scipy import stats

    admit, hist = _lengths_under("admit")
    assert not admit["dropped"].size and all(m["runtime/dropped"] == 0 for m in hist)
    assert all(m["staleness/max"] <= 1 and m["runtime/over_stale"] == 0 for m in hist)
    assert len(set(admit["generated"])) > 4  # uneven lengths
    assert stats.ks_2samp(admit["trained"], admit["generated"]).pvalue > 0.01
    assert hist[-1]["runtime/tokens_trained_frac"] > 0.5 and hist[-1]["runtime/tokens_dropped_frac"] == 0
    drop, hist = _lengths_under("drop")
    assert drop["dropped"].size and hist[-1]["runtime/dropped"] > 0
    assert sum(drop["trained"]) + sum(drop["dropped"]) <= sum(drop["generated"])
    assert 0 < hist[-1]["runtime/tokens_dropped_frac"] < 1
    # Measured (4 runs, 8 steps): trained mean 7.0-7.4 tokens, dropped 16.1-16.5, generated 13.1-13.4
    # (KS p 3e-4 to 3e-3 for trained vs dropped at 8 steps, ~5e-6 at 12).
    assert np.mean(drop["trained"]) < np.mean(drop["generated"]) < np.mean(drop["dropped"])
    assert stats.ks_2samp(drop["trained"], drop["dropped"]).pvalue < 0.01
    with pytest.raises(ValueError, match="staleness_policy='admit' needs mode='async'"):
        _orch("sync", staleness_policy="admit")
    with pytest.raises(ValueError, match="needs --config.sampler.batching=continuous"):
        _orch("async", staleness_policy="admit")


class RecordingTask(TargetTask):
    def __init__(self):
        super().__init__()
        self.drawn = []

    def prompts(self, rng, n):
        self.drawn.append(super().prompts(rng, n))
        return self.drawn[-1]


@pytest.mark.parametrize("mode,kw", [("sync", {}), ("offpolicy", dict(refresh_every=2))])
def test_chunked_runs_follow_the_version_not_the_call(mode, kw):
    """Training in chunks (eval / checkpoint boundaries) draws new prompts and keeps the
    schedule: two run(1) calls == one run(2)."""
    runs = []
    for chunks in ((1, 1, 1), (3,)):
        orch, st = _orch(mode, task=RecordingTask(), **kw)
        hist = []
        for n in chunks:
            st, h = orch.run(st, n)
            hist += h
        runs.append((orch.task.drawn, _staleness(hist)))
    assert runs[0] == runs[1]
    assert runs[0][0][0] != runs[0][0][1]  # no prompt batch repeats at a chunk boundary


@settings(max_examples=50, deadline=None)
@given(hst.lists(hst.lists(hst.integers(0, 40), min_size=1, max_size=20), min_size=1, max_size=6))
def test_length_counts_equal_metrics_over_every_row(batches):
    """The run-long length metrics from counts per length equal NumPy's over the list of rows."""
    from jaxrl_llm.runtime.lengths import LengthCounts

    counts, rows = LengthCounts(), {"generated": [], "trained": [], "dropped": []}
    for i, lengths in enumerate(batches):
        kinds = ("generated", "trained") if i % 3 else ("generated", "dropped")
        for k in kinds:
            counts.add(k, SimpleNamespace(loss_mask=np.arange(41)[None, :] < np.asarray(lengths)[:, None]))
            rows[k] += lengths
    m, gen = counts.metrics(), max(1, sum(rows["generated"]))
    for k, v in rows.items():
        assert list(counts.samples(k)) == sorted(v)
        assert m[f"runtime/length_{k}_mean"] == pytest.approx(np.mean(v) if v else 0.0)
        assert m[f"runtime/length_{k}_p90"] == pytest.approx(np.percentile(v, 90) if v else 0.0)
    assert m["runtime/tokens_trained_frac"] == pytest.approx(sum(rows["trained"]) / gen)
    assert m["runtime/tokens_dropped_frac"] == pytest.approx(sum(rows["dropped"]) / gen)


class UniqueTask(TargetTask):
    """Prompts of 4 tokens: distinct enough to tell every prompt group of a run apart."""

    def prompts(self, rng, n):
        return [rng.integers(1, 16, 4).tolist() for _ in range(n)]


class CheckedTask(UniqueTask):
    """UniqueTask's reward, checked slowly in worker processes (the math task's path)."""

    checker = staticmethod(checkers.fraction_equal)

    def check_args(self, prompt, completion):
        return (tuple(completion), self.target, 0.02)


@pytest.mark.parametrize("batching,max_staleness,samplers,workers", [
    ("static", -1, 1, 0), ("static", 0, 2, 2), ("continuous", 1, 1, 0), ("continuous", 1, 1, 2)])
def test_async_trains_every_prompt_once_across_chunks_and_a_resume(batching, max_staleness, samplers, workers):
    """Groups queued, decoding or being scored when an async run() call ends (an eval /
    checkpoint boundary) are generated again in the next call, never skipped or trained twice;
    a new orchestrator (a resumed process) given the first one's runtime state continues each
    worker's stream. Told apart by the prompt tokens of what the learner trained or the queue
    dropped. With `workers`, rewards are checked in worker processes beside decoding and every
    trained row still carries its own reward."""
    kw = dict(sampler_kw=dict(batching=batching, slots=4, max_new_tokens=6, decode_segment=2, eos_token_id=5),
              num_samplers=samplers, queue_size=2, max_staleness=max_staleness, reward_workers=workers)
    make_task = CheckedTask if workers else UniqueTask
    units, seen = {}, []  # prompt -> (worker, draw, group); every trained or dropped group's prompt

    def spy(orch):
        real_draw, real_train, real_drop = orch.producer.draw, orch.train, orch.dropped_item

        def draw(worker, counter):
            prompts, key = real_draw(worker, counter)
            # The unit's own tokens: random ones of 4 tokens can repeat across a run's draws.
            assert counter < 15 * 15 and len(prompts) < 15
            prompts = [[worker, 1 + counter // 15, 1 + counter % 15, 1 + k] for k in range(len(prompts))]
            for k, p in enumerate(prompts):
                assert units.setdefault(tuple(p), (worker - 1, counter, k)) == (worker - 1, counter, k)
            return prompts, key

        def prompts_of(batch):
            toks, inp = np.asarray(batch.tokens)[:, :4], np.asarray(batch.input_mask)[:, :4] > 0
            ids = np.asarray(batch.group_ids)
            return [tuple(toks[r][inp[r]].tolist()) for r in [np.flatnonzero(ids == g)[0] for g in np.unique(ids)]]

        def train(state, batch):
            seen.extend(prompts_of(batch))
            toks, done = np.asarray(batch.tokens), np.asarray(batch.loss_mask) > 0
            np.testing.assert_allclose(batch.rewards, [np.mean(t[m] == 5) for t, m in zip(toks, done)], rtol=1e-6)
            return real_train(state, batch)

        def dropped(item):
            seen.extend(prompts_of(item[1]))
            real_drop(item)

        orch.producer.draw, orch.train, orch.dropped_item = draw, train, dropped

    orch, st = _orch("async", task=make_task(), **kw)
    spy(orch)
    for _ in range(3):
        st, _ = orch.run(st, 2)
    resumed, _ = _orch("async", task=make_task(), **kw)
    assert resumed.load_runtime_state(orch.runtime_state()) is None
    spy(resumed)
    st, hist = resumed.run(st, 3)
    assert int(st.version) == 9 and len(seen) >= 9 * 2
    delivered = [units[p] for p in seen]
    assert len(set(delivered)) == len(delivered)  # no group trained (or dropped) twice
    for w in range(samplers):  # what was delivered is what the position says, with no gap behind it
        nxt, partial = resumed.position.delivered(w)
        want = {(w, d, k) for d in range(nxt) for k in range(2)} | {(w, d, k) for d, g in partial.items() for k in g}
        assert {u for u in delivered if u[0] == w} == want
        if batching == "static":
            assert not partial
    if max_staleness == 0:
        assert hist[-1]["runtime/dropped"] == resumed.dropped > 0
    assert 0.0 <= hist[-1]["runtime/score_wait"] < 1.0
    for o in (orch, resumed):
        o.producer.scorer.close()


def test_simulated_delays_continue_across_a_resume():
    """The delay stream is part of the runtime state: 3 steps, then a new orchestrator given
    that state for 4 more, draw the delays of 7 uninterrupted steps; only the params of the
    restored version are at hand after the resume, so there the staleness is capped by the
    versions trained since (a resumed run used to ask for params it never had and fail)."""
    kw = dict(max_staleness=3, delay=dict(kind="lognormal", min=0.5, max=6.0, value=1.0, weibull_shape=1.5))
    straight, st = _orch("simulated", **kw)
    straight.run(st, 7)
    first, st = _orch("simulated", **kw)
    st, h1 = first.run(st, 3)
    second, _ = _orch("simulated", **kw)
    assert second.load_runtime_state(first.runtime_state()) is None
    _, h2 = second.run(st, 4)
    want = _drawn(straight, 7)
    assert _staleness(h1) == [float(min(d, k)) for k, d in enumerate(want[:3])] and len(set(want)) > 1
    assert _staleness(h2) == [float(min(d, i)) for i, d in enumerate(want[3:])] and max(want[3:]) > 0


def test_a_preemption_ends_the_async_learner_s_wait_for_samples(monkeypatch):
    """No sampler delivers: the learner's wait (`_gather`) polls; SIGTERM (the flag `Grace` sets)
    ends it with `Preempted`, so the run saves instead of outwaiting its grace period."""
    import signal

    from jaxrl_llm.parallel import preemption
    from jaxrl_llm.runtime import async_mode
    from jaxrl_llm.runtime.queue import VersionedQueue

    raised = []

    def wait():
        try:
            async_mode._gather(VersionedQueue(4), [], learner_version=0, items=1)
        except preemption.Preempted as e:
            raised.append(e.signum)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not raised  # waiting
    monkeypatch.setattr(preemption, "_installed", SimpleNamespace(signum=signal.SIGTERM))  # as Grace on SIGTERM
    t.join(5)
    assert not t.is_alive() and raised == [signal.SIGTERM]


def test_a_mode_registered_from_outside_gets_its_section_rules_and_runs():
    """The seam of `modes.register`: a mode declared outside the runtime (here, one that trains
    each batch `repeat` times, counting its batches in the checkpoint) gets its own
    `runtime.<name>` section with declared rules and cross-field rules, and the orchestrator
    builds and trains it by name."""
    from jaxrl_llm import validation as V
    from jaxrl_llm.runtime import modes

    class Repeat(modes.Sequential):
        def __init__(self, ctx):
            super().__init__(ctx)
            self.repeat, self.made, self._held = ctx.cfg.repeat_test.repeat, 0, None

        def _next(self, version):
            if self._held is None or version % self.repeat == 0:
                self.made += 1
                self._held = self._produce(self.store.latest()[1], version, version)
            return self._held

        def state(self):
            return {"made": self.made}

        def load(self, state):
            self.made = state["made"]

    def rule(c, batching):
        if c.repeat_test.repeat > 1 and c.max_staleness == 0:
            raise ValueError("repeat_test needs max_staleness >= repeat - 1")

    modes.register("repeat_test", modes.Spec(Repeat, section=V.Section(repeat=(2, V.integer(1))), validate=rule))
    try:
        cfg = O.default_config()
        assert cfg.repeat_test.repeat == 2 and "repeat_test" in modes.names()
        cfg.repeat_test.repeat = 0
        assert V.check(cfg, V.flatten(O.rules(), "runtime."), "runtime.") == [
            "runtime.repeat_test.repeat=0: expected an integer >= 1"]
        cfg.mode, cfg.repeat_test.repeat, cfg.max_staleness = "repeat_test", 3, 0
        with pytest.raises(ValueError, match="repeat_test needs max_staleness"):
            O.validate(cfg)
        with pytest.raises(ValueError, match="already registered"):
            modes.register("repeat_test", modes.Spec(modes.Sync))
        orch, st = _orch("repeat_test", repeat_test={"repeat": 3}, max_staleness=2)
        st, hist = orch.run(st, 6)
        assert _staleness(hist) == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0] and orch.mode.made == 2
        assert orch.runtime_state()["made"] == 2 and "runtime/sampler_busy" in hist[-1]
    finally:
        modes._REGISTRY.pop("repeat_test")
