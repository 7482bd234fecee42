"""Multi-turn rows in the sampler (`rollout.turns`): an environment's observation is forced into
the row's KV cache as token ids; hold (static batching) and release (continuous, parked caches)
give the same episodes; the learner's forward over the episode reproduces every sampled log-prob
(token in, token out); observations carry no loss, no version, no gradient."""

import dataclasses
import functools
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.learner import forward
from jaxrl_llm.batch import PolicyOutput
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.rollout.turns import Turns

CFG = ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                  head_dim=8)
EOS, STOP = 2, 3  # STOP ends a turn: the environment answers
PROMPTS = [np.random.default_rng(i).integers(4, 24, 2 + (3 * i) % 7).tolist() for i in range(5)]


@dataclasses.dataclass
class Reply:
    obs_ids: tuple
    done: bool = False


class Echo:
    """An environment that answers each turn with [20, (turn length) + 4, 21] and ends an
    episode at its third turn: replies depend on what was sampled, as a tool's do."""

    def __init__(self):
        self.calls = []

    def __call__(self, row, tokens, obs):
        self.calls.append((row, tokens.tolist(), obs.tolist()))
        turns = int((np.asarray(tokens) == STOP).sum())
        last = len(tokens) - 1 - (np.flatnonzero(obs)[-1] if obs.any() else -1)
        f = Future()
        f.set_result(Reply((20, min(last, 15) + 4, 21), done=turns >= 3))
        return f


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(0)), decoder.init_params(CFG, jax.random.key(1))


def _cfg(**kw):
    return SamplerConfig(**{**dict(max_new_tokens=40, temperature=1.0, capture_topk=2, num_samples=2,
                                   prompt_buckets=(8,), decode_segment=4, eos_token_id=EOS, turn_stop_ids=(STOP,)),
                            **kw})


@functools.cache
def _sampler(batching="static", slots=0, turn_cache="keep"):
    return Sampler(CFG, _cfg(batching=batching, slots=slots, turn_cache=turn_cache))


def _episodes(params, batching="static", slots=0, refresh=None, key=7, turn_cache="keep", env=None):
    env = env or Echo()
    batch = _sampler(batching, slots, turn_cache).generate(params, PROMPTS, jax.random.key(key), version=0, refresh=refresh,
                                               turns=Turns(env))
    return jax.tree.map(np.asarray, batch), env


def test_observations_follow_each_turn_as_forced_tokens(params):
    b, env = _episodes(params[0])
    p = 8
    obs = (b.input_mask > 0) & (b.loss_mask == 0)
    obs[:, :p] = False
    assert obs.any() and len(env.calls) >= 3
    for r in range(len(b.tokens)):
        toks = b.tokens[r, p:]
        stops = [t for t in np.flatnonzero(toks == STOP) if b.loss_mask[r, p + t] > 0]
        for t in stops:  # the reply's three ids follow every drawn STOP that had room
            if t + 3 < int(b.input_mask[r, p:].sum()):
                assert toks[t + 1] == 20 and toks[t + 3] == 21 and obs[r, p + t + 1:p + t + 4].all()
        assert (b.versions[r][obs[r]] == -1).all() and (b.behav_logp[r][obs[r]] == 0).all()
        assert (b.versions[r][b.loss_mask[r] > 0] == 0).all()
    assert len([c for c in env.calls]) == sum(int(((b.tokens[:, p:] == STOP) & (b.loss_mask[:, p:] > 0))[r].sum())
                                              for r in range(len(b.tokens))) - _stops_without_room(b, p)


def _stops_without_room(b, p):
    """Rows whose last token is a drawn STOP at the budget: no reply is asked for those."""
    n = (b.input_mask[:, p:] > 0).sum(1)
    last = b.tokens[np.arange(len(n)), p + n - 1]
    return int(((last == STOP) & (n >= 40)).sum())


def test_hold_and_release_give_the_same_episodes(params):
    held, _ = _episodes(params[0])
    for slots in (2,):  # fewer slots than rows: waiting rows are parked and re-enter other slots
        released, _ = _episodes(params[0], "continuous", slots)
        for f in ("tokens", "loss_mask", "input_mask", "versions", "topk_ids", "truncated"):
            np.testing.assert_array_equal(getattr(released, f), getattr(held, f), err_msg=f"{f} slots={slots}")
        np.testing.assert_allclose(released.behav_logp, held.behav_logp, atol=1e-5)


