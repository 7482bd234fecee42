"""Stacked SwiGLU experts run on the tokens routed to them: the three dispatches of a mixture of
experts' MLP (`moe.py` routes; `ModelConfig.moe_dispatch` picks), on one device or per device of
the learner's mesh (`on_devices`).

  dense    every expert computes every token and the router's weights (zero off the top k)
           combine them: E / k times the expert FLOPs, no gather or scatter; exact, and the
           cheapest for a handful of experts.
  grouped  dropless: the (token, expert) pairs sorted by expert and run as one grouped matmul
           per projection (`jax.lax.ragged_dot`), then scattered back weighted: the FLOPs of
           the k chosen experts only.
  blocked  dropless: the sorted pairs padded to whole blocks per expert, one small SwiGLU per
           block (one batched matmul for a learner's batch): the chosen experts' FLOPs plus
           padding, from plain matmuls. Few pairs per expert (decode): each expert's pairs in
           the fewest slots that hold them all, one batched matmul over the stacked weights.

A projection (`gate`, `up` [E, D, F], `down` [E, F, D]) is its stacked weight, or with LoRA on
the experts (`lora.expert_side`) a tuple (W, A [E, in, r], B [E, r, out] scaled by alpha / r):
each expert's x W + (x A) B, the low-rank path taken on the rows each expert runs, as PEFT's
`target_parameters` adapts transformers' stacked experts, never a merged [E, in, out] copy (which
the backward pass would keep per layer: the size of the experts themselves).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import exchange
from jaxrl_llm.parallel.sharding import BATCH_AXES


def weight(p):
    """A projection's stacked weight (without its adapters)."""
    return p[0] if isinstance(p, tuple) else p


def _dot(x, p, dtype):
    """x [N, in] through one expert's projection (W, or W and its adapters)."""
    if isinstance(p, tuple):
        w, a, b = p
        return jnp.dot(x, w.astype(dtype)) + jnp.dot(jnp.dot(x, a.astype(dtype)), b.astype(dtype))
    return jnp.dot(x, p.astype(dtype))


def _every(x, p, dtype):
    """x ([N, in], shared, or [E, N, in], per expert) through every expert's projection -> [E, N, out]."""
    lhs = "ni" if x.ndim == 2 else "eni"
    w, a, b = p if isinstance(p, tuple) else (p, None, None)
    y = jnp.einsum(f"{lhs},eio->eno", x, w.astype(dtype))
    if a is not None:
        y = y + jnp.einsum("enr,ero->eno", jnp.einsum(f"{lhs},eir->enr", x, a.astype(dtype)), b.astype(dtype))
    return y


def _ragged(x, p, sizes, dtype):
    """Rows grouped by expert (`sizes` rows each, in expert order) through their expert's projection."""
    w, a, b = p if isinstance(p, tuple) else (p, None, None)
    y = jax.lax.ragged_dot(x, w.astype(dtype), sizes)
    if a is not None:
        y = y + jax.lax.ragged_dot(jax.lax.ragged_dot(x, a.astype(dtype), sizes), b.astype(dtype), sizes)
    return y


def swiglu(x, gate, up, down, dtype):
    """One expert (or a dense MLP): down(silu(x gate) * x up)."""
    return _dot(nn.silu(_dot(x, gate, dtype)) * _dot(x, up, dtype), down, dtype)


def dense_experts(x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype):
    """Every expert on every token, combined by the router's (top-k) weights."""
    combine_NxE = jnp.sum(jax.nn.one_hot(ids_NxK, weight(gate).shape[0], dtype=jnp.float32) * weights_NxK[..., None], 1)
    h = nn.silu(_every(x_NxD, gate, dtype)) * _every(x_NxD, up, dtype)
    return jnp.einsum("end,ne->nd", _every(h, down, dtype), combine_NxE.astype(dtype))


def _by_expert(ids_NxK, e: int):
    """(flat ids, the pairs' order sorted by expert (stable: token order within an expert), each
    expert's pair count). An id of E (another device's expert, `on_devices`) sorts last and is
    not counted."""
    flat = ids_NxK.reshape(-1)
    return flat, jnp.argsort(flat, stable=True), jnp.bincount(flat, length=e)


