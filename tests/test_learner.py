"""The sharded learner step: equivalence, bookkeeping, extra passes, robustness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm.learner import learner as L
from jaxrl_llm import models, testing
from jaxrl_llm.learner import forward
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models.config import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True)


def _learner(objective, mesh=None, **lc):
    c = L.default_config()
    c.lr, c.num_minibatches = 3e-3, 2
    c.packing = "off"  # one program per shape here; packed steps: tests/test_packing.py
    c.update(lc)
    return L.Learner(CFG, objective, c, mesh=mesh)


def _params_close(a, b, atol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def test_sharded_step_equals_single_device_and_params_are_sharded():
    assert len(jax.devices()) == 8, "conftest fakes 8 CPU devices"
    obj = {"name": "decoupled_ppo", "kl": {"coef": 0.05}}
    single = _learner(obj, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2, rules=sharding.DEFAULT_RULES))
    multi = _learner(obj, mesh=mesh)
    s1 = single.init(jax.random.key(0))
    s8 = multi.init(jax.random.key(0))
    _params_close(s1.params, s8.params, 0)  # same init, laid out differently
    kernel = s8.params["layers_0"]["mlp"]["gate"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (16, 32)  # [32, 64] split 2 x 2
    assert s8.params["embed"].sharding.spec == P("tensor", "fsdp")
    assert s8.params["layers_0"]["attn"]["q"]["kernel"].sharding.spec == P("fsdp", "tensor", None)
    assert s8.opt_state[1][0].mu["embed"].sharding.spec == P("tensor", "fsdp")  # Adam moments follow
    for i in range(2):
        batch = testing.model_batch(s1.params, CFG, seed=i, version=i)
        s1, m1 = single.train_step(s1, batch)
        s8, m8 = multi.train_step(s8, batch)
        assert m1["loss"] == pytest.approx(m8["loss"], abs=1e-5)
    _params_close(s1.params, s8.params, 1e-5)
    assert multi._step._cache_size() == 1 and single._step._cache_size() == 1


def test_splash_step_on_a_mesh_equals_the_chunked_step_on_one_device():
    """`model.attention=splash` (TPU's kernel; Pallas' interpreter on CPU) inside the sharded
    step, prox pass included: per-shard `shard_map`, the same loss and parameters as chunked."""
    obj = {"name": "decoupled_ppo"}
    single = _learner(obj, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2, rules=sharding.DEFAULT_RULES))
    c = L.default_config()
    c.lr, c.num_minibatches, c.packing = 3e-3, 2, "off"
    multi = L.Learner(CFG.replace(attention="splash"), obj, c, mesh=mesh)
    s1, s8 = single.init(jax.random.key(0)), multi.init(jax.random.key(0))
    batch = testing.model_batch(s1.params, CFG, seed=0, version=0)
    (s1, m1), (s8, m8) = single.train_step(s1, batch), multi.train_step(s8, batch)
    assert m1["loss"] == pytest.approx(m8["loss"], abs=1e-5)
    _params_close(s1.params, s8.params, 1e-5)


def test_minibatches_versions_staleness_and_no_retrace():
    lrn = _learner({"name": "ppo"}, num_minibatches=4)
    st = lrn.init(jax.random.key(1))
    for i in range(3):
        batch = testing.model_batch(st.params, CFG, seed=i, version=i, max_staleness=0)
        st, m = lrn.train_step(st, batch)
        assert int(st.version) == i + 1 and int(st.step) == 4 * (i + 1)
        assert m["staleness/mean"] == 0.0  # learner version i == token version i during step i
    stale = testing.model_batch(st.params, CFG, seed=9, version=1, max_staleness=0)
    st, m = lrn.train_step(st, stale)
    assert m["staleness/mean"] == 2.0 and m["staleness/max"] == 2.0  # learner at 3, data at 1
    assert lrn._step._cache_size() == 1


def test_prox_pass_equals_policy_at_step_start_and_a3po_adds_no_forward(monkeypatch):
    traced = []  # one entry per forward traced

    def counting(fwd, *a, **kw):
        traced.append(1)
        return stats(fwd, *a, **kw)

    stats = forward.stats
    monkeypatch.setattr(forward, "stats", counting)
    dec = _learner({"name": "decoupled_ppo"})
    st = dec.init(jax.random.key(2))
    batch = testing.model_batch(st.params, CFG, seed=3)
    prepared, _, timings = dec.prepare(st, batch)
    want = models.sequence_logprobs(st.params, CFG, batch.tokens, batch.input_mask)["logp"]
    np.testing.assert_allclose(np.asarray(prepared.prox_logp), np.asarray(want), atol=1e-6)
    assert timings["prox_time_s"] > 0
    dec.train_step(st, batch)
    dec_traces, traced[:] = len(traced), []
    a3 = _learner({"name": "a3po"})
    st = a3.init(jax.random.key(2))
    st, m = a3.train_step(st, batch)
    assert m["prox_time_s"] == 0.0
    assert len(traced) == 1 and dec_traces == 2  # the loss's forward; decoupled PPO adds its prox pass


def test_nan_batch_is_skipped_and_counted():
    lrn = _learner({"name": "ppo"}, num_minibatches=2)
    st = lrn.init(jax.random.key(3))
    snapshot = lambda t: jax.tree_util.tree_map(lambda x: np.array(x, copy=True), t)  # noqa: E731 (state is donated)
    before = snapshot(st.params)
    batch = testing.model_batch(st.params, CFG, seed=4)
    batch = batch.replace(advantages=jax.random.normal(jax.random.key(0), batch.advantages.shape) * batch.loss_mask)
    bad = batch.replace(behav_logp=batch.behav_logp.at[0, 7].set(jnp.nan))  # first minibatch only
    st, m = lrn.train_step(st, bad)
    assert m["skipped_updates"] == 1.0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(st.params))
    worse = batch.replace(behav_logp=jnp.full_like(batch.behav_logp, jnp.nan))
    after_one = snapshot(st.params)
    st, m = lrn.train_step(st, worse)
    assert m["skipped_updates"] == 3.0
    _params_close(st.params, after_one, 0)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after_one)))


def test_bad_batches_are_rejected_with_the_field_named():
    lrn = _learner({"name": "ppo"}, num_minibatches=3)
    st = lrn.init(jax.random.key(4))
    batch = testing.model_batch(st.params, CFG, seed=5)
    with pytest.raises(ValueError, match="TrajectoryBatch.behav_logp: expected shape"):
        lrn.train_step(st, batch.replace(behav_logp=batch.behav_logp[:, :-1]))
    with pytest.raises(ValueError, match="do not split into num_minibatches=3"):
        lrn.train_step(st, batch)


def test_jackpot_joint_step_lowers_policy_actor_kl():
    """The actor's distillation (Eq. 7) pulls it toward the policy. Zero advantages keep the
    policy still (its surrogate has zero gradient), so the test isolates the actor update."""
    actor_cfg = CFG.replace(num_layers=1, intermediate_size=32)
    c = L.default_config()
    c.lr, c.num_minibatches = 1e-2, 2
    lrn = L.Learner(CFG, {"name": "jackpot", "jackpot": {"distill_coef": 5.0}}, c, aux_model_cfg=actor_cfg)
    peaked = jax.tree_util.tree_map(lambda x: 4.0 * x, models.init_params(CFG, jax.random.key(5)))
    st = lrn.init(jax.random.key(5), params=peaked)
    batch = testing.model_batch(st.params, CFG, seed=6)
    batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))

    def kl(st):
        new = jax.nn.log_softmax(models.full_logits(st.params, CFG, batch.tokens, batch.input_mask), -1)
        act = jax.nn.log_softmax(models.full_logits(st.aux.params, actor_cfg, batch.tokens, batch.input_mask), -1)
        per = (jnp.exp(new) * (new - act)).sum(-1)[:, :-1]  # position t predicts token t + 1
        m = batch.loss_mask[:, 1:]
        return float((per * m).sum() / m.sum())

    first = kl(st)
    assert first > 0.1
    for _ in range(5):
        st, m = lrn.train_step(st, batch)
    assert kl(st) < 0.7 * first
    assert int(st.version) == 5 and "actor/distill_kl" in m and "jackpot/kappa" in m
    assert lrn.rollout_params(st) is st.aux.params and lrn.rollout_model_cfg == actor_cfg


def test_hf_checkpoint_loads_straight_into_shardings(tmp_path):
    from tests import hf_fixtures as F

    F.save(F.make_hf_model("qwen2_tied", vocab=64), str(tmp_path))
    cfg = models.load_config(str(tmp_path))
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2, rules=sharding.DEFAULT_RULES))
    shardings = sharding.param_shardings(models.logical_axes(cfg), mesh)
    params, _ = models.load_params(str(tmp_path), cfg, place=sharding.placer(shardings))
    gate = params["layers_1"]["mlp"]["gate"]["kernel"]
    assert gate.sharding == shardings["layers_1"]["mlp"]["gate"]["kernel"] and gate.sharding.spec == P("fsdp", "tensor")
    plain, _ = models.load_params(str(tmp_path))
    _params_close(params, plain, 0)
    lrn = L.Learner(cfg, {"name": "a3po"}, mesh=mesh)
    st = lrn.init(jax.random.key(0), params=params)
    st, m = lrn.train_step(st, testing.model_batch(plain, cfg, seed=1))
    assert np.isfinite(m["loss"]) and lrn._step._cache_size() == 1


@pytest.mark.parametrize("objective,aux", [({"name": "ppo"}, False), ({"name": "decoupled_ppo", "kl": {"coef": 0.1}}, False),
                                           ({"name": "jackpot"}, True)])
def test_abstract_state_is_init_without_the_arrays(objective, aux, tmp_path):
    """The restore template: every leaf's shape, dtype and sharding as `init` makes them (params
    and moments on fsdp x tensor, the rest replicated); a checkpoint restores into it."""
    from jaxrl_llm.store import checkpoint

    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2, rules=sharding.DEFAULT_RULES))
    lrn = L.Learner(CFG, objective, L.default_config(), mesh=mesh,
                    aux_model_cfg=CFG.replace(num_layers=1) if aux else None)
    real, abstract = lrn.init(jax.random.key(3)), lrn.abstract_state()
    assert jax.tree_util.tree_structure(real) == jax.tree_util.tree_structure(abstract)
    for a, b in zip(jax.tree_util.tree_leaves(real), jax.tree_util.tree_leaves(abstract)):
        assert isinstance(b, jax.ShapeDtypeStruct) and (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    ck = checkpoint.Checkpointer(str(tmp_path))
    ck.save(real, force=True)
    ck.wait()
    back = ck.restore(abstract)
    for a, b in zip(jax.tree_util.tree_leaves(real), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    ck.close()
