"""sharding.put: replicas on CPU devices share one host buffer; other placements are plain copies.
sharding.check_divisible: every split the mesh must make, checked from the rules."""

import gc

import ml_collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm.parallel import sharding


def _pointers(x):
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_replicated_on_cpu_devices_share_one_buffer(dtype):
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    tree = {"w": jnp.arange(3 * 1000, dtype=jnp.float32).reshape(3, 1000).astype(dtype), "s": jnp.asarray(2.5, dtype)}
    out = sharding.put(tree, NamedSharding(mesh, P()))
    for k, x in out.items():
        assert x.dtype == tree[k].dtype and x.sharding.device_set == set(mesh.devices.flat)
        assert len(_pointers(x)) == 1, k  # one buffer aliased by all four devices
        assert all(s.data.unsafe_buffer_pointer() % 64 == 0 for s in x.addressable_shards)
    gc.collect()  # the staging copy is owned by the arrays, not by a local that goes away
    _ = [np.full(1 << 16, 7.0) for _ in range(32)]
    for k, x in out.items():
        for s in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), np.asarray(tree[k]))
    # a private copy: the source is not aliased
    assert jax.tree_util.tree_leaves(tree)[1].unsafe_buffer_pointer() not in _pointers(out["w"])


def test_other_placements_are_plain_device_puts():
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    split = sharding.put(x, NamedSharding(mesh, P("data")))
    assert len(_pointers(split)) == 4 and split.sharding.spec == P("data")
    one = sharding.put(x, jax.devices()[1])
    assert one.devices() == {jax.devices()[1]}
    for y in (split, one):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_divisibility_is_checked_from_the_rules_before_anything_is_placed():
    """Qwen2.5-7B's shapes (28 heads, 4 KV heads): tensor=8 is refused naming the sizes that
    work, fsdp=8 passes, and rows that the data axis cannot split are named too."""
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=1, num_heads=28,
                      num_kv_heads=4, head_dim=128)
    shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    axes = models.logical_axes(cfg)
    mesh = lambda **kw: sharding.make_mesh(ml_collections.ConfigDict({**sharding.default_config().to_dict(), **kw}))
    tensor8 = sharding.check_divisible(axes, shapes, mesh(data=1, tensor=8), 512, kv_heads=4)
    assert len(tensor8) == 1 and "mesh.tensor=8 does not divide the model's heads [28]" in tensor8[0]
    assert "one of [1, 2, 4]" in tensor8[0]  # the 4 KV heads are replicated over tensor=8, not split
    assert "kv_heads [4]" in sharding.check_divisible(axes, shapes, mesh(data=1, tensor=8), 512)[0]  # no fallback
    assert sharding.check_divisible(axes, shapes, mesh(data=1, fsdp=8), 512) == []
    rows = sharding.check_divisible(axes, shapes, mesh(data=2, fsdp=4), 500)
    assert rows == ["the batch's 500 rows do not split over the learner's data x fsdp x expert = 8 devices: "
                    "change runtime.prompts_per_batch, mesh.data / mesh.fsdp / mesh.expert, or "
                    "runtime.sampler_devices (which takes devices from the learner)"]
    # The vocabulary over tensor when a rule maps it there (152064 = 2^7 x 1188: 8 divides it).
    assert sharding.indivisible(axes, shapes, {"tensor": 5})["tensor"][1]["vocab"] == {152064}


def test_kv_heads_the_tensor_axis_does_not_divide_are_replicated_and_train():
    """Qwen2.5-1.5B-like heads (12 query, 2 KV) on tensor=4: queries split, K/V projections
    replicated (MaxText's choice), and a learner step runs on that mesh."""
    from jaxrl_llm import models, testing
    from jaxrl_llm.learner import learner as L
    from jaxrl_llm.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=12, num_kv_heads=2,
                      head_dim=4)
    mesh = sharding.make_mesh(ml_collections.ConfigDict({**sharding.default_config().to_dict(), "data": 2,
                                                         "tensor": 4}))
    sh = sharding.param_shardings(models.logical_axes(cfg), mesh, kv_heads=2)
    attn = sh["layers_0"]["attn"]
    assert attn["q"]["kernel"].spec == P("fsdp", "tensor", None) and attn["k"]["kernel"].spec == P("fsdp", None, None)
    lrn = L.Learner(cfg, {"name": "ppo"}, mesh=mesh)
    st = lrn.init(jax.random.key(0))
    assert st.params["layers_0"]["attn"]["v"]["kernel"].sharding.spec == P("fsdp", None, None)
    _, m = lrn.train_step(st, testing.model_batch(models.init_params(cfg, jax.random.key(1)), cfg))
    assert np.isfinite(m["loss"])


def test_tpu_meshes_follow_the_chips_topology(monkeypatch):
    """TPU devices go through mesh_utils (topology-aware); others keep their order."""
    import types

    from jax.experimental import mesh_utils

    cpu = jax.devices()
    assert sharding.device_grid(cpu, [2, 2, 2]).tolist() == np.asarray(cpu).reshape(2, 2, 2).tolist()
    tpus = [types.SimpleNamespace(platform="tpu", id=i) for i in range(4)]
    asked = []
    monkeypatch.setattr(mesh_utils, "create_device_mesh",
                        lambda sizes, devices, **kw: asked.append((sizes, kw)) or np.asarray(devices[::-1]).reshape(sizes))
    grid = sharding.device_grid(tpus, [1, 2, 2])
    assert asked == [([1, 2, 2], {"allow_split_physical_axes": True})] and grid[0, 0, 0].id == 3
