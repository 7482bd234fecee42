"""Mixture-of-experts MLP layers of Qwen3-MoE and Qwen2-MoE (transformers' `*SparseMoeBlock`):
a softmax router over `num_experts`, the top `num_experts_per_tok` experts of each token
(their probabilities renormalised to sum to 1 with `norm_topk_prob`), SwiGLU experts held as
stacked weights [E, ...], and for Qwen2-MoE a shared expert scaled by a sigmoid gate.

Dispatch (`ModelConfig.moe_dispatch`):
  dense    every expert computes every token and the router's weights (zero off the top k)
           combine them: E / k times the expert FLOPs, no gather or scatter; exact, and the
           cheapest for a handful of experts.
  grouped  dropless: the (token, expert) pairs sorted by expert and run as one grouped matmul
           per projection (`jax.lax.ragged_dot`), then scattered back weighted: the FLOPs of
           the k chosen experts only.
  blocked  dropless: the sorted pairs padded to whole blocks per expert, one small SwiGLU per
           block in a loop: the chosen experts' FLOPs plus padding, from plain matmuls.
`auto` picks grouped above `DENSE_UP_TO` experts on GPU and TPU (their grouped GEMMs), and on
CPU blocked above `DENSE_UP_TO_CPU`, where XLA's ragged_dot ran at half dense's speed
(experiments/results/bench_moe_cpu.md has all three against PyTorch eager).
No capacity factor: no token is ever dropped, so the sampler and the learner compute the same
function of the same routing. On the learner's mesh the dispatch runs per device under
`shard_map` (`on_devices`), with the experts split over the `expert` axis (expert parallelism).

The router runs in float32 whatever the compute dtype (its logits pick experts: a bf16 rounding
flips near-ties). A layer returns its router logits beside its output: the decoder keeps them for
the load-balancing loss (`load_balancing_loss`, the Switch Transformer loss as transformers
computes it) when `ModelConfig.moe_aux_loss_coef` asks for it.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm import validation as V
from jaxrl_llm.models.config import DISPATCH, DTYPES, ModelConfig
from jaxrl_llm.parallel.sharding import BATCH_AXES

DENSE_UP_TO = 8  # moe_dispatch=auto on GPU / TPU: dense-masked dispatch up to this many experts
DENSE_UP_TO_CPU = 4  # on CPU: the blocked loop's overhead outweighs E / k for fewer experts
_init = nn.initializers.normal(stddev=0.02)

# model.moe: how a mixture of experts runs. A checkpoint's config.json sets its layers; `experts` > 0
# makes a random Qwen3-MoE-style model of the model section's sizes instead (no hf_path), each
# expert `intermediate_size` wide (0: model.intermediate_size), the top `top_k` renormalised.
# sampler_router_dtype: the samplers' router matmul (research: perturbed sampler numerics).
# aux_loss_coef: the learner adds coef x `load_balancing_loss` to every objective's loss (0: off;
# -1: the checkpoint's router_aux_loss_coef, which transformers applies only with output_router_logits).
SECTION = V.Section(routing=("recompute", V.one_of("recompute", "replay")), dispatch=("auto", V.one_of(*DISPATCH)),
                    experts=(0, V.integer(0)), top_k=(2, V.integer(1)), intermediate_size=(0, V.integer(0)),
                    sampler_router_dtype=("float32", V.one_of(*DTYPES)), aux_loss_coef=(0.0, V.at_least(-1.0)))


def _part(axes):
    return nn.with_logical_partitioning(_init, axes)


def route(logits_NxE, k: int, normalise: bool):
    """(weights [N, k], expert ids [N, k]) of the top-k experts by softmax probability."""
    probs = jax.nn.softmax(logits_NxE.astype(jnp.float32), -1)
    top, ids = jax.lax.top_k(probs, k)
    if normalise:
        top = top / jnp.sum(top, -1, keepdims=True)
    return top, ids


def replay(logits_NxE, ids_NxK, normalise: bool):
    """(weights, ids) for given experts (Rollout Routing Replay, arXiv:2510.11370): the router's
    probabilities at those experts, renormalised as `route` does; differentiable in the logits."""
    ids = ids_NxK.astype(jnp.int32)
    top = jnp.take_along_axis(jax.nn.softmax(logits_NxE.astype(jnp.float32), -1), ids, -1)
    if normalise:
        top = top / jnp.sum(top, -1, keepdims=True)
    return top, ids


def _swiglu(x, gate, up, down, dtype):
    return jnp.dot(nn.silu(jnp.dot(x, gate.astype(dtype))) * jnp.dot(x, up.astype(dtype)), down.astype(dtype))


def dense_experts(x_NxD, gate_ExDxI, up_ExDxI, down_ExIxD, weights_NxK, ids_NxK, dtype):
    """Every expert on every token, combined by the router's (top-k) weights."""
    combine_NxE = jnp.sum(jax.nn.one_hot(ids_NxK, gate_ExDxI.shape[0], dtype=jnp.float32) * weights_NxK[..., None], 1)
    h = nn.silu(jnp.einsum("nd,edi->eni", x_NxD, gate_ExDxI.astype(dtype))) * jnp.einsum(
        "nd,edi->eni", x_NxD, up_ExDxI.astype(dtype))
    y_ExNxD = jnp.einsum("eni,eid->end", h, down_ExIxD.astype(dtype))
    return jnp.einsum("end,ne->nd", y_ExNxD, combine_NxE.astype(dtype))


