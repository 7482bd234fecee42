"""Which rows form each minibatch, laid out so that no minibatch leaves its devices.

A step's B rows are split over the S devices of the batch axes (data x fsdp x expert) in contiguous
blocks, and its M minibatch updates run in a scan. Slicing minibatch m out of the contiguous
layout would put it on B/(M·B/S) of the devices: XLA then all-gathers the whole batch inside
every scan iteration and each device computes every minibatch (no data parallelism; over
gloo/DCN the gathers dominate a multi-process step). Instead each device's block holds its
share of every minibatch: in the jit, `[B] -> [S, M, c] -> [M, S, c] -> [M, B/M]` with
c = B/(S·M), a local reshape.

Which rows go together is the same with one device or many: with P processes of K shards
each (S = P·K), minibatch m is every process's m-th contiguous chunk of its own rows, in
process order (one process: rows [m·B/M, (m+1)·B/M), exactly the unsharded split). Each
process reorders its rows on the host (`host_order`) so that its K blocks carry those chunks.
Whole prompt groups stay together when a chunk holds whole groups (rows per process / M a
multiple of the group size). Where the rows do not divide (B/S not a multiple of M) the plain
contiguous split is used (correct, with the gathers).

`replica_value_and_grad`: on pure data meshes on CPU the gradient crosses devices and hosts as
one flat buffer instead of one per parameter (XLA:CPU's gloo makes a call per buffer).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def _local(rows: int, m: int, shards: int) -> bool:
    return shards > 1 and rows % (shards * m) == 0


def host_order(local_rows: int, m: int, local_shards: int, shards: int) -> Optional[np.ndarray]:
    """The order in which a process hands its rows to the learner (None: as they are), so that
    its k-th block of rows holds the k-th slice of each of its M chunks."""
    if not _local(local_rows * (shards // local_shards), m, shards) or local_shards == 1:
        return None
    c = local_rows // (m * local_shards)
    return np.arange(local_rows).reshape(m, local_shards, c).transpose(1, 0, 2).reshape(-1)


def split(x, m: int, shards: int):
    """[B, ...] (laid out by `host_order`) -> [M, B/M, ...], minibatch by minibatch."""
    if not _local(x.shape[0], m, shards):
        return x.reshape(m, x.shape[0] // m, *x.shape[1:])
    y = x.reshape(shards, m, x.shape[0] // (shards * m), *x.shape[1:])
    return jnp.swapaxes(y, 0, 1).reshape(m, x.shape[0] // m, *x.shape[1:])


def join(y, shards: int):
    """The inverse of `split`: [M, B/M, ...] -> [B, ...] in the batch's layout."""
    m, b = y.shape[:2]
    if not _local(m * b, m, shards):
        return y.reshape(m * b, *y.shape[2:])
    z = y.reshape(m, shards, b // shards, *y.shape[2:])
    return jnp.swapaxes(z, 0, 1).reshape(m * b, *y.shape[2:])


def host_layout(batch, m: int, shards: int, procs: int, index: int):
    """This process's rows (a TrajectoryBatch) in the order `split` expects; with many
    processes, group ids made distinct across processes (each numbers its own from 0)."""
    order = host_order(batch.shape[0], m, max(1, shards // procs), shards)
    if procs > 1:
        ids = np.unique(np.asarray(batch.group_ids), return_inverse=True)[1].reshape(-1)
        batch = batch.replace(group_ids=(ids + index * ids.size).astype(np.int32))
    return batch if order is None else jax.tree_util.tree_map(lambda x: x[order], batch)


def by_shard(x, shards: int, sharding):
    """[B, ...] -> [S, B/S, ...], the leading axis on the batch shards (a local reshape)."""
    return None if x is None else jax.lax.with_sharding_constraint(
        x.reshape(shards, x.shape[0] // shards, *x.shape[1:]), sharding)


def replica_value_and_grad(fn, params, shards: int, sharding, *args, **kw):
    """`value_and_grad(fn, has_aux=True)` w.r.t. replicated `params`, by shard: `fn` gets one
    params copy per batch shard ([S, ...] on `sharding`; shard s's rows must use copy s) inside
    the same global loss, so copy s's gradient is shard s's part of the sum; the parts are
    flattened into one [S, N] array and summed: one all-reduce of N floats per update."""
    copies = jax.tree_util.tree_map(
        lambda p: jax.lax.with_sharding_constraint(jnp.broadcast_to(p, (shards,) + p.shape), sharding), params)
    out, g = jax.value_and_grad(fn, has_aux=True)(copies, *args, **kw)
    leaves, tree = jax.tree_util.tree_flatten(g)
    parts = _one_buffer([x.astype(jnp.float32) for x in leaves], 1, lambda y: y.sum(0))
    return out, tree.unflatten([p.reshape(x.shape[1:]).astype(x.dtype) for p, x in zip(parts, leaves)])


def _one_buffer(arrays, lead: int, fn):
    """`fn` applied once to `arrays` (one dtype) flattened past their `lead` leading axes and
    concatenated on the last axis; returns the result split back into per-array [..., n] parts."""
    flat = [x.reshape(*x.shape[:lead], -1) for x in arrays]
    return jnp.split(fn(jnp.concatenate(flat, axis=-1)), np.cumsum([f.shape[-1] for f in flat])[:-1].tolist(),
                     axis=-1)


def replicate_rows(tree, rows: int, sharding):
    """`tree` on every device (`sharding`: replicated) in one gather per dtype: its leaves,
    [M, b, ...] with `rows` = 1 the row axis, go through `_one_buffer` under a `sharding`
    constraint. Over gloo a collective costs a call per buffer and a rendezvous; this is one
    of each per dtype."""
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    out = list(leaves)
    for dtype in sorted({x.dtype for x in leaves}, key=str):
        idx = [i for i, x in enumerate(leaves) if x.dtype == dtype]
        parts = _one_buffer([leaves[i] for i in idx], rows + 1,
                            lambda y: jax.lax.with_sharding_constraint(y, sharding))
        for i, part in zip(idx, parts):
            out[i] = part.reshape(leaves[i].shape)
    return tree_def.unflatten(out)
