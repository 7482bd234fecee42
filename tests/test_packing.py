"""Packed learner batches: the plan covers every real token once, the packed forward equals the
padded one, and every objective under every loss aggregation has the same loss and gradient
on packed and padded rows (rows of one generated token and a row filling a whole packed row
included); two learner steps agree with packing off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.learner import learner as L
from jaxrl_llm import objectives, testing
from jaxrl_llm.learner import forward, packing, update
from jaxrl_llm.parallel import sharding
from jaxrl_llm.batch import PolicyOutput
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.objectives.common import AGGREGATIONS

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True)
LEN = 16
# (first real column, prompt length, generated tokens) per row; 2 minibatches of 4 rows.
ROWS = [(0, 4, 12), (9, 3, 1), (6, 2, 3), (4, 5, 2),   # a full row, one generated token, ...
        (3, 3, 5), (10, 2, 1), (0, 3, 2), (5, 4, 7)]


def _batch(params, seed=0, rows=ROWS):
    n = len(rows)
    b = testing.model_batch(params, CFG, seed=seed, num_prompts=n // 4, group_size=4, length=LEN, prompt=2, topk=4,
                            version=2, max_staleness=2)
    inp = np.zeros((n, LEN), np.float32)
    loss = np.zeros((n, LEN), np.float32)
    for i, (start, prompt, gen) in enumerate(rows):
        inp[i, start:start + prompt + gen] = 1
        loss[i, start + prompt:start + prompt + gen] = 1
    m = jnp.asarray(loss)
    return b.replace(input_mask=jnp.asarray(inp), loss_mask=m, behav_logp=b.behav_logp * m,
                     advantages=b.advantages * m + 0.3 * m * (jnp.arange(n)[:, None] % 3 - 1),
                     versions=jnp.where(m > 0, jnp.maximum(b.versions, 0), -1))


@pytest.fixture(scope="module")
def setup():
    params = decoder.init_params(CFG, jax.random.key(0))
    batch = _batch(params)
    plan = packing.layout(batch.input_mask, 2)
    return params, batch, plan


def test_plan_places_every_real_token_once(setup):
    _, batch, plan = setup
    assert plan is not None and plan.rows == 2  # 4 padded rows per minibatch -> 2 packed
    mask = np.asarray(batch.input_mask).reshape(2, 4 * LEN) > 0
    src, dst = np.asarray(plan.src), np.asarray(plan.dst).reshape(2, -1)
    for m in range(2):
        placed = src[m][src[m] >= 0]
        assert sorted(placed.tolist()) == np.flatnonzero(mask[m]).tolist()
        np.testing.assert_array_equal(src[m].reshape(-1)[dst[m][mask[m]]], np.flatnonzero(mask[m]))
        assert (dst[m][~mask[m]] == -1).all()
    seg, pos = np.asarray(plan.segment), np.asarray(plan.position)
    assert ((seg > 0) == (src >= 0)).all() and (pos[seg == 0] == 0).all()
    x = jnp.asarray(np.arange(8 * LEN).reshape(8, LEN))
    back = packing.unpack(packing.pack(x[:4], plan.src[0]), plan.dst[0], fill=-1)
    np.testing.assert_array_equal(np.where(mask[0].reshape(4, LEN), np.asarray(x[:4]), -1), back)
    # Nothing to gain -> no plan (full rows); the bucket is a power of two or the padded count.
    assert packing.layout(np.ones((8, LEN)), 2) is None
    assert packing.row_buckets(12, 2) == [2, 4, 6, 8, 12]


def test_packed_forward_equals_padded(setup):
    params, batch, plan = setup
    mb = jax.tree_util.tree_map(lambda x: x[:4], batch)
    padded = decoder.forward(params, CFG, mb.tokens, mb.input_mask)
    tok = packing.pack(mb.tokens, plan.src[0])
    packed = decoder.forward_packed(params, CFG, tok, plan.segment[0], plan.position[0])
    back = packing.unpack(packed, plan.dst[0])
    real = np.asarray(mb.input_mask) > 0
    np.testing.assert_allclose(np.asarray(back)[real], np.asarray(padded)[real], atol=1e-5)


def _stats_fn(lrn, batch, plan):
    """params -> the objective-facing stats of minibatch 0 (padded layout either way)."""
    mb = jax.tree_util.tree_map(lambda x: x[:4], batch)
    pl = None if plan is None else jax.tree_util.tree_map(lambda x: x[0], plan)

    def f(params):
        s = forward.stats(lrn.plan.fwd, params, mb, topk=4, packed=pl)
        return {k: s[k] for k in ("logp", "entropy", "logp_at_ids", "topk_logp")}
    return mb, jax.jit(lambda p: jax.vjp(f, p)), f


def _objective(name, agg, mb, rng, prox):
    over = {"gspo__loss_agg" if name == "gspo" else "loss_agg": agg}
    if name == "m2po":  # the batch's behaviour log-probs are far from the model's
        over["m2po__tau"] = 15.0  # (log pi_prox - log pi_behav)^2 is 14 to 17 here: about half are kept
    cfg = objectives.make_config(name=name, **over)
    fn = objectives.get(name)

    def loss(stats):
        pol = PolicyOutput(logp=stats["logp"], version=jnp.int32(2), entropy=stats["entropy"],
                           logp_at_behav_topk=stats["logp_at_ids"], rng=rng)
        b = mb.replace(prox_logp=prox, ref_logp=mb.behav_logp,
                       prox_topk_logp=mb.topk_logp)
        return fn(pol, b, cfg)[0]
    return loss


def test_every_objective_and_aggregation_same_loss_and_gradient_packed(setup):
    """loss(params) = objective(stats(params)): equal stats and equal vector-Jacobian products
    of `stats` for each objective's cotangent give equal losses and parameter gradients."""
    params, batch, plan = setup
    lrn = L.Learner(CFG, dict(name="ppo"), mesh=sharding.make_mesh(None, jax.devices()[:1]))
    mb, vjp_pad, _ = _stats_fn(lrn, batch, None)
    _, vjp_pack, _ = _stats_fn(lrn, batch, plan)
    s_pad, back_pad = vjp_pad(params)
    s_pack, back_pack = vjp_pack(params)
    mask = np.asarray(mb.loss_mask) > 0
    for k in s_pad:
        np.testing.assert_allclose(np.asarray(s_pack[k])[mask], np.asarray(s_pad[k])[mask], atol=1e-5, err_msg=k)
    rng = jax.random.key(5)
    checked = 0
    for name in sorted(objectives.registry()):
        for agg in AGGREGATIONS:
            loss = _objective(name, agg, mb, rng, s_pad["logp"] - 0.02 * mb.loss_mask)
            l_pad, ct_pad = jax.value_and_grad(loss)(s_pad)
            l_pack, ct_pack = jax.value_and_grad(loss)(s_pack)
            np.testing.assert_allclose(float(l_pack), float(l_pad), atol=1e-5, err_msg=f"{name}/{agg}")
            g_pad, g_pack = back_pad(ct_pad)[0], back_pack(ct_pack)[0]
            for a, b in zip(jax.tree_util.tree_leaves(g_pack), jax.tree_util.tree_leaves(g_pad)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"{name}/{agg}")
            nz = float(jnp.abs(jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(g_pad)])).sum()) > 0
            checked += nz
    assert checked == len(objectives.registry()) * len(AGGREGATIONS)  # gradients are not trivially zero


