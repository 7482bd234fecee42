"""Sequence-level importance weighting: GSPO (Zheng et al., "Group Sequence Policy Optimization",
arXiv:2507.18071) and GEPO (Zhang et al., "Group Expectation Policy Optimization for Stable
Heterogeneous Reinforcement Learning in LLMs", arXiv:2508.17850)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm import groups
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.common import sg
from jaxrl_llm.objectives.registry import register


def seq_mean(x_BxL, mask_BxL):
    """Masked mean over each sequence's loss tokens -> [B] (0 for empty sequences)."""
    return (x_BxL * mask_BxL).sum(-1) / jnp.maximum(mask_BxL.sum(-1), 1.0)


@register("gspo")
def gspo(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """GSPO (Zheng et al. 2025): length-normalised sequence ratio with sequence clipping,

        s_i = exp( (1/|y_i|) sum_t log(pi_theta / pi_behav) ),
        L = -E_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    (GEPO Listing 1 "gspo" branch). variant="token" is GSPO-token: s_{i,t} = sg(s_i) *
    pi_theta(y_t) / sg(pi_theta(y_t)) with per-token advantages; same value, per-token gradient.
    Clip range from cfg.gspo (the paper uses 3e-4 / 4e-4). E_i is the paper's mean over the
    group's sequences, (1/G) sum_i (its Eq. 5; for GSPO-token (1/G) sum_i (1/|y_i|) sum_t):
    `gspo.loss_agg` = seq_mean_token_mean. token_mean weights each sequence by its length, as
    AReaL does; verl follows its own global aggregation.
    """
    mask = batch.loss_mask
    behav = sg(batch.behav_logp)
    log_s_B = seq_mean(policy.logp - behav, mask)
    lo, hi = 1.0 - cfg.gspo.eps_low, 1.0 + cfg.gspo.eps_high
    if cfg.gspo.variant == "seq":
        s_B = common.safe_exp(log_s_B, cfg.log_ratio_clamp)
        adv_B = seq_mean(batch.advantages, mask)
        loss_B, clipped_B = common.clipped_surrogate(s_B, adv_B, lo, hi, cfg.clip.dual_clip)
        tok_loss, clipped = _tokens(loss_B, mask), _tokens(clipped_B, mask) > 0
        ratio = _tokens(s_B, mask)
    else:
        # sg(log s_i) + log pi_t - sg(log pi_t): value log s_i, gradient d log pi_t.
        log_s = sg(log_s_B)[:, None] + policy.logp - sg(policy.logp)
        ratio = common.safe_exp(log_s, cfg.log_ratio_clamp)
        tok_loss, clipped = common.clipped_surrogate(ratio, batch.advantages, lo, hi, cfg.clip.dual_clip)
    return common.finish(
        tok_loss, policy, batch, cfg, loss_agg=cfg.gspo.loss_agg,
        ratio_BxL=ratio, is_weight_BxL=ratio, clipped_BxL=clipped, anchor_logp_BxL=behav,
    )


def _tokens(x_B, mask_BxL):
    return jnp.broadcast_to(x_B[:, None], mask_BxL.shape).astype(jnp.float32)


def group_expectation_logq(log_q_B, group_ids_B, valid_B):
    """GEPO Eq. 11 in log space: log( sum_g q^2 / sum_g q ) for each sequence's group g.

    Valid sequences only (those with loss tokens); log space keeps tiny geometric-mean
    probabilities from underflowing when squared.
    """
    member = groups.membership(group_ids_B, valid_B)
    return groups.logsumexp(2.0 * log_q_B, member) - groups.logsumexp(log_q_B, member)


@register("gepo")
def gepo(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """GEPO (HeteroRL) Eq. 9-12, 15 and Listing 1:

        p_i, q_i = geometric means of pi_theta, pi_behav over y_i          (Eq. 9)
        E_q[q]   = sum_g q^2 / sum_g q  within the prompt group g          (Eq. 11)
        w_i      = p_i / (eps sg(p_i) + (1 - eps) E_q[q])                   (Eq. 12, 15)
        L        = -E_i min(w_i A_i, clip(w_i, 1 - eps_low, 1 + eps_high) A_i)

    eps = gepo.eps (const) or clip(eps_var_coef * Var_g(q), 0, eps_max) ("var", Eq. 15's
    eps proportional to Var(q)). eps = 1 gives the plain policy-gradient direction.
    """
    mask = batch.loss_mask
    valid_B = mask.sum(-1) > 0
    log_p_B = seq_mean(policy.logp, mask)
    log_q_B = sg(seq_mean(batch.behav_logp, mask))  # sampler data
    log_eq_B = group_expectation_logq(log_q_B, batch.group_ids, valid_B)
    if cfg.gepo.eps_mode == "const":
        eps_B = jnp.full_like(log_p_B, cfg.gepo.eps)
    else:
        member = groups.membership(batch.group_ids, valid_B)
        var_B = groups.var(jnp.exp(log_q_B), member)
        eps_B = jnp.clip(cfg.gepo.eps_var_coef * var_B, 0.0, cfg.gepo.eps_max)
    eps_B = sg(eps_B)
    # log(eps sg(p) + (1-eps) E); sg(p): the defensive term only rescales (Eq. 15 detach()).
    log_den_B = jnp.logaddexp(jnp.log(eps_B) + sg(log_p_B), jnp.log1p(-eps_B) + log_eq_B)
    w_B = common.safe_exp(log_p_B - log_den_B, cfg.log_ratio_clamp)
    adv_B = seq_mean(batch.advantages, mask)
    loss_B, clipped_B = common.clipped_surrogate(
        w_B, adv_B, 1.0 - cfg.clip.eps_low, 1.0 + cfg.clip.eps_high, cfg.clip.dual_clip
    )
    n_valid = jnp.maximum(valid_B.sum(), 1)
    extra = {
        "gepo/eps": jnp.where(valid_B, eps_B, 0.0).sum() / n_valid,
        "gepo/expected_q": jnp.where(valid_B, jnp.exp(log_eq_B), 0.0).sum() / n_valid,
    }
    w = _tokens(w_B, mask)
    return common.finish(
        _tokens(loss_B, mask), policy, batch, cfg,
        ratio_BxL=w, is_weight_BxL=w, clipped_BxL=_tokens(clipped_B, mask) > 0,
        anchor_logp_BxL=sg(batch.behav_logp), extra=extra,
    )