def grouped_experts(x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype):
    """The chosen (token, expert) pairs sorted by expert, one grouped matmul per projection.
    An id of E (another device's expert, `on_devices`) sorts last and is left out."""
    n, k = ids_NxK.shape
    e = weight(gate).shape[0]
    flat, order, sizes = _by_expert(ids_NxK, e)
    token = order // k
    sizes = sizes.astype(jnp.int32)
    xs = x_NxD[token]
    h = nn.silu(_ragged(xs, gate, sizes, dtype)) * _ragged(xs, up, sizes, dtype)
    y = _ragged(h, down, sizes, dtype) * weights_NxK.reshape(-1)[order][:, None].astype(dtype)
    y = jnp.where((flat[order] < e)[:, None], y, 0)  # rows past the groups: unspecified on some backends
    return jnp.zeros_like(x_NxD).at[token].add(y)


def capacity_experts(x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype, slots: int):
    """Each expert's pairs in a row of `slots`: [E, slots, D] through the stacked weights as one
    batched matmul per projection, with no copy of any expert's weights. Exact where no expert
    has more than `slots` pairs (the ones past it are left out); id E: left out."""
    _, order, sizes = _by_expert(ids_NxK, weight(gate).shape[0])
    return _in_slots(x_NxD, gate, up, down, weights_NxK, order, sizes, dtype, slots)


def _in_slots(x_NxD, gate, up, down, weights_NxK, order, sizes, dtype, slots: int):
    """`capacity_experts` on the pairs already sorted (`_by_expert`)."""
    n, k = weights_NxK.shape
    e = sizes.shape[0]
    at = (jnp.cumsum(sizes) - sizes)[:, None] + jnp.arange(slots)[None]  # [E, slots]: places in `order`
    valid = jnp.arange(slots)[None] < sizes[:, None]
    pair = order[jnp.minimum(at, n * k - 1)]
    token = pair // k
    x_ExSxD = jnp.where(valid[..., None], x_NxD[token], 0).astype(dtype)
    h = nn.silu(_every(x_ExSxD, gate, dtype)) * _every(x_ExSxD, up, dtype)
    y = _every(h, down, dtype) * jnp.where(valid, weights_NxK.reshape(-1)[pair], 0)[..., None].astype(dtype)
    return jnp.zeros_like(x_NxD, dtype=dtype).at[token.reshape(-1)].add(y.reshape(e * slots, -1))