@pytest.mark.parametrize("name", ["decoupled_ppo", "gepo"])
def test_learner_steps_packed_equal_padded(setup, name):
    params, batch, _ = setup
    out = {}
    for mode in ("auto", "off"):
        c = L.default_config()
        c.lr, c.num_minibatches, c.packing, c.packing_min_len = 3e-3, 2, mode, 0
        lrn = L.Learner(CFG, dict(name=name), c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
        state = lrn.init(jax.random.key(0), params=params)
        ms = []
        for seed in range(2):
            state, m = lrn.train_step(state, _batch(state.params, seed).replace(versions=batch.versions))
            ms.append(m)
        out[mode] = (state.params, ms)
    for a, b in zip(jax.tree_util.tree_leaves(out["auto"][0]), jax.tree_util.tree_leaves(out["off"][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    for ma, mb in zip(out["auto"][1], out["off"][1]):
        for k in ("loss", "clip_frac", "grad_norm", "kl_behav/sampled"):
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_sharded_packed_step_equals_single_device_padded():
    """Packed rows split over a (data 2, fsdp 2, tensor 2) mesh: rows bucketed to a multiple of 4."""
    params = decoder.init_params(CFG, jax.random.key(0))
    rows = ROWS[:4] + [(0, 2, 2)] * 4 + ROWS[4:] + [(1, 2, 2)] * 4  # 2 minibatches of 8 rows: 3 packed rows each
    batch = _batch(params, rows=rows)
    plan = packing.layout(batch.input_mask, 2, multiple=4)
    assert plan is not None and plan.rows == 4
    out = []
    for mesh, mode in ((sharding.make_mesh(dict(data=2, fsdp=2, tensor=2, rules=sharding.DEFAULT_RULES)), "auto"),
                       (sharding.make_mesh(None, jax.devices()[:1]), "off")):
        c = L.default_config()
        c.lr, c.num_minibatches, c.packing, c.packing_min_len = 1e-4, 2, mode, 0  # Adam steps ~lr per element
        lrn = L.Learner(CFG, dict(name="ppo"), c, mesh=mesh)
        state, m = lrn.train_step(lrn.init(jax.random.key(0), params=params), batch)
        out.append((jax.device_get(state.params), m["loss"]))
    assert out[0][1] == pytest.approx(out[1][1], abs=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(out[0][0]), jax.tree_util.tree_leaves(out[1][0])):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_packed_steps_compile_once_per_row_bucket(monkeypatch):
    """Batches of random lengths: one program per packed-row bucket (plus the padded one),
    counted as traces of the step (jit's C++ cache size reads 0 after some earlier tests)."""
    traces, step = [], update.train_step

    def counted(*args, **kwargs):
        traces.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(update, "train_step", counted)
    params = decoder.init_params(CFG, jax.random.key(0))
    c = L.default_config()
    c.num_minibatches, c.packing_min_len = 2, 0
    lrn = L.Learner(CFG, dict(name="ppo"), c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    state = lrn.init(jax.random.key(0), params=params)
    rng = np.random.default_rng(0)
    seen = set()
    for seed in range(8):
        rows = [(0, 2, int(g)) for g in rng.integers(1, LEN - 2, 8)]
        batch = _batch(params, seed, rows)
        plan = packing.layout(batch.input_mask, 2)
        seen.add(None if plan is None else plan.rows)
        state, _ = lrn.train_step(state, batch)
    assert len(seen) >= 2 and len(traces) == len(seen) <= len(packing.row_buckets(4))
