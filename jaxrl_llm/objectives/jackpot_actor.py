"""Jackpot's rollout actor, trained jointly with the policy (Jackpot, arXiv:2602.06107, Eq. 6-8).

The actor is a separate, usually smaller decoder that generates the rollouts (p_inf). Each
update trains it with its own PPO loss (Eq. 6) plus lambda_distill times a distillation KL
towards the policy (Eq. 7), where lambda_distill = `jackpot.distill_coef`. It is registered as
Jackpot's auxiliary model (`ACTOR`): active when the run supplies a model for it, and the
samplers then generate with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.models import decoder, heads
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.auxiliary import AuxContext, AuxInputs, Auxiliary
from jaxrl_llm.objectives.common import sg


def actor_ppo_loss(actor_logp_BxL, batch: TrajectoryBatch, cfg, actor_old_logp_BxL=None):
    """Eq. 6, the rollout (actor) model's own PPO loss, no OBRS:

        L = -E_{x~p_inf} sg(F(p_w,ref / p_inf)) min(r_w A, clip(r_w, 1-eps_low, 1+eps_high) A),
        r_w = p_w / p_w,ref,

    p_w,ref = the actor at the rollout's version (default: p_inf itself, so F = 1); F = TIS
    with cap jackpot.c1. Gradients flow through `actor_logp_BxL` only.
    """
    log_inf = sg(batch.behav_logp)
    old = log_inf if actor_old_logp_BxL is None else sg(actor_old_logp_BxL)
    clamp = cfg.log_ratio_clamp
    weight = jnp.minimum(common.safe_exp(old - log_inf, clamp), cfg.jackpot.c1)
    ratio = common.safe_exp(actor_logp_BxL - old, clamp)
    surr, clipped = common.clipped_surrogate(
        ratio, batch.advantages, 1.0 - cfg.clip.eps_low, 1.0 + cfg.clip.eps_high, cfg.clip.dual_clip
    )
    mask = batch.loss_mask.astype(jnp.float32)
    loss = common.aggregate(weight * surr, mask, cfg.loss_agg, cfg.loss_agg_norm_len)
    return loss, {"actor/loss": loss, "actor/clip_frac": common.masked_mean(clipped, mask)}


def distill_kl_per_token(new_logp_NxV, actor_logp_NxV):
    """KL(sg(p_new) || p_actor) over the vocabulary for each row (Eq. 7's inner term).

    Takes normalised log-probs so callers can chunk [B, L, V] over rows."""
    new = sg(new_logp_NxV)
    return (jnp.exp(new) * (new - actor_logp_NxV)).sum(-1)


def distill_loss(new_logits_BxLxV, actor_logits_BxLxV, mask_BxL, cfg, temperature: float = 1.0):
    """Eq. 7: E_{x~p_inf} KL(sg(p_new(.|s_t)) || p_actor(.|s_t)), aggregated by cfg.loss_agg."""
    new = jax.nn.log_softmax(new_logits_BxLxV.astype(jnp.float32) / temperature, -1)
    actor = jax.nn.log_softmax(actor_logits_BxLxV.astype(jnp.float32) / temperature, -1)
    kl_BxL = distill_kl_per_token(new, actor)
    mask = mask_BxL.astype(jnp.float32)
    loss = common.aggregate(kl_BxL, mask, cfg.loss_agg, cfg.loss_agg_norm_len)
    return loss, {"actor/distill_kl": loss}


def distill_kl(hidden_new_BxLxD, unembed_new_DxV, hidden_actor_BxLxD, unembed_actor_DxV, *,
               temperature: float = 1.0, chunk: int = 128):
    """Per-position KL(sg(p_new) || p_actor) over the full vocabulary (Eq. 7), from hidden
    states, chunked over the sequence like the log-prob heads; gradients reach only the actor."""
    w_new = sg(unembed_new_DxV.astype(jnp.float32))
    w_act = unembed_actor_DxV.astype(jnp.float32)

    def one(x):
        new = jax.nn.log_softmax(jnp.einsum("bcd,dv->bcv", x["new"].astype(jnp.float32), w_new) / temperature, -1)
        act = jax.nn.log_softmax(jnp.einsum("bcd,dv->bcv", x["act"].astype(jnp.float32), w_act) / temperature, -1)
        return distill_kl_per_token(new, act)

    return heads.map_chunks(one, {"new": sg(hidden_new_BxLxD), "act": hidden_actor_BxLxD}, chunk)


def actor_loss(actor_params, inputs: AuxInputs, batch: TrajectoryBatch, cfg, ctx: AuxContext):
    """Eq. 6 + lambda_distill * Eq. 7 for the actor, on the batch the actor generated; the
    policy side of the KL reuses this update's policy hidden states (no second policy pass)."""
    a = ctx.model_cfg
    h_act = decoder.forward(actor_params, a, batch.tokens, batch.input_mask)[:, :-1]
    w_act = decoder.unembed_matrix(actor_params, a)
    kept = None if batch.behav_kept is None else batch.behav_kept[:, 1:]  # the actor sampled the batch
    stats = heads.logprob_stats(h_act, w_act, batch.tokens[:, 1:], dist=ctx.dist, kept_BxL=kept, entropy=False,
                                chunk=ctx.chunk)
    logp = jnp.pad(stats["logp"], [(0, 0), (1, 0)])
    ppo, metrics = actor_ppo_loss(logp, batch, cfg)
    kl = distill_kl(inputs.hidden_BxLxD[:, :-1], decoder.unembed_matrix(inputs.params, ctx.policy_cfg), h_act, w_act,
                    temperature=ctx.dist.temperature, chunk=ctx.chunk)
    distill = common.masked_mean(jnp.pad(kl, [(0, 0), (1, 0)]), batch.loss_mask)
    metrics["actor/distill_kl"] = distill
    return ppo + cfg.jackpot.distill_coef * distill, metrics


ACTOR = Auxiliary(
    name="actor",
    init=lambda key, ctx: decoder.init_params(ctx.model_cfg, key),
    loss=actor_loss,
    logical_axes=lambda ctx: decoder.logical_axes(ctx.model_cfg),
    needs_model=True,
    samples=True,
)
