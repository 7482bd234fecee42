"""Off-policy GRPO (Mroueh et al., "Revisiting Group Relative Policy Optimization: Insights into
On-Policy and Off-Policy Training", arXiv:2505.22257, §3.2)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.advantages import nonzero_variance
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.common import sg
from jaxrl_llm.objectives.registry import register


def _passes(cfg) -> frozenset:
    """r' = pi_k / alpha reads pi_k from the learner's recompute pass; r' ~ 1 needs nothing."""
    return frozenset({"prox_logp"} if cfg.offpolicy_grpo.r_prime == "prox" else ())


@register("offpolicy_grpo", passes=_passes)
def offpolicy_grpo(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """§3.2 clipped off-policy surrogate, as a loss:

        f_eps(r, r', A) = min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A),
        r = pi_theta / alpha,  r' = pi_k / alpha,

    alpha = the sampling policy (batch.behav_logp), pi_k = the policy at the start of this
    step (batch.prox_logp, r_prime="prox") or r' ~ 1 (r_prime="one", what the paper uses in
    practice; then f_eps is PPO's clip around 1). With zero_var_mask, prompt groups whose
    rewards have zero variance are masked out of both surrogate and KL (Eq. 7); they still
    count in the mean, as 1{sigma != 0} * (L - beta KL) does in the expectation.
    """
    alpha = sg(batch.behav_logp)
    r = common.safe_exp(policy.logp - alpha, cfg.log_ratio_clamp)
    if cfg.offpolicy_grpo.r_prime == "prox":
        if batch.prox_logp is None:
            raise ValueError(
                "offpolicy_grpo with r_prime='prox' needs TrajectoryBatch.prox_logp (pi_k); "
                "set offpolicy_grpo.r_prime='one' for the r' ~ 1 approximation"
            )
        r_prime = common.safe_exp(sg(batch.prox_logp) - alpha, cfg.log_ratio_clamp)
    else:
        r_prime = jnp.ones_like(r)
    lo = jnp.maximum(r_prime - cfg.clip.eps_low, 0.0)
    hi = r_prime + cfg.clip.eps_high
    tok_loss, clipped = common.clipped_surrogate(r, batch.advantages, lo, hi, cfg.clip.dual_clip)
    keep_B = jnp.ones_like(batch.rewards, dtype=jnp.float32)
    if cfg.offpolicy_grpo.zero_var_mask:
        keep_B = nonzero_variance(batch.rewards, batch.group_ids)
    keep = keep_B[:, None]
    mask = batch.loss_mask
    return common.finish(
        tok_loss * keep, policy, batch, cfg,
        ratio_BxL=r, is_weight_BxL=r, clipped_BxL=clipped & (keep > 0), anchor_logp_BxL=alpha,
        kl_weight=keep, extra={"offpolicy_grpo/kept_frac": common.masked_mean(jnp.broadcast_to(keep, mask.shape), mask),
                               "offpolicy_grpo/r_prime_mean": common.masked_mean(r_prime, mask)},
    )
