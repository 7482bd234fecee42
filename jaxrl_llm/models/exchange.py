"""How an expert-parallel group's tokens reach the devices holding their experts and come back
(`ModelConfig.moe_exchange`), inside `shard_map` over the group's axes: X devices, device i
holding experts i held ... (i + 1) held - 1.

  gather      every device all-gathers the group's tokens with their routing, runs the pairs for
              its own experts and reduce-scatters the outputs back: (X - 1) N rows in and as
              many back per device, whatever the routing.
  all_to_all  each device sends each of its tokens only to the devices holding one of the
              token's k experts, once per device however many of them live there, and takes
              the outputs back the same way, summed per token (the dispatch / combine of
              Megatron-LM's and DeepEP's expert parallelism): at most min(k, X) - 1 rows per
              token cross the links, fewer than the gather's X - 1 as X grows past k.

On GPU and TPU `all_to_all` moves its rows by `jax.lax.ragged_all_to_all`, so only the rows sent
travel; XLA:CPU has no ragged-all-to-all, so there (the tests) the same semantics come from a
dense all-to-all of slices padded to N rows (`dense_ragged_all_to_all`), as many bytes as the
gather. Both are exact and dropless with static shapes: a device can receive every token of its
group, so its buffer holds X N rows either way; a row's experts held elsewhere get id `held` and
weight 0, which every dispatch leaves out (and the blocked loop skips the blocks past the last
used one at run time).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp


def ragged_collective() -> bool:
    """Whether this backend has XLA's ragged-all-to-all (GPU and TPU do; XLA:CPU does not)."""
    return jax.default_backend() != "cpu"


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                            axis_name, chunk: int):
    """`jax.lax.ragged_all_to_all` with one slice per device of `axis_name`, from a dense
    `jax.lax.all_to_all` of the slices padded to `chunk` rows: exact where none is longer."""
    pad = jnp.arange(chunk)
    rows = jnp.clip(input_offsets[:, None] + pad[None], 0, operand.shape[0] - 1)  # [X, chunk]
    sent = (pad[None] < send_sizes[:, None]).reshape(rows.shape + (1,) * (operand.ndim - 1))
    got = jax.lax.all_to_all(jnp.where(sent, operand[rows], 0), axis_name, 0, 0, tiled=True)  # slice i: from i
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each sender writes here
    dest = jnp.where(pad[None] < recv_sizes[:, None], at[:, None] + pad[None], output.shape[0])  # past the end: dropped
    return output.at[dest.reshape(-1)].set(got.reshape((-1,) + got.shape[2:]), mode="drop")


def _bytes(a):
    """[N, ...] -> its bytes [N, B] (uint8)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(a.shape[0], -1)


def _from_bytes(b, like):
    """`_bytes`' inverse: [M, B] uint8 -> [M, *like.shape[1:]] of like's dtype."""
    size = jnp.dtype(like.dtype).itemsize
    return jax.lax.bitcast_convert_type(b.reshape((b.shape[0],) + like.shape[1:] + ((size,) if size > 1 else ())),
                                        like.dtype)


def _packed(arrays):
    """(the arrays' bytes side by side [N, B] uint8, unpack: [M, B] -> each array's [M, ...])."""
    bytes_ = [_bytes(a) for a in arrays]
    ends = list(itertools.accumulate(b.shape[1] for b in bytes_))

    def unpack(got):
        return tuple(_from_bytes(got[:, end - b.shape[1]:end], a) for a, b, end in zip(arrays, bytes_, ends))

    return jnp.concatenate(bytes_, 1), unpack


def _mover(chunk: int):
    """ragged_all_to_all, or with `chunk` > 0 its dense stand-in with slices of that many rows (XLA:CPU)."""
    return functools.partial(dense_ragged_all_to_all, chunk=chunk) if chunk else jax.lax.ragged_all_to_all


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_rows(axes, *arrays):
    """`jax.lax.all_gather` (tiled, axis 0) of several [N, ...] arrays as one collective over
    their bytes side by side: one rendezvous where each array would take its own, which on CPU
    is most of what a small collective costs (a decode step's tokens, weights and expert ids)."""
    packed, unpack = _packed(arrays)
    return unpack(jax.lax.all_gather(packed, axes, axis=0, tiled=True))


def _gather_rows_fwd(axes, *arrays):
    return gather_rows(axes, *arrays), None


def _gather_rows_bwd(axes, _, cotangents):  # all_gather's transpose: each device's rows, summed
    scatter = functools.partial(jax.lax.psum_scatter, axis_name=axes, scatter_dimension=0, tiled=True)
    return tuple(None if t.dtype == jax.dtypes.float0 else scatter(t) for t in cotangents)


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def send_rows(axes, rows_out: int, chunk: int, plan, *arrays):
    """Ragged all-to-all of several [M, ...] arrays with one `plan` (input offsets, send sizes,
    output offsets, receive sizes: `jax.lax.ragged_all_to_all`'s) as one collective over their
    bytes side by side -> each array's [rows_out, ...] received (zeros elsewhere). `chunk` > 0:
    by `dense_ragged_all_to_all` with slices of that many rows (XLA:CPU)."""
    return _send(axes, rows_out, chunk, plan, arrays)


def _send(axes, rows_out, chunk, plan, arrays):
    packed, unpack = _packed(arrays)
    return unpack(_mover(chunk)(packed, jnp.zeros((rows_out, packed.shape[1]), jnp.uint8), *plan, axis_name=axes))


def _send_rows_fwd(axes, rows_out, chunk, plan, *arrays):
    rows_in = jnp.zeros((arrays[0].shape[0], 0), jnp.uint8)  # (its shape: the rows sent from)
    return send_rows(axes, rows_out, chunk, plan, *arrays), (plan, rows_in, tuple(a[:0] for a in arrays))


def _varying(a):
    return set(jax.typeof(a).manual_axis_type.varying)


def _send_rows_bwd(axes, rows_out, chunk, res, cotangents):
    """ragged_all_to_all's transpose: the rows received go back to where they were sent from (as
    varying over the manual axes as the arrays sent: `shard_map`'s type check)."""
    (offsets, sizes, there, received), rows_in, like = res
    arrived_at = jax.lax.all_to_all(there, axes, 0, 0, tiled=True)  # where each device's slice sits here
    came_from = jax.lax.all_to_all(offsets, axes, 0, 0, tiled=True)  # where it sat in that device's rows
    real = [t for t in cotangents if t.dtype != jax.dtypes.float0]
    back = iter(_send(axes, rows_in.shape[0], chunk, (arrived_at, received, came_from, sizes), real))

    def one(t, primal):
        if t.dtype == jax.dtypes.float0:
            return None
        g = next(back)
        missing = tuple(sorted(_varying(primal) - _varying(g)))
        return jax.lax.pcast(g, missing, to="varying") if missing else g

    return ((None,) * 4, *map(one, cotangents, like))


send_rows.defvjp(_send_rows_fwd, _send_rows_bwd)


def gather(axes, devices: int, held: int, x_NxD, weights_NxK, ids_NxK):
    """(x [X N, D], weights, local ids, back): every device's tokens (`gather_rows`); `back`
    reduce-scatters their outputs (summed over the experts here) to their devices -> [N, D]."""
    del devices
    x, weights, ids = gather_rows(axes, x_NxD, weights_NxK, ids_NxK)
    ids = ids - jax.lax.axis_index(axes) * held
    mine = (ids >= 0) & (ids < held)
    back = lambda y: jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)  # noqa: E731
    return x, jnp.where(mine, weights, 0), jnp.where(mine, ids, held), back


