"""Mixture-of-experts MLP layers of Qwen3-MoE and Qwen2-MoE (transformers' `*SparseMoeBlock`):
a softmax router over `num_experts`, the top `num_experts_per_tok` experts of each token
(their probabilities renormalised to sum to 1 with `norm_topk_prob`), SwiGLU experts held as
stacked weights [E, ...], and for Qwen2-MoE a shared expert scaled by a sigmoid gate.

Dispatch (`ModelConfig.moe_dispatch`; the three dispatches live in `experts.py`): dense, or the
dropless grouped / blocked ones. `auto` picks grouped above `DENSE_UP_TO` experts on GPU and TPU
(their grouped GEMMs), and on CPU blocked above `DENSE_UP_TO_CPU`, where XLA's ragged_dot ran at
half dense's speed (experiments/results/bench_moe_cpu.md has all three against PyTorch eager).
No capacity factor: no token is ever dropped, so the sampler and the learner compute the same
function of the same routing. On the learner's mesh the dispatch runs per device under
`shard_map` (`experts.on_devices`), with the experts split over the `expert` axis (expert
parallelism; `ModelConfig.moe_exchange` says how tokens reach their experts' devices, `exchange.py`);
a sampler on several devices splits them over the devices of its rows
(`experts.among_devices`, `SamplerConfig.expert_parallel`). LoRA's `gate` / `up` / `down`
targets adapt the stacked experts (`lora.expert_side`).

The router runs in float32 whatever the compute dtype (its logits pick experts: a bf16 rounding
flips near-ties). A layer returns its router logits beside its output: the decoder keeps them for
the load-balancing loss (`load_balancing_loss`, the Switch Transformer loss as transformers
computes it) when `ModelConfig.moe_aux_loss_coef` asks for it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm import validation as V
from jaxrl_llm.models import experts as X, lora
from jaxrl_llm.models.config import DISPATCH, DTYPES, EXCHANGES, ModelConfig

DENSE_UP_TO = 8  # moe_dispatch=auto on GPU / TPU: dense-masked dispatch up to this many experts
DENSE_UP_TO_CPU = 4  # on CPU: the blocked loop's overhead outweighs E / k for fewer experts
_init = nn.initializers.normal(stddev=0.02)

# model.moe: how a mixture of experts runs. A checkpoint's config.json sets its layers; `experts` > 0
# makes a random Qwen3-MoE-style model of the model section's sizes instead (no hf_path), each
# expert `intermediate_size` wide (0: model.intermediate_size), the top `top_k` renormalised.
# sampler_router_dtype: the samplers' router matmul (research: perturbed sampler numerics).
# exchange: how expert parallelism moves tokens to their experts' devices (`exchange.py`): gather | all_to_all.
# aux_loss_coef: the learner adds coef x `load_balancing_loss` to every objective's loss (0: off;
# -1: the checkpoint's router_aux_loss_coef, which transformers applies only with output_router_logits).
SECTION = V.Section(routing=("recompute", V.one_of("recompute", "replay")), dispatch=("auto", V.one_of(*DISPATCH)),
                    exchange=("gather", V.one_of(*EXCHANGES)),
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
        # the experts held here: E, or E / devices in a sampler that splits them (`among_devices`)
        held = nn.meta.unbox(self.get_variable("params", "gate")).shape[0] if self.has_variable("params", "gate") else e
        gate = self.param("gate", _part(("expert", "embed", "mlp")), (held, d, f), c.param_dtype)
        up = self.param("up", _part(("expert", "embed", "mlp")), (held, d, f), c.param_dtype)
        down = self.param("down", _part(("expert", "mlp", "embed")), (held, f, d), c.param_dtype)
        gate, up, down = lora.expert_side(self, gate, up, down)
        experts = {"dense": X.dense_experts, "grouped": X.grouped_experts, "blocked": X.blocked_experts}[dispatch(c)]
        mesh = meshed()
        if mesh is not None:
            y = X.on_devices(experts, mesh, x.astype(c.dtype), gate, up, down, weights, ids, c.dtype, c.moe_exchange)
        elif held < e:  # a sampler's rows, its experts split over their devices
            y = X.among_devices(experts, x.astype(c.dtype), gate, up, down, weights, ids, c.dtype, c.moe_exchange)
        else:
            y = experts(x.astype(c.dtype), gate, up, down, weights, ids, c.dtype)
        if c.shared_expert_intermediate_size:
            y = y + self.shared_expert(x)
        return y.reshape(x_BxTxD.shape).astype(x_BxTxD.dtype), logits

    def shared_expert(self, x_NxD):
        """Qwen2-MoE's shared expert, scaled by its sigmoid gate."""
        c = self.cfg
        d, s, xs = c.hidden_size, c.shared_expert_intermediate_size, x_NxD.astype(c.dtype)

        def proj(t, x, shape, axes):
            return jnp.dot(x, self.param(f"shared_{t}", _part(axes), shape, c.param_dtype).astype(c.dtype))

        h = nn.silu(proj("gate", xs, (d, s), ("embed", "mlp"))) * proj("up", xs, (d, s), ("embed", "mlp"))
        shared = proj("down", h, (s, d), ("mlp", "embed"))
        scale = jax.nn.sigmoid(jnp.dot(x_NxD.astype(jnp.float32), self.param(
            "shared_scale", _part(("embed", None)), (d, 1), c.param_dtype).astype(jnp.float32)))
        return shared * scale.astype(c.dtype)


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
