"""Minibatch layout: each device's rows carry its share of every minibatch; which rows form a
minibatch does not depend on the device count, and the step runs data-parallel (no gathers)."""

import re

import jax
import jax.numpy as jnp
import pytest
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from jaxrl_llm.learner import learner as L
from jaxrl_llm import testing
from jaxrl_llm.learner import minibatches
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models.config import ModelConfig


@settings(max_examples=80, deadline=None)
@given(hst.integers(1, 3), hst.integers(1, 4), hst.integers(1, 4), hst.integers(1, 3))
def test_minibatch_m_is_every_process_m_th_chunk_whatever_the_shards(procs, local_shards, m, c):
    """P processes of K shards, each with K·M·c rows, concatenated in process order the way
    `distributed.global_batch` does: minibatch m (`split`) is process 0's m-th chunk of its own
    rows, then process 1's, ...; each device block holds only its own rows of it; `join`
    inverts `split`."""
    local = local_shards * m * c
    rows = [np.arange(p * local, (p + 1) * local) for p in range(procs)]  # original row ids
    order = minibatches.host_order(local, m, local_shards, procs * local_shards)
    laid = np.concatenate([r if order is None else r[order] for r in rows])
    got = np.asarray(minibatches.split(laid, m, procs * local_shards))
    chunk = local // m
    for i in range(m):
        np.testing.assert_array_equal(got[i], np.concatenate([r[i * chunk:(i + 1) * chunk] for r in rows]))
    shards = procs * local_shards
    if shards > 1:  # device block d of the laid-out rows holds what block d of every minibatch needs
        blocks = laid.reshape(shards, -1)
        for i in range(m):
            for d, part in enumerate(got[i].reshape(shards, -1)):
                assert set(part) <= set(blocks[d])
    np.testing.assert_array_equal(np.asarray(minibatches.join(got, shards)), laid)


def test_a_rows_count_that_does_not_divide_falls_back_to_contiguous_minibatches():
    x = np.arange(12)
    assert minibatches.host_order(12, 4, 2, 2) is None  # 12 rows / (2 shards x 4) is not whole
    np.testing.assert_array_equal(np.asarray(minibatches.split(x, 4, 2)), x.reshape(4, 3))


def test_the_data_parallel_step_gathers_no_batch_and_reduces_gradients_once_per_minibatch():
    """On a data=2 mesh the compiled step keeps each device on its own rows: no all-gather (the
    contiguous split gathered the whole batch in every scan iteration and computed each
    minibatch on every device), and the gradients meet in all-reduces."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    c = L.default_config()
    c.num_minibatches, c.packing = 2, "off"
    lrn = L.Learner(cfg, {"name": "ppo"}, c, mesh=sharding.make_mesh(dict(data=2, fsdp=1, tensor=1,
                                                                         rules=sharding.DEFAULT_RULES),
                                                                    jax.devices()[:2]))
    state = lrn.init(jax.random.key(0))
    hlo = lrn.lower_step(state, testing.model_batch(state.params, cfg, seed=0)).compile().as_text()
    assert not re.findall(r"all-gather(?:-start)?\(", hlo)
    reduces = [line for line in hlo.splitlines() if re.search(r" all-reduce(?:-start)?\(", line)]
    # Inside the update loop only the loss normaliser and the gradient (with the loss) meet; the
    # metrics are reduced once, after it (they were 6 all-reduces of 41 buffers per update).
    assert len([r for r in reduces if "/while/body/" in r]) == 2


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True)


@pytest.mark.parametrize("objective,aux,data", [({"name": "decoupled_ppo", "kl": {"coef": 0.05}}, False, 4),
                                                ({"name": "jackpot"}, True, 4),  # top-k gathers, a second model
                                                ({"name": "decoupled_ppo"}, False, 8)])  # 4-row minibatches
def test_a_pure_data_mesh_trains_like_one_device(objective, aux, data):
    """data=4: every shard differentiates its own params copy and the gradients meet in one
    flat all-reduce (`minibatches.replica_value_and_grad`); the steps equal a single device's. data=8 with
    minibatches of 4 rows: XLA's own partitioning, the same steps."""
    c = L.default_config()
    c.lr, c.num_minibatches, c.packing = 3e-3, 2, "off"
    kw = dict(aux_model_cfg=CFG.replace(num_layers=1)) if aux else {}
    mesh4 = sharding.make_mesh(dict(data=data, fsdp=1, tensor=1, rules=sharding.DEFAULT_RULES), jax.devices()[:data])
    one = L.Learner(CFG, objective, c, mesh=sharding.make_mesh(None, jax.devices()[:1]), **kw)
    four = L.Learner(CFG, objective, c, mesh=mesh4, **kw)
    assert four.plan.replicas == data and not one.plan.replicas
    s1, s4 = one.init(jax.random.key(0)), four.init(jax.random.key(0))
    for i in range(2):
        batch = testing.model_batch(s1.params, CFG, seed=i, version=i)
        s1, m1 = one.train_step(s1, batch)
        s4, m4 = four.train_step(s4, batch)
        for k in ("loss", "grad_norm", "clip_frac"):
            if k in m1:
                assert m4[k] == pytest.approx(m1[k], abs=1e-5), k
    for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s4)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    if data == 8:
        return
    hlo = four.lower_step(s4, batch).compile().as_text()
    n = sum(x.size for x in jax.tree_util.tree_leaves(s4.params))
    reduces = [line.split(" all-reduce")[0] for line in hlo.splitlines() if re.search(r" all-reduce(-start)?\(", line)]
    assert any(f"f32[{n}]" in r for r in reduces)  # the policy's gradient: one flat buffer


def test_replicate_rows_gathers_every_leaf_in_one_buffer_per_dtype():
    """The step's metric pass on many processes: leaves of three dtypes, rows sharded over 4
    devices, come back equal and replicated through one all-gather per dtype."""
    mesh = sharding.make_mesh(dict(data=4, fsdp=1, tensor=1, rules=sharding.DEFAULT_RULES), jax.devices()[:4])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, sharding.BATCH_AXES))
    rng = np.random.default_rng(0)
    tree = {"logp": rng.normal(size=(2, 8, 5)).astype(np.float32), "topk": rng.normal(size=(2, 8, 5, 3)).astype(np.float32),
            "ids": rng.integers(0, 9, (2, 8, 5)).astype(np.int32), "ok": rng.random((2, 8)) < 0.5,
            "count": np.arange(16, dtype=np.int32).reshape(2, 8)}
    placed = jax.device_put(tree, rows)
    fn = jax.jit(lambda t: minibatches.replicate_rows(t, 1, sharding.replicated(mesh)))
    out = fn(placed)
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
        assert out[k].sharding.is_fully_replicated
    hlo = fn.lower(placed).compile().as_text()
    assert len(re.findall(r" all-gather(?:-start)?\(", hlo)) == 3  # float32, int32, bool