def test_the_learner_recomputes_every_sampled_log_prob_over_the_episode(params):
    """Token in, token out: the learner's forward over the episode's ids, observations included,
    gives the log-prob each drawn token was sampled with; observation positions get no gradient."""
    b, _ = _episodes(params[0])
    fwd = forward.Forward(CFG, PolicyDist(1.0), 16, None)
    batch = jax.tree.map(jnp.asarray, b)
    stats = forward.batch_stats(fwd, params[0], batch, None, gather=False)
    drawn = b.loss_mask > 0
    np.testing.assert_allclose(np.asarray(stats["logp"])[drawn], b.behav_logp[drawn], atol=2e-4)
    cfg = objectives.make_config(name="ppo")
    batch = batch.replace(advantages=batch.loss_mask * jnp.linspace(-1.0, 1.0, len(b.tokens))[:, None])
    grad = jax.grad(lambda lp: objectives.get("ppo")(PolicyOutput(logp=lp, version=jnp.int32(0)), batch, cfg)[0])(
        stats["logp"])
    obs = (b.input_mask > 0) & ~drawn
    assert obs.any() and np.all(np.asarray(grad)[obs] == 0.0) and np.abs(np.asarray(grad)[drawn]).sum() > 0


def test_a_weight_update_between_turns_shows_in_the_versions(params):
    calls = []

    def refresh():
        calls.append(1)
        return (1, params[1]) if len(calls) == 2 else None

    b, _ = _episodes(params[0], "continuous", 2, refresh=refresh)
    drawn = b.loss_mask > 0
    v = b.versions
    assert set(np.unique(v[drawn])) == {0, 1}
    for r in range(len(v)):  # per row, versions never go back
        seen = v[r][drawn[r]]
        assert (np.diff(seen) >= 0).all()


def test_a_recomputed_cache_gives_the_same_episodes_and_logs_its_log_prob_gap(params):
    """turn_cache="recompute": a parked row's cache is rebuilt from its tokens in one pass when it
    resumes. Same weights: the same episodes, and the logged gap to the recorded behaviour
    log-probs is float32 noise; a weight update while rows wait shows up in the gap."""
    held, _ = _episodes(params[0])
    engine = _sampler("continuous", 2, "recompute")
    again, _ = _episodes(params[0], "continuous", 2, turn_cache="recompute")
    for f in ("tokens", "loss_mask", "input_mask", "versions"):
        np.testing.assert_array_equal(getattr(again, f), getattr(held, f), err_msg=f)
    np.testing.assert_allclose(again.behav_logp, held.behav_logp, atol=1e-5)
    r = dict(engine.reprefill)
    assert r["rows"] >= 5 and r["tokens"] > r["rows"] and r["abs_max"] < 1e-4
    env, swapped = Echo(), []

    def refresh():  # new weights once a row waits: it is rebuilt under them
        if env.calls and not swapped:
            swapped.append(1)
            return 1, params[1]
        return None

    b, _ = _episodes(params[0], "continuous", 2, turn_cache="recompute", env=env, refresh=refresh)
    assert set(np.unique(b.versions[b.loss_mask > 0])) == {0, 1}
    assert engine.reprefill["abs_max"] > 0.01  # its tokens drawn under the old weights score differently


class Cut:
    """`Turns.stops` ending every turn after its third drawn id, as a stop string completed there
    would (the gateway's `stop`): what the row drew past it in the segment is undone."""

    def wanted(self):
        return set(range(2 * len(PROMPTS)))  # every row (two samples a prompt)

    def __call__(self, row, ids):
        return 3 if len(ids) > 3 else None


def test_turns_cut_short_at_a_segments_end_rewind_and_go_on_as_if_they_had_stopped_there(params):
    """Segments of 4 ids and turns cut after 3: each turn's drawn run is at most 3 ids and a cut
    one is followed by its reply; rows whose caches were rebuilt from their tokens
    (turn_cache="recompute") sample the same episodes, so no undone draw stayed in a kept cache;
    the learner's forward reproduces every behaviour log-prob, so positions moved back too."""
    def run(turn_cache):
        batch = _sampler("continuous", 2, turn_cache).generate(params[0], PROMPTS, jax.random.key(7), version=0,
                                                              turns=Turns(Echo(), stops=Cut()))
        return jax.tree.map(np.asarray, batch)

    b, p = run("keep"), 8
    runs = []
    for r in range(len(b.tokens)):
        drawn, real = b.loss_mask[r, p:] > 0, b.input_mask[r, p:] > 0
        edges = np.flatnonzero(np.diff(np.concatenate([[0], drawn[real].astype(int), [0]])))
        runs += (edges[1::2] - edges[::2]).tolist()
    assert max(runs) == 3 and runs.count(3) >= len(b.tokens)  # cut turns, several per row
    again = run("recompute")
    for f in ("tokens", "loss_mask", "input_mask", "versions"):
        np.testing.assert_array_equal(getattr(again, f), getattr(b, f), err_msg=f)
    np.testing.assert_allclose(again.behav_logp, b.behav_logp, atol=1e-5)
    stats = forward.batch_stats(forward.Forward(CFG, PolicyDist(1.0), 16, None), params[0],
                                jax.tree.map(jnp.asarray, b), None, gather=False)
    drawn = b.loss_mask > 0
    np.testing.assert_allclose(np.asarray(stats["logp"])[drawn], b.behav_logp[drawn], atol=2e-4)


