"""Packed learner batches: the real tokens of variable-length rows laid end to end in fewer rows.

A padded TrajectoryBatch spends the learner's FLOPs on padding up to its longest row; with
heavy-tailed completion lengths most of them. The learner instead runs the decoder on packed
rows (segment ids keep attention inside each sequence, RoPE positions restart per segment, as
tunix and the Megatron/NeMo "sequence packing" do) and scatters the per-token results back to
the padded [B, L] layout before the objective sees them. Objectives are therefore unchanged:
every sequence- and group-level quantity (sequence means, GSPO's sequence ratio, GEPO's group
expectations, length-normalised aggregations) is computed on the same [B, L] arrays as before,
and only the model forward/backward - where the FLOPs are - runs on the packed layout.

Packing is laid out on the host per minibatch (a minibatch's sequences fill its own packed rows,
so each optimizer update sees exactly the rows it saw padded): first-fit decreasing into rows of
the batch's length L, the number of rows rounded up to a small set of buckets so batches of
different lengths share compiled programs.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class PackLayout:
    """Index maps for M minibatches of b = B/M padded rows of length L, packed into R rows of L
    (leading M dropped inside the learner's minibatch scan).

      src       i32[M, R, L]  flat index (row * L + col) of the padded token at each packed
                              slot; -1: padding
      segment   i32[M, R, L]  1, 2, ... per sequence within a packed row; 0 on padding
      position  i32[M, R, L]  RoPE position within the sequence (0 at its first real token)
      dst       i32[M, b, L]  flat packed index (row * L + col) of each padded token; -1: not
                              a real token
    """

    src: jax.Array
    segment: jax.Array
    position: jax.Array
    dst: jax.Array

    @property
    def rows(self) -> int:
        return int(self.src.shape[1])


def row_buckets(rows: int, multiple: int = 1) -> list:
    """Packed-row counts allowed for minibatches of `rows` padded rows: 2^k and 3 * 2^k (two
    compiled shapes per octave, at most a third of the rows wasted) and the padded count itself,
    each rounded up to a multiple of `multiple` (the data-parallel mesh size)."""
    up = lambda r: -(-r // multiple) * multiple
    out, r = set(), 1
    while r < rows:
        out.update(up(x) for x in (r, 3 * r // 2) if x < rows)
        r *= 2
    out.add(up(rows))
    return sorted(x for x in out if x <= up(rows))


def first_fit(lengths, capacity: int) -> list:
    """First-fit decreasing: bins (lists of item indices, in placement order) of total length
    <= capacity. Longest first; ties keep the original order, so layouts are deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, free = [], []
    for i in order:
        for j, room in enumerate(free):
            if lengths[i] <= room:
                bins[j].append(i)
                free[j] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def layout(input_mask_BxL, num_minibatches: int, multiple: int = 1) -> Optional[PackLayout]:
    """The packing of a batch's real tokens (input_mask > 0), per minibatch; None when packing
    would not remove a single row (the padded layout is then as cheap)."""
    mask = np.asarray(input_mask_BxL) > 0
    b_all, length = mask.shape
    b = b_all // num_minibatches
    mbs = mask.reshape(num_minibatches, b, length)
    bins = [first_fit(m.sum(-1).tolist(), length) for m in mbs]
    need = max(len(x) for x in bins)
    rows = next(r for r in row_buckets(b, multiple) if r >= need)
    if rows >= b:
        return None
    src = np.full((num_minibatches, rows, length), -1, np.int32)
    seg = np.zeros((num_minibatches, rows, length), np.int32)
    pos = np.zeros((num_minibatches, rows, length), np.int32)
    dst = np.full((num_minibatches, b, length), -1, np.int32)
    for m, (mb, mb_bins) in enumerate(zip(mbs, bins)):
        for r, items in enumerate(mb_bins):
            at = 0
            for s, i in enumerate(items, start=1):
                cols = np.flatnonzero(mb[i])
                n = cols.size
                src[m, r, at:at + n] = i * length + cols
                seg[m, r, at:at + n] = s
                pos[m, r, at:at + n] = np.arange(n)
                dst[m, i, cols] = r * length + at + np.arange(n)
                at += n
    return PackLayout(*(jnp.asarray(x) for x in (src, seg, pos, dst)))


def _gather(x_NxL, index_MxL, fill):
    """out[m, l] = x.flat[index[m, l]] over the first two axes; `fill` where index < 0."""
    n, length = x_NxL.shape[:2]
    out = jnp.take(x_NxL.reshape(n * length, *x_NxL.shape[2:]), jnp.maximum(index_MxL, 0), axis=0)
    valid = (index_MxL >= 0).reshape(index_MxL.shape + (1,) * (x_NxL.ndim - 2))
    return jnp.where(valid, out, jnp.asarray(fill, out.dtype))


def pack(x_BxL, src_RxL, fill=0):
    """Padded [b, L, ...] -> packed [R, L, ...] (one minibatch's layout)."""
    return _gather(x_BxL, src_RxL, fill)


def unpack(y_RxL, dst_BxL, fill=0):
    """Packed [R, L, ...] -> padded [b, L, ...]; positions holding no real token get `fill`."""
    return _gather(y_RxL, dst_BxL, fill)
