"""`models/exchange.py`: the dense stand-in for XLA's ragged-all-to-all against the semantics
JAX documents (a NumPy loop), the all-to-all exchange's rows, counts and way back against NumPy,
a layer on 8 devices exchanging by all-to-all equal to one device in values and gradients, and
its GPU program built on ragged-all-to-all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxrl_llm.models import exchange
from tests.test_moe import _layer_on

X = 4


def _on_devices(fn, *args):
    """`fn` on each of X devices (axis "x"), every argument and result split on its first axis."""
    mesh = Mesh(np.asarray(jax.devices()[:X]), ("x",))
    run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with jax.set_mesh(mesh):
        return jax.tree.map(np.asarray, run(*(jax.device_put(a, P("x")) for a in args)))


def test_the_dense_stand_in_has_ragged_all_to_alls_semantics():
    """Each device i sends operand[input_offsets[j]: + send_sizes[j]] to device j, written there at
    output_offsets[j] (the sender's say), over an output whose other rows stay as given: JAX's
    random sizes and offsets (gaps between the slices received) against a loop."""
    rng = np.random.default_rng(0)
    rows, width = 6, 3
    send = rng.integers(0, 3, (X, X)).astype(np.int32)  # [from, to] rows, at most `chunk` = 2
    operand = rng.normal(size=(X, rows, width)).astype(np.float32)
    in_off = rng.integers(0, rows - send + 1).astype(np.int32)  # slices may overlap, as the docs allow
    out_rows = 12
    out_off = np.zeros((X, X), np.int32)  # receiver j's slices from each sender, in sender order, with gaps
    for j in range(X):
        at = 1
        for i in range(X):
            out_off[i, j], at = at, at + send[i, j] + 1
    recv = send.T.copy()
    output = np.full((X, out_rows, width), -7.0, np.float32)
    want = output.copy()
    for i in range(X):
        for j in range(X):
            want[j, out_off[i, j]: out_off[i, j] + send[i, j]] = operand[i, in_off[i, j]: in_off[i, j] + send[i, j]]

    def fn(operand, output, in_off, send, out_off, recv):
        got = exchange.dense_ragged_all_to_all(operand[0], output[0], in_off[0], send[0], out_off[0], recv[0],
                                               axis_name="x", chunk=2)
        return got[None]

    got = _on_devices(fn, operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(got, want)


def test_gather_rows_is_one_all_gather_of_several_arrays_with_all_gathers_gradient():
    """bfloat16, float32 and int32 rows gathered as one collective equal each array's own
    `all_gather`, and the gradient (custom VJP) equals autodiff's through the separate gathers."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(X * 3, 4)).astype(np.float32)
    w = rng.normal(size=(X * 3, 2)).astype(np.float32)
    ids = rng.integers(-5, 9, (X * 3, 2)).astype(np.int32)
    c = jnp.asarray(rng.normal(size=(X, X * 3, 6)), jnp.float32)  # each device's weighting of what it gathered

    one = lambda *a: exchange.gather_rows("x", *a)  # noqa: E731
    each = lambda *a: tuple(jax.lax.all_gather(v, "x", axis=0, tiled=True) for v in a)  # noqa: E731

    def values_and_grads(gather):
        def fn(x, w, ids, c):
            def y(x, w):
                gx, gw, gi = gather(x.astype(jnp.bfloat16), w, ids)
                return jnp.sum(jnp.concatenate([gx.astype(jnp.float32), gw * gi.astype(jnp.float32)], 1) * c[0])

            gx, gw, gi = gather(x.astype(jnp.bfloat16), w, ids)
            return gx[None].astype(jnp.float32), gw[None], gi[None], *jax.grad(y, (0, 1))(x, w)
        return _on_devices(fn, x, w, ids, c)

    got, want = values_and_grads(one), values_and_grads(each)
    assert got[2].dtype == np.int32 and np.array_equal(got[2][0], ids)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert np.abs(got[3]).max() > 0 and np.abs(got[4]).max() > 0


def _routed(n=6, k=3, experts=8, seed=1):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(n)]) for _ in range(X)])
    ids[1, -2:] = experts  # two padding tokens (id E): sent nowhere
    weights = rng.uniform(0.1, 1.0, (X, n, k)).astype(np.float32)
    x = rng.normal(size=(X, n, 5)).astype(np.float32)
    return x, weights, ids.astype(np.int32)