def all_to_all(axes, devices: int, held: int, x_NxD, weights_NxK, ids_NxK):
    """(x [X N, D], weights, local ids, back): the rows sent here (slice i from device i, in its
    token order), each with its token's experts held here; `back` returns their outputs (summed
    over the experts here) to where they came from -> [N, D], each token summed over its devices.
    An id of E or more (a padding token) goes nowhere."""
    n, k = ids_NxK.shape
    cap = n * min(k, devices)  # rows this device can send: one per (token, device of its experts)
    me = jax.lax.axis_index(axes)
    need_XxN = jnp.any(ids_NxK[None] // held == jnp.arange(devices)[:, None, None], -1)
    send = jnp.sum(need_XxN, 1, dtype=jnp.int32)
    flat = need_XxN.reshape(-1)
    slot = jnp.where(flat, jnp.cumsum(flat, dtype=jnp.int32) - 1, cap)  # by device, then token order
    token = jnp.full((cap,), n).at[slot].set(jnp.tile(jnp.arange(n), devices), mode="drop")  # each row's; n: none
    local = ids_NxK[None] - (jnp.arange(devices) * held)[:, None, None]  # as device j numbers its experts
    mine = (local >= 0) & (local < held)
    weights = jnp.where(mine, jnp.broadcast_to(weights_NxK[None], mine.shape), 0)
    weights, ids = (jnp.full((cap, k), fill, a.dtype).at[slot].set(a.reshape(-1, k), mode="drop")
                    for a, fill in ((weights, 0), (jnp.where(mine, local, held), held)))
    counts = jax.lax.all_gather(send, axes)  # [from, to]
    earlier = jnp.broadcast_to(jnp.arange(devices) < me, counts.shape)  # [i, j]: j < me
    offsets, recv = jnp.cumsum(send) - send, counts[:, me]
    there = jnp.sum(jnp.where(earlier.T, counts, 0), 0)  # where my slice lands on each device
    chunk = 0 if ragged_collective() else n  # a slice holds at most n rows (each token once)

    def back(y):
        home = jnp.sum(jnp.where(earlier, counts, 0), 1)  # where each device's slice for me sat in its rows
        rows = _mover(chunk)(y, jnp.zeros((cap, y.shape[1]), y.dtype), jnp.cumsum(recv) - recv, recv, home, send,
                    axis_name=axes)
        return jnp.zeros((n, y.shape[1]), y.dtype).at[token].add(rows, mode="drop")

    x = x_NxD.at[token].get(mode="fill", fill_value=0)
    # tokens, weights and ids in one collective (`send_rows`); the rows past those received hold no expert here
    x, weights, ids = send_rows(axes, devices * n, chunk, (offsets, send, there, recv), x, weights, ids)
    ids = jnp.where((jnp.arange(devices * n) < jnp.sum(recv))[:, None], ids, held)
    return x, weights, ids, back


def tokens(how: str, axes, devices: int, held: int, x_NxD, weights_NxK, ids_NxK):
    """`gather` or `all_to_all` (`config.EXCHANGES`)."""
    return {"gather": gather, "all_to_all": all_to_all}[how](axes, devices, held, x_NxD, weights_NxK, ids_NxK)