def grouped_experts(x_NxD, gate_ExDxI, up_ExDxI, down_ExIxD, weights_NxK, ids_NxK, dtype):
    """The chosen (token, expert) pairs sorted by expert, one grouped matmul per projection.
    An id of E (another device's expert, `on_devices`) sorts last and is left out."""
    n, k = ids_NxK.shape
    e = gate_ExDxI.shape[0]
    flat = ids_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x_NxD[token]
    h = nn.silu(jax.lax.ragged_dot(xs, gate_ExDxI.astype(dtype), sizes)) * jax.lax.ragged_dot(
        xs, up_ExDxI.astype(dtype), sizes)
    y = jax.lax.ragged_dot(h, down_ExIxD.astype(dtype), sizes) * weights_NxK.reshape(-1)[order][:, None].astype(dtype)
    y = jnp.where((flat[order] < e)[:, None], y, 0)  # rows past the groups: unspecified on some backends
    return jnp.zeros_like(x_NxD).at[token].add(y)


def blocked_experts(x_NxD, gate_ExDxI, up_ExDxI, down_ExIxD, weights_NxK, ids_NxK, dtype, block: int = 0,
                    gathered: int = 1):
    """The chosen (token, expert) pairs sorted by expert, each expert's run padded to whole blocks
    of `block` rows, and one small SwiGLU per block with its expert's weights (a loop over at most
    (N k + E (block - 1)) / block blocks): the chosen experts' FLOPs plus the padding.
    `gathered` > 1 (`on_devices`): the tokens of that many devices, about 1 / gathered of whose
    pairs have an expert here (the others have id E and are left out); the blocks past the last
    used one are skipped at run time, so the loop costs what this device's pairs need."""
    n, k = ids_NxK.shape
    e, m = gate_ExDxI.shape[0], n * k
    block = block or int(min(64, max(8, 1 << max(m // (gathered * e) - 1, 1).bit_length())))
    flat = ids_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    sizes = jnp.bincount(flat, length=e)
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    blocks = -(-(m + e * (block - 1)) // block)
    # id E: past the last row, dropped on the way in and read as zeros on the way out
    start = jnp.append(ends - padded, blocks * block)
    dest = start[expert] + jnp.arange(m) - jnp.append(jnp.cumsum(sizes) - sizes, jnp.sum(sizes))[expert]
    rows = jnp.zeros((blocks * block, x_NxD.shape[1]), dtype).at[dest].set(x_NxD[order // k].astype(dtype),
                                                                          mode="drop")
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), e - 1)

    def one(b):
        xb, w = jax.lax.dynamic_slice_in_dim(rows, b * block, block), owner[b]
        return _swiglu(xb, gate_ExDxI[w], up_ExDxI[w], down_ExIxD[w], dtype)

    def used(b):  # the rows past the last used block were never written: zeros, as the output
        unused = lambda b: jax.lax.dynamic_slice_in_dim(rows, b * block, block)  # noqa: E731
        return jax.lax.cond(b * block < ends[-1], one, unused, b)

    y = jax.lax.map(one if gathered == 1 else used, jnp.arange(blocks)).reshape(blocks * block, -1)
    y = y.at[dest].get(mode="fill", fill_value=0) * weights_NxK.reshape(-1)[order][:, None].astype(dtype)
    return jnp.zeros_like(x_NxD, dtype=dtype).at[order // k].add(y)


def on_devices(experts, mesh, x_NxD, gate_ExDxI, up_ExDxI, down_ExIxD, weights_NxK, ids_NxK, dtype):
    """`experts` run by every device of `mesh` (an abstract mesh with the parallel.sharding axes)
    on its own tokens, under `shard_map`: XLA cannot split the sort-based dispatches, and left to
    itself gathers every token onto every device of the batch axes. Each device's weights come
    gathered over fsdp (the ZeRO-3 gather), its experts' MLP split over `tensor` (partial sums,
    then a psum) and with `expert` > 1 only its E / expert experts: the tokens of its expert
    group are all-gathered, run through the experts held here and reduce-scattered back
    (expert parallelism by all-gather; exact, dropless, no capacity factor)."""
    e, f = gate_ExDxI.shape[0], gate_ExDxI.shape[2]
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
        if ex:
            x, weights, ids = (jax.lax.all_gather(a, ex, axis=0, tiled=True) for a in (x, weights, ids))
            ids = ids - jax.lax.axis_index(ex) * gate.shape[0]
            mine = (ids >= 0) & (ids < gate.shape[0])
            weights, ids = jnp.where(mine, weights, 0), jnp.where(mine, ids, gate.shape[0])
        y = experts(*map(vary, (x, gate, up, down, weights, ids)), dtype)
        y = jax.lax.psum(y, tp) if tp else y
        return jax.lax.psum_scatter(y, ex, scatter_dimension=0, tiled=True) if ex else y

    rows, stacked = P(batch), P(ex, None, tp)
    run = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, stacked, stacked, P(ex, tp, None)),
                        out_specs=rows)
    n, pad = x_NxD.shape[0], -x_NxD.shape[0] % math.prod(size(a) for a in batch)
    if pad:  # (a batch the mesh does not divide: padding tokens with no expert, id E)
        x_NxD, weights_NxK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_NxD, weights_NxK))
        ids_NxK = jnp.pad(ids_NxK, ((0, pad), (0, 0)), constant_values=e)
    return run(x_NxD, weights_NxK, ids_NxK, gate_ExDxI, up_ExDxI, down_ExIxD)[:n]


def meshed() -> object:
    """The mesh a sharded forward is traced under (`attention.on_mesh`), or None: none set, one
    device, or inside a `shard_map` already (the sampler's rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 or mesh.manual_axes else mesh


def dispatch(cfg: ModelConfig, platform: str = "") -> str:
    if cfg.moe_dispatch != "auto":
        return cfg.moe_dispatch
    if (platform or jax.default_backend()) == "cpu":
        return "dense" if cfg.num_experts <= DENSE_UP_TO_CPU else "blocked"
    return "dense" if cfg.num_experts <= DENSE_UP_TO else "grouped"


class MoE(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, routing_BxTxK=None):
        """-> (output, router logits [B T, E] float32). `routing_BxTxK`: the experts the sampler
        used: replayed with `moe_routing=replay` (R3), else only compared with the router's own
        top k (`routing_differs`); None: the router's."""
        c = self.cfg
        d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        x = x_BxTxD.reshape(-1, d)
        # whole on every device of an expert group: each token's top k is taken over all E
        router = self.param("router", _part(("embed", None)), (d, e), c.param_dtype)
        rd = jnp.dtype(c.router_dtype)  # float32 unless a sampler is perturbed on purpose (`for_sampling`)
        logits = jnp.dot(x.astype(rd), router.astype(rd)).astype(jnp.float32)
        weights, ids = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
        if routing_BxTxK is not None:
            given = routing_BxTxK.reshape(-1, c.num_experts_per_tok).astype(jnp.int32)
            differs = jnp.any(jnp.sort(given, -1) != jnp.sort(ids, -1), -1)
            self.sow("intermediates", "routing_differs", differs.astype(jnp.float32))
            if c.moe_routing == "replay":
                weights, ids = replay(logits, given, c.norm_topk_prob)
        self.sow("intermediates", "routing", ids)
        gate = self.param("gate", _part(("expert", "embed", "mlp")), (e, d, f), c.param_dtype)
        up = self.param("up", _part(("expert", "embed", "mlp")), (e, d, f), c.param_dtype)
        down = self.param("down", _part(("expert", "mlp", "embed")), (e, f, d), c.param_dtype)
        experts = {"dense": dense_experts, "grouped": grouped_experts, "blocked": blocked_experts}[dispatch(c)]
        mesh = meshed()
        if mesh is None:
            y = experts(x.astype(c.dtype), gate, up, down, weights, ids, c.dtype)
        else:
            y = on_devices(experts, mesh, x.astype(c.dtype), gate, up, down, weights, ids, c.dtype)
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            shared = _swiglu(x.astype(c.dtype), self.param("shared_gate", _part(("embed", "mlp")), (d, s), c.param_dtype),
                             self.param("shared_up", _part(("embed", "mlp")), (d, s), c.param_dtype),
                             self.param("shared_down", _part(("mlp", "embed")), (s, d), c.param_dtype), c.dtype)
            scale = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), self.param(
                "shared_scale", _part(("embed", None)), (d, 1), c.param_dtype).astype(jnp.float32)))
            y = y + shared * scale.astype(c.dtype)
        return y.reshape(x_BxTxD.shape).astype(x_BxTxD.dtype), logits


def load_balancing_loss(router_logits, k: int, mask_N=None):
    """The auxiliary load-balancing loss over the layers' router logits (each [N, E], the same N
    tokens): E * sum_e f_e P_e, with f_e the fraction of (token, choice) slots routed to expert e
    (over each of the k choices) and P_e the mean router probability of e, averaged over the
    tokens `mask_N` keeps (Switch Transformer, arXiv:2101.03961, eq. 4; transformers'
    `load_balancing_loss_func`, which concatenates the layers' tokens)."""
    logits = jnp.concatenate([jnp.asarray(x, jnp.float32) for x in router_logits], 0)
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, -1)
    _, ids = jax.lax.top_k(probs, k)
    chosen = jax.nn.one_hot(ids, e)  # [N*layers, k, E]
    if mask_N is None:
        keep = jnp.ones(logits.shape[0])
    else:
        keep = jnp.tile(jnp.asarray(mask_N, jnp.float32), len(router_logits))
    frac = jnp.sum(chosen * keep[:, None, None], 0) / jnp.sum(keep)  # [k, E]
    prob = jnp.sum(probs * keep[:, None], 0) / jnp.sum(keep)  # [E]
    return jnp.sum(frac * prob[None]) * e
