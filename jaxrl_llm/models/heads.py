"""Float32 log-prob heads under the sampling distribution, chunked over the sequence.

A token's log-prob is taken under the distribution the sampler drew it from (temperature, then
top-k / top-p truncation: `policy_dist`), so pi_theta / pi_behav is 1 on unchanged params.
Logits exist one chunk at a time ([B, C, V]); under `jax.grad` each chunk is rematerialised
rather than stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models import decoder, moe, policy_dist
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist


def logprob_stats(hidden_BxLxD, unembed_DxV, targets_BxL, *, dist: PolicyDist = PolicyDist(), kept_BxL=None,
                  topk: int = 0, gather_ids_BxLxK=None, entropy: bool = True, chunk: int = 128):
    """Per position t, with logits = hidden[:, t] @ W / T (float32), truncated as `dist` says
    (`policy_dist.restrict` to the kept_BxL[:, t] most likely tokens plus the target; without
    kept_BxL, to the support the sampler's own rule gives):

      logp        log softmax(logits)[targets[:, t]]              f32[B, L]
      entropy     -sum p log p                                    f32[B, L]   (if entropy)
      topk_ids    / topk_logp: lax.top_k of the log-softmax       [B, L, topk] (if topk)
      logp_at_ids log softmax(logits) at gather_ids               f32[B, L, K] (if given;
                  -inf outside the truncated support)
    """
    xs = {"h": hidden_BxLxD, "t": targets_BxL}
    if gather_ids_BxLxK is not None:
        xs["g"] = gather_ids_BxLxK
    if dist.truncated and kept_BxL is not None:
        xs["n"] = kept_BxL
    w = unembed_DxV.astype(jnp.float32)

    def one(x):
        logits = dist.scale(jnp.einsum("bcd,dv->bcv", x["h"].astype(jnp.float32), w))
        if dist.truncated:
            b, c, v = logits.shape
            flat = logits.reshape(b * c, v)
            n = x["n"].reshape(-1) if "n" in x else policy_dist.kept_count(policy_dist.truncate(flat, dist))
            logits = policy_dist.restrict(flat, n, x["t"].reshape(-1), dist).reshape(b, c, v)
        logp_all = jax.nn.log_softmax(logits, -1)
        out = {"logp": jnp.take_along_axis(logp_all, x["t"][..., None], -1)[..., 0]}
        if entropy:  # 0 log 0 = 0 outside a truncated support
            out["entropy"] = -(jnp.exp(logp_all) * jnp.where(jnp.isfinite(logp_all), logp_all, 0.0)).sum(-1)
        if topk:
            out["topk_logp"], out["topk_ids"] = jax.lax.top_k(logp_all, topk)
        if "g" in x:
            out["logp_at_ids"] = jnp.take_along_axis(logp_all, x["g"], -1)
        return out

    return map_chunks(one, xs, chunk)


def map_chunks(fn, xs, chunk: int):
    """Apply `fn` (rematerialised) to sequence chunks of the [B, L, ...] arrays in `xs` and
    stitch its [B, C, ...] outputs back to [B, L, ...]: logits exist one chunk at a time."""
    b, length = jax.tree_util.tree_leaves(xs)[0].shape[:2]
    c = max(1, min(chunk, length))
    n = -(-length // c)

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, n * c - length)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)

    def merge(y):
        return jnp.moveaxis(y, 0, 1).reshape(b, n * c, *y.shape[3:])[:, :length]

    ys = jax.lax.map(jax.checkpoint(fn), jax.tree_util.tree_map(split, xs))
    return jax.tree_util.tree_map(merge, ys)


def sequence_logprobs(params, cfg: ModelConfig, tokens_BxL, input_mask_BxL=None, *, dist: PolicyDist = PolicyDist(),
                      kept_BxL=None, topk: int = 0, gather_ids_BxLxK=None, entropy: bool = True, chunk: int = 128,
                      return_hidden: bool = False, segments=None, routing_BxLxMxK=None, balance: bool = False):
    """Teacher-forced stats aligned with `tokens` (the batch contract): index t describes token
    t given tokens[:, :t]; column 0 has no context and is 0 (it is always a prompt position).
    `kept_BxL` (aligned the same way: `TrajectoryBatch.behav_kept`) sizes the truncated support.
    `return_hidden` adds the final hidden states [B, L, D] (for callers reusing the forward).
    `segments = (segment_BxL, position_BxL)`: the rows are packed (`packing.py`); the stat at a
    sequence's first token then comes from the previous segment and must be masked (it is
    always a prompt token). `routing_BxLxMxK`: the sampler's experts (a mixture of experts):
    replayed under `moe_routing=replay`, and `routing_differs` counts the sparse layers whose own
    top k differs from them at each position. `balance`: also `moe_aux_loss`, the load-balancing
    loss (`moe.load_balancing_loss`) over the real tokens, one number."""
    balance = balance and cfg.num_experts > 0
    kw = dict(routing=routing_BxLxMxK, router_logits=balance)
    if segments is not None:
        out = decoder.forward_packed(params, cfg, tokens_BxL, *segments, **kw)
        real_BxL = segments[0] > 0
    else:
        if input_mask_BxL is None:
            input_mask_BxL = jnp.ones(tokens_BxL.shape, jnp.int32)
        out = decoder.forward(params, cfg, tokens_BxL, input_mask_BxL, **kw)
        real_BxL = input_mask_BxL > 0
    hidden, extras = out if routing_BxLxMxK is not None or balance else (out, {})
    gather = None if gather_ids_BxLxK is None else gather_ids_BxLxK[:, 1:]
    kept = None if kept_BxL is None else kept_BxL[:, 1:]
    stats = logprob_stats(hidden[:, :-1], decoder.unembed_matrix(params, cfg), tokens_BxL[:, 1:], dist=dist,
                          kept_BxL=kept, topk=topk, gather_ids_BxLxK=gather, entropy=entropy, chunk=chunk)
    stats = jax.tree_util.tree_map(lambda y: jnp.pad(y, [(0, 0), (1, 0)] + [(0, 0)] * (y.ndim - 2)), stats)
    if return_hidden:
        stats["hidden"] = hidden
    if "routing_differs" in extras:
        stats["routing_differs"] = extras["routing_differs"]
    if balance:
        stats["moe_aux_loss"] = moe.load_balancing_loss(extras["router_logits"], cfg.num_experts_per_tok,
                                                        real_BxL.reshape(-1))
    return stats


def full_logits(params, cfg: ModelConfig, tokens_BxL, input_mask_BxL=None):
    """[B, L, V] float32 logits. For tests and small inputs only (materialises the vocab)."""
    if input_mask_BxL is None:
        input_mask_BxL = jnp.ones(tokens_BxL.shape, jnp.int32)
    hidden = decoder.forward(params, cfg, tokens_BxL, input_mask_BxL)
    return hidden.astype(jnp.float32) @ decoder.unembed_matrix(params, cfg).astype(jnp.float32)