def test_rows_parked_together_make_a_power_of_two_pool():
    """Three rows ending a turn in one segment are parked as a pool of four (the last row's copy
    pads it), each at its index: the programs on pools compile once per power-of-two size, not
    once per count of rows parked (which a long multi-turn run hits every step)."""
    from jaxrl_llm.rollout import continuous, slot_state

    sampler = _sampler("continuous", 6)
    engine = sampler.slots(6)
    n = sampler.cfg.max_new_tokens
    st = slot_state.empty(6, 8, CFG, sampler.cfg)
    st = st.replace(step=jnp.arange(6, dtype=jnp.int32) + 10)  # each slot's own, to tell the rows apart
    got = {"valid_BxN": np.ones((3, n), bool), "tokens_BxN": np.full((3, n), STOP, np.int32),
           "obs_BxN": np.zeros((3, n), bool)}
    turns = Turns(Echo())
    s = continuous._Slots.idle(6, 1)
    s.row_of[[1, 3, 4]] = [7, 8, 9]
    engine._wait(st, turns, np.asarray([7, 8, 9]), np.asarray([1, 3, 4]), got, np.ones(3, bool), s)
    pool, where = turns.waiting[7].pool
    assert pool.done_B.shape == (4,) and where == {7: 0, 8: 1, 9: 2}
    assert np.asarray(pool.step).tolist() == [11, 13, 14, 14]
    assert (s.row_of[[1, 3, 4]] == -1).all() and all(turns.waiting[i].slot == -1 for i in (7, 8, 9))
    # fed rows' keys likewise: three ids computed as four, the same keys as the three alone
    from jaxrl_llm.rollout import decode

    seen, keys = [], engine._keys
    engine._keys = lambda key, ids: (seen.append(len(ids)), keys(key, ids))[1]
    try:
        got = engine.row_keys(jax.random.key(3), [5, 6, 7])
    finally:
        engine._keys = keys
    want = jax.random.key_data(decode.row_keys(jax.random.key(3), jnp.asarray([5, 6, 7], jnp.int32)))
    assert seen == [4] and np.array_equal(got, np.asarray(want))


def test_a_stream_feeds_no_rows_past_max_rows_while_their_replies_wait(params):
    """Parked rows free their slots; with an environment that has not answered, a stream bounded
    by `max_rows` stops asking for rows at the bound (an unbounded one keeps feeding: the runaway
    backlog an environment slower than the slots caused in async runs)."""
    sampler = _sampler("continuous", 4)
    engine = sampler.slots(4)
    toks, mask, _ = sampler.pad_prompts(PROMPTS[:1] * 4, width=8)
    silent = Future()  # never answered

    def in_flight(max_rows):
        fed, finished, passes = [0], [0], [0]

        def feed():
            ids = np.arange(fed[0], fed[0] + 4)
            fed[0] += 4
            return ids, toks, mask, np.full(4, sampler.cfg.max_new_tokens), engine.row_keys(jax.random.key(1), ids)

        def stop():
            passes[0] += 1
            return passes[0] > 60

        turns = Turns(lambda row, tokens, obs: silent, release=True, max_obs=4)
        for ids, _ in engine.stream(params[0], 8, 0, feed, stop=stop, turns=turns, max_rows=max_rows):
            finished[0] += len(ids)
            assert max_rows is None or fed[0] - finished[0] <= max_rows + 4  # one feed past the bound at most
        return fed[0] - finished[0], len(turns.waiting)

    bounded, parked = in_flight(8)
    assert bounded <= 12 and parked >= 4
    assert in_flight(None)[0] > 24


def test_the_async_producer_bounds_its_stream_at_twice_its_slots(monkeypatch):
    """The async producer's stream (`Producer.stream`) asks the slots for the in-flight bound:
    its draw's rows decoding and as many again waiting or parked."""
    from jaxrl_llm.rollout import continuous
    from jaxrl_llm.runtime import orchestrator
    from jaxrl_llm.runtime.producer import Producer
    from jaxrl_llm.tasks.multiturn import TurnConfig
    from jaxrl_llm.tasks.tool_arithmetic import END, VOCAB_SIZE, ToolArithmetic

    asked = []
    monkeypatch.setattr(continuous.SlotEngine, "stream", lambda self, *a, **kw: asked.append(kw) or iter(()))
    task = ToolArithmetic(turn=TurnConfig(max_turns=3))
    cfg = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, eos_token_id=task.eos_id)
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=8, num_samples=2, capture_topk=0, batching="continuous",
                                         slots=4, prompt_buckets=task.prompt_buckets, eos_token_id=task.eos_id,
                                         pad_token_id=task.pad_id, turn_stop_ids=(END,)))
    rc = orchestrator.default_config()
    rc.prompts_per_batch = 3
    assert list(Producer(sampler, task, rc).stream(0, None, 0, iter(()), refresh=lambda: None, stop=lambda: True)) == []
    assert asked and asked[0]["max_rows"] == 2 * 3 * 2 and asked[0]["turns"] is not None
