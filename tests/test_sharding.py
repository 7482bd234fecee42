"""sharding.put: replicas on CPU devices share one host buffer; other placements are plain copies."""

import gc

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