def slot_ladder(n: int, k: int, e: int, gathered: int = 1) -> list:
    """`slotted_experts`' choices: from the mean load (with the tokens of `gathered` devices,
    1 / gathered of whose pairs are for the E experts here) up by a quarter at a time, each a
    multiple of 8, to N, the most any expert can get (a token picks k distinct experts). Finer
    than doubling, which padded a decode step's rows up to 2x (bench_moe's decode: the busiest
    expert at 1.4-2.7x the mean)."""
    ladder = [min(max(8, -(-n * k // (e * gathered)) + 7 & ~7), n)]
    while ladder[-1] < n:
        ladder.append(min(-(-5 * ladder[-1] // 4) + 7 & ~7, n))
    return ladder


def slotted_experts(x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype, gathered: int = 1):
    """`capacity_experts` with the fewest slots of `slot_ladder` that hold every expert's pairs,
    picked on the device (`lax.switch`; the pairs sorted once, outside it): exact for any
    routing, at E x slots rows."""
    n, k = ids_NxK.shape
    e = weight(gate).shape[0]
    ladder = slot_ladder(n, k, e, gathered)
    _, order, sizes = _by_expert(ids_NxK, e)
    branches = [functools.partial(lambda s, *a: _in_slots(*a, dtype, s), s) for s in ladder]
    pick = jnp.searchsorted(jnp.asarray(ladder), jnp.max(sizes), method="compare_all")
    return jax.lax.switch(pick, branches, x_NxD, gate, up, down, weights_NxK, order, sizes)


BATCHED_BLOCK = 128  # rows per block when the blocks run as one batched matmul
BATCHED_BYTES = 256 << 20  # ... and at most this much of per-block weight copies


def blocked_experts(x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype, block: int = 0, gathered: int = 1):
    """The chosen (token, expert) pairs sorted by expert, each expert's run padded to whole blocks
    of `block` rows, and one small SwiGLU per block with its expert's weights: the chosen experts'
    FLOPs plus the padding. With at least `BATCHED_BLOCK` / 2 pairs per expert (a learner's or a
    prefill's tokens) the blocks run as one batched matmul over per-block copies of their experts'
    weights (up to `BATCHED_BYTES`): its backward pass is a batched matmul too, where a loop's
    transposes into a scan, about half the speed on CPU (experiments/results/bench_moe_cpu.md).
    Otherwise (decode), `slotted_experts`: a loop over the blocks would copy each block's expert
    weights (XLA's CPU matmuls cannot read a dynamic slice in place), which costs decode more
    than the matmuls (experiments/results/bench_moe_cpu.md); with `block` given (or weights past
    `BATCHED_BYTES`), a loop over at most (N k + E (block - 1)) / block blocks. `gathered` > 1
    (`on_devices`, `among_devices`): the tokens of up to that many devices, about 1 / gathered of whose
    pairs have an expert here (the others have id E and are left out); the loop skips the blocks
    past the last used one at run time, so it costs what this device's pairs need."""
    n, k = ids_NxK.shape
    e, m = weight(gate).shape[0], n * k
    w_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((gate, up, down))) // e
    few = 2 * m < BATCHED_BLOCK * e * gathered
    if few and not block:
        return slotted_experts(x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype, gathered)
    batched = not block and gathered == 1 and not few and \
        -(-(m + e * (BATCHED_BLOCK - 1)) // BATCHED_BLOCK) * w_bytes <= BATCHED_BYTES
    block = BATCHED_BLOCK if batched else \
        block or int(min(64, max(8, 1 << max(m // (gathered * e) - 1, 1).bit_length())))
    flat, order, sizes = _by_expert(ids_NxK, e)
    expert = flat[order]
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    blocks = -(-(m + e * (block - 1)) // block)
    # id E: past the last row, dropped on the way in and read as zeros on the way out
    start = jnp.append(ends - padded, blocks * block)
    dest = start[expert] + jnp.arange(m) - jnp.append(jnp.cumsum(sizes) - sizes, jnp.sum(sizes))[expert]
    rows = jnp.zeros((blocks * block, x_NxD.shape[1]), dtype).at[dest].set(x_NxD[order // k].astype(dtype),
                                                                          mode="drop")
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), e - 1)
    pick = lambda p, w: jax.tree.map(lambda t: t[w], p)  # noqa: E731  (expert w's slice of W, A, B)

    def one(b):
        xb, w = jax.lax.dynamic_slice_in_dim(rows, b * block, block), owner[b]
        return swiglu(xb, pick(gate, w), pick(up, w), pick(down, w), dtype)

    def used(b):  # the rows past the last used block were never written: zeros, as the output
        unused = lambda b: jax.lax.dynamic_slice_in_dim(rows, b * block, block)  # noqa: E731
        return jax.lax.cond(b * block < ends[-1], one, unused, b)

    if batched:
        y = jax.vmap(swiglu, (0, 0, 0, 0, None))(rows.reshape(blocks, block, -1), pick(gate, owner), pick(up, owner),
                                                 pick(down, owner), dtype)
    else:
        y = jax.lax.map(one if gathered == 1 else used, jnp.arange(blocks))
    y = y.reshape(blocks * block, -1).at[dest].get(mode="fill", fill_value=0)
    y = y * weights_NxK.reshape(-1)[order][:, None].astype(dtype)
    return jnp.zeros_like(x_NxD, dtype=dtype).at[order // k].add(y)


def _specs(p, ex, tp, into: bool):
    """A projection's shard_map specs: experts over `ex`, the MLP width over `tp` (the output of
    gate / up, the input of down: `into`); A and B split as the W they adapt."""
    w = P(ex, tp, None) if into else P(ex, None, tp)
    if not isinstance(p, tuple):
        return w
    return (w, P(ex, tp, None), P(ex, None, None)) if into else (w, P(ex, None, None), P(ex, None, tp))


def among_devices(experts, x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype, how: str = "gather"):
    """`experts` on a sampler's rows (inside its `shard_map`, no collective of its own) with the
    stacked experts split over the rows' devices (`expert_specs`): decode reads each expert's
    weights on one device only, where replicated experts are read by every device (the bound on
    a MoE's decode step); the tokens move instead (`exchange.tokens`, `how`). Exact and dropless."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(mesh.manual_axes)
    devices = math.prod(mesh.shape[a] for a in axes)
    if experts is blocked_experts:
        experts = functools.partial(experts, gathered=devices)
    x, weights, ids, back = exchange.tokens(how, axes, devices, weight(gate).shape[0], x_NxD, weights_NxK, ids_NxK)
    return back(experts(x, gate, up, down, weights, ids, dtype))


def splits(num_experts: int, devices: int, expert_parallel: bool = True) -> bool:
    """Whether a sampler on `devices` devices splits a mixture's experts over them
    (`sampler.expert_parallel`): a mixture, several devices, and they divide its experts."""
    return bool(expert_parallel and num_experts and devices > 1 and num_experts % devices == 0)


def _stacked(path, leaf) -> bool:
    """A mixture-of-experts layer's stacked experts: a 3-D leaf of a `moe` module (W [E, ., .],
    LoRA's A and B)."""
    return "moe" in [getattr(k, "key", None) for k in path] and jnp.ndim(leaf) == 3


def expert_specs(params, axes):
    """PartitionSpecs of a params tree for a sampler's `shard_map` with expert parallelism: the
    stacked experts split on E over `axes`; the rest (router, shared expert, attention, ...)
    replicated."""
    return jax.tree_util.tree_map_with_path(lambda path, x: P(axes) if _stacked(path, x) else P(), params)


def splits_experts(params, num_experts: int) -> bool:
    """Whether `params` (as a `shard_map` body sees them) hold fewer than `num_experts` stacked
    experts per layer: split over the devices (`expert_specs`)."""
    held = jax.tree_util.tree_map_with_path(lambda path, x: x.shape[0] if _stacked(path, x) else None, params)
    return bool(num_experts) and any(e < num_experts for e in jax.tree.leaves(held))


def on_devices(experts, mesh, x_NxD, gate, up, down, weights_NxK, ids_NxK, dtype, how: str = "gather"):
    """`experts` run by every device of `mesh` (an abstract mesh with the parallel.sharding axes)
    on its own tokens, under `shard_map`: XLA cannot split the sort-based dispatches, and left to
    itself gathers every token onto every device of the batch axes. Each device's weights come
    gathered over fsdp (the ZeRO-3 gather), its experts' MLP split over `tensor` (partial sums,
    then a psum) and with `expert` > 1 only its E / expert experts: the tokens of its expert
    group reach the devices holding their experts and come back (`exchange.tokens`, `how`: by
    all-gather and reduce-scatter, or all-to-all; exact, dropless, no capacity factor)."""
    e, f = weight(gate).shape[0], weight(gate).shape[2]
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    size = lambda a: mesh.shape.get(a, 1)  # noqa: E731
    ex = "expert" if size("expert") > 1 and e % size("expert") == 0 else None
    tp = "tensor" if size("tensor") > 1 and f % size("tensor") == 0 else None
    if ex:
        experts = functools.partial(experts, gathered=size(ex)) if experts is blocked_experts else experts

    def vary(a):  # over every axis the result varies over: no gradient psum inside the blocked loop's cond
        rest = tuple(n for n in (*batch, tp) if n and n not in jax.typeof(a).manual_axis_type.varying)
        return jax.lax.pcast(a, rest, to="varying") if rest else a

    def local(x, weights, ids, gate, up, down):
        back = lambda y: y  # noqa: E731
        if ex:
            x, weights, ids, back = exchange.tokens(how, ex, size(ex), weight(gate).shape[0], x, weights, ids)
        y = experts(*jax.tree.map(vary, (x, gate, up, down, weights, ids)), dtype)
        return back(jax.lax.psum(y, tp) if tp else y)

    rows = P(batch)
    specs = (_specs(gate, ex, tp, False), _specs(up, ex, tp, False), _specs(down, ex, tp, True))
    run = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, *specs), out_specs=rows)
    n, pad = x_NxD.shape[0], -x_NxD.shape[0] % math.prod(size(a) for a in batch)
    if pad:  # (a batch the mesh does not divide: padding tokens with no expert, id E)
        x_NxD, weights_NxK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_NxD, weights_NxK))
        ids_NxK = jnp.pad(ids_NxK, ((0, pad), (0, 0)), constant_values=e)
    return run(x_NxD, weights_NxK, ids_NxK, gate, up, down)[:n]
