"""Continuous batching (decode slots) against static batching: the same completions, log-probs
and top-K per prompt at any slot count; exact version tags under a mid-generation refresh;
bounded programs; fuller slots on heavy-tailed lengths."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import Sampler, SamplerConfig, slot_state

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                  head_dim=8)
EOS = 5
PROMPTS = [np.random.default_rng(i).integers(6, 64, 2 + (3 * i) % 9).tolist() for i in range(7)]


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(0)), decoder.init_params(CFG, jax.random.key(1))


def _base(**kw):
    return SamplerConfig(**{**dict(max_new_tokens=12, temperature=1.0, capture_topk=3, num_samples=2,
                                   prompt_buckets=(16,), decode_segment=4, eos_token_id=EOS), **kw})


@functools.cache  # samplers (and their compiled programs) shared between tests
def _sampler(scfg, mesh=None):
    return Sampler(CFG, scfg, mesh)


def _slots(scfg, slots, mesh=None):
    return _sampler(dataclasses.replace(scfg, batching="continuous", slots=slots), mesh)


def _assert_same(a, b):
    for f in ("tokens", "loss_mask", "input_mask", "versions", "topk_ids", "truncated", "group_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), err_msg=f)
    for f in ("behav_logp", "topk_logp"):
        np.testing.assert_allclose(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), atol=1e-5, err_msg=f)
    if a.behav_kept is not None or b.behav_kept is not None:
        np.testing.assert_array_equal(np.asarray(a.behav_kept), np.asarray(b.behav_kept))


@pytest.mark.parametrize("dist,slot_counts", [(dict(temperature=0.0), (3,)), (dict(temperature=1.0), (1, 4)),
                                              (dict(temperature=0.9, top_k=7, top_p=0.9), (5,))])
def test_same_completions_as_static_at_any_slot_count(params, dist, slot_counts):
    scfg = _base(**dist)
    limits = np.random.default_rng(3).integers(1, 13, 2 * len(PROMPTS))  # per-row budgets, mixed with EOS
    ref = _sampler(scfg).generate(params[0], PROMPTS, jax.random.key(4), version=3, limits=limits)
    lengths = np.asarray(ref.loss_mask).sum(1)
    assert (lengths <= limits).all() and len(set(lengths.tolist())) > 3  # uneven rows, budgets honoured
    if dist == dict(temperature=1.0):
        assert np.asarray(ref.truncated).sum() < len(lengths)  # some rows end with EOS
    for slots in slot_counts:
        _assert_same(ref, _slots(scfg, slots).generate(params[0], PROMPTS, jax.random.key(4), version=3,
                                                       limits=limits).validate())


def test_slots_split_over_a_mesh(params):
    scfg = _base()
    ref = _sampler(scfg).generate(params[0], PROMPTS, jax.random.key(5))
    sampler = _slots(scfg, 5, Mesh(np.asarray(jax.devices()[:2]), ("data",)))
    _assert_same(ref, sampler.generate(params[0], PROMPTS, jax.random.key(5)))
    assert sampler.slots(0).slots == 6  # rounded up to the mesh


def test_mid_generation_refresh_tags_every_token_with_its_params(params):
    """Weights swap before the third segment. Replay: a row finished before the swap is the
    v0-only completion, a row inserted after it the v1-only one; a row straddling it has v0
    tags up to a segment boundary, v1 after, and its v0 prefix equals the v0-only one."""
    scfg = _base(eos_token_id=None)
    limits = np.tile([2, 3, 12, 9, 4, 12, 7], 2)
    calls = []
    refresh = lambda: calls.append(1) or ((1, params[1]) if len(calls) >= 2 else None)
    got = _slots(scfg, 4).generate(params[0], PROMPTS, jax.random.key(6), refresh=refresh, limits=limits)
    only = [_sampler(scfg).generate(p, PROMPTS, jax.random.key(6), version=v, limits=limits)
            for v, p in enumerate(params)]
    toks, vers, gen = (np.asarray(x)[:, 16:] for x in (got.tokens, got.versions, got.loss_mask))
    kinds = set()
    for r in range(len(limits)):
        v = vers[r][gen[r] > 0]
        assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {0, 1}
        if (v == 0).all():
            np.testing.assert_array_equal(toks[r], np.asarray(only[0].tokens)[r, 16:]), kinds.add("v0")
        elif (v == 1).all():
            np.testing.assert_array_equal(toks[r], np.asarray(only[1].tokens)[r, 16:]), kinds.add("v1")
        else:
            switch = int(np.argmax(v == 1))
            assert switch % 4 == 1  # the first token after a boundary comes from the carried v0 logits
            np.testing.assert_array_equal(toks[r, :switch], np.asarray(only[0].tokens)[r, 16:16 + switch])
            kinds.add("both")
    assert kinds == {"v0", "v1", "both"}


def test_programs_are_bounded_whatever_the_mix_of_lengths(params):
    # A sampler of its own (not `_sampler`'s, shared between tests): its programs are counted in
    # JAX's global cache of compiled functions, from which a long-lived one may be evicted (its
    # count read 0 once in a whole-suite run).
    scfg = _base(temperature=0.0)
    sampler = Sampler(CFG, dataclasses.replace(scfg, batching="continuous", slots=3))
    rng = np.random.default_rng(0)
    for i in range(6):
        sampler.generate(params[0], PROMPTS[:3 + i % 3], jax.random.key(i),
                         limits=rng.integers(1, 13, 2 * (3 + i % 3)))
    engine = sampler.slots(0)
    traces = {k: getattr(engine, "_" + k)._cache_size() for k in ("empty", "prefill", "insert", "segment")}
    assert traces["empty"] == 1 and traces["prefill"] <= 2  # pools of 8 and 16 rows (6, 8 and 10 rows waiting)
    assert traces["insert"] <= 3 * traces["prefill"]  # 1, 2 or 4 rows from each pool
    assert traces["segment"] <= 12 // 4  # one per attention width
    # Widths in powers of two of segments: 6 programs at N = 1,024 in 32-step segments (not 32),
    # each reading at most twice the positions the deepest slot needs.
    widths = {slot_state.attention_width(r, 32, 1024) for r in range(1, 1025)}
    assert sorted(widths) == [32, 64, 128, 256, 512, 1024]
    assert all(r <= slot_state.attention_width(r, 32, 1024) < 2 * max(r, 32) for r in range(1, 1025))


def test_heavy_tail_keeps_slots_fuller_than_a_static_batch(params):
    """Occupancy (generated tokens / slot-steps run) is a count, not a timing."""
    scfg = _base(temperature=0.0)
    limits = np.array([12, 1, 2, 3, 1, 2, 4, 1, 12, 2, 3, 1, 2, 1])  # a heavy tail: two long rows
    sampler = _slots(scfg, 3)
    batch = sampler.generate(params[0], PROMPTS, jax.random.key(0), limits=limits)
    np.testing.assert_array_equal(np.asarray(batch.loss_mask).sum(1), limits)
    static_occupancy = limits.sum() / (len(limits) * limits.max())
    assert sampler.slots(0).occupancy[-1] > 1.5 * static_occupancy


def test_dot_product_attention_kernel_decodes_the_same(params):
    """models.attention through jax.nn.dot_product_attention (prefill, per-slot decode against
    the cache) gives the einsum kernel's completions."""
    scfg = _base(temperature=0.0)
    ref = _sampler(scfg).generate(params[0], PROMPTS, jax.random.key(4))
    other = Sampler(CFG.replace(attention="xla"), dataclasses.replace(scfg, batching="continuous",
                                                                                       slots=5))
    _assert_same(ref, other.generate(params[0], PROMPTS, jax.random.key(4)))