def test_all_to_all_sends_each_token_once_to_each_device_of_its_experts_and_sums_the_way_back():
    """Device j receives, from each device i in turn, i's tokens with an expert on j (in token
    order, once however many of their experts j holds), with j's own expert ids and weights
    (`held`, weight 0 for the rest); outputs sent back sum per token over its devices."""
    x, weights, ids = _routed()
    n, k, held = ids.shape[1], ids.shape[2], 8 // X

    def fn(x, weights, ids):
        rx, rw, ri, back = exchange.all_to_all("x", X, held, x[0], weights[0], ids[0])
        mine = jnp.sum(rw, -1, keepdims=True)  # [X n, 1]: each received row's weight on the experts here
        return rx[None], rw[None], ri[None], back(rx * mine)[None]

    rx, rw, ri, summed = _on_devices(fn, x, weights, ids)
    for j in range(X):
        rows = [(i, t) for i in range(X) for t in range(n) if np.any(ids[i, t] // held == j)]
        assert not np.any(rx[j, len(rows):]) and np.all(ri[j, len(rows):] == held)
        for r, (i, t) in enumerate(rows):
            np.testing.assert_array_equal(rx[j, r], x[i, t])
            here = ids[i, t] // held == j
            np.testing.assert_array_equal(ri[j, r], np.where(here, ids[i, t] - j * held, held))
            np.testing.assert_array_equal(rw[j, r], np.where(here, weights[i, t], 0))
    real = ids < 8
    np.testing.assert_allclose(summed, x * np.sum(np.where(real, weights, 0), -1, keepdims=True), rtol=1e-6)
    distinct = sum(len(set(ids[i, t] // held) - {X}) for i in range(X) for t in range(n))
    assert distinct == sum(np.any(rw[j] > 0, -1).sum() for j in range(X))  # a row per (token, device) sent
    assert distinct < X * n * min(k, X)


@pytest.mark.parametrize("dispatch,sizes", [("blocked", dict(data=2, expert=4)), ("grouped", dict(data=2, expert=4)),
                                            ("dense", dict(fsdp=2, expert=2, tensor=2))])
def test_a_layer_exchanging_by_all_to_all_on_8_devices_equals_one_device(dispatch, sizes):
    """`moe_exchange=all_to_all` (XLA:CPU: the dense stand-in), beside data, fsdp and tensor
    splits: values and every gradient equal one device's, also for a batch no mesh divides."""
    for rows, length in ((8, 16), (3, 7)):
        (y1, g1), _, _ = _layer_on(None, dispatch, rows=rows, length=length)
        (y8, g8), compiled, _ = _layer_on(sizes, dispatch, rows=rows, length=length, exchange="all_to_all")
        np.testing.assert_allclose(y8, y1, atol=1e-5 * float(jnp.abs(y1).max()))
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
            np.testing.assert_allclose(b, a, atol=1e-5 * float(jnp.abs(a).max()))
        assert "all-to-all" in compiled.as_text()


def test_on_a_gpu_the_exchange_is_ragged_all_to_all_both_ways(monkeypatch):
    """The layer's step on 8 devices exported for CUDA (lowered, not run: no GPU here): with
    all_to_all the tokens move by XLA's ragged-all-to-all. The step runs the layer's forward
    twice (its value, and under grad), each one call out (tokens, weights and expert ids as
    bytes, `send_rows`) and one back; the backward pass the transposes of both. With gather, none."""
    monkeypatch.setattr(exchange, "ragged_collective", lambda: True)
    ragged = _layer_on(dict(data=2, expert=4), "grouped", exchange="all_to_all", platform="cuda")
    calls = [line for line in ragged.splitlines() if "@ragged_all_to_all" in line]
    assert len(calls) == 6 and sum("xui8>" in line for line in calls) == 3, len(calls)
    gathered = _layer_on(dict(data=2, expert=4), "grouped", platform="cuda")
    assert "@ragged_all_to_all" not in gathered and "all_gather" in gathered


def test_the_exchange_is_a_checked_setting():
    from jaxrl_llm import models

    with pytest.raises(ValueError, match="moe_exchange='alltoall'; valid: gather, all_to_all"):
        models.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=4, moe_exchange="alltoall")
