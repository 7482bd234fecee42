"""M2PO: second-moment trust region for very stale data (Zheng et al., "Prosperity before
Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161).

Instead of clipping each token's ratio, M2PO bounds the second moment of the log importance
weights over the whole batch: with m2_t = (log pi_prox - log pi_behav)^2 on every loss token
of the step, the tokens with the largest m2 are masked, largest first, until the mean m2 of the
tokens left is below tau_M2 (at least one token is always kept). The surrogate then trains on
the kept tokens only.

Paper and code: AReaL's docs write M2 with log pi_theta / pi_behav and an unclipped importance-
weighted objective, M_t * pi_theta/pi_behav * A_t; AReaL's code (`_apply_m2po_masking` in
areal/trainer/ppo/actor.py) masks with log pi_prox - log pi_behav, pi_prox being the recompute
pass, i.e. the policy when the step starts, and then runs decoupled PPO whose example config
(examples/math/gsm8k_m2po.yaml) sets eps_clip = 0 with one minibatch, so the gradient is the
unclipped pi_theta/pi_behav weight. The two agree where pi_theta = pi_prox: the step's first
update, the only one with one minibatch. Built here: the mask from pi_prox, fixed for the step
(it is a selection of data, made before the step, as the paper's Algorithm does), and the
unclipped importance-weighted surrogate F(pi_prox/pi_behav) * pi_theta/pi_prox * A
(`m2po.clip=True`: PPO's clipped surrogate on pi_theta/pi_prox instead, as AReaL's code with a
nonzero eps_clip). Tests check the case where the readings differ (a later minibatch).
`m2po.scope="minibatch"` computes the mask per loss call instead, over each minibatch's tokens,
as AReaL's code does.
Masked tokens count as zeros in the aggregation, as the docs' 1/sum|o_i| writes it
(`loss_agg_rejected="drop"` removes them from the denominator, as AReaL's code does).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.common import sg
from jaxrl_llm.objectives.registry import register


def second_moment_mask(behav_BxL, prox_BxL, mask_BxL, tau: float):
    """f32[B, L]: 1 on the loss tokens M2PO keeps, 0 elsewhere.

    Sort m2 = (log pi_prox - log pi_behav)^2 of the n loss tokens in descending order; drop the
    first k, k the smallest count whose remaining mean is < tau (k <= n - 1: never all). The
    mean of a descending suffix only falls as it shortens, so k = #{i < n: mean(m2[i:]) >= tau}.
    Static shapes: non-loss tokens sort last and count for nothing.
    """
    on = mask_BxL.reshape(-1) > 0
    m2 = jnp.square(prox_BxL - behav_BxL).reshape(-1).astype(jnp.float32)
    n = on.sum()
    order = jnp.argsort(jnp.where(on, -m2, jnp.inf))  # loss tokens first, largest m2 first
    ranked = jnp.where(on, m2, 0.0)[order]
    suffix_sum = jnp.cumsum(ranked[::-1])[::-1]  # sum of ranked[i:], exact 0 past the loss tokens
    i = jnp.arange(ranked.shape[0])
    suffix_mean = suffix_sum / jnp.maximum(n - i, 1)
    k = jnp.minimum(((suffix_mean >= tau) & (i < n)).sum(), jnp.maximum(n - 1, 0))
    rank = jnp.zeros_like(i).at[order].set(i)  # each token's place in the order
    return (on & (rank >= k)).astype(jnp.float32).reshape(mask_BxL.shape)


def _prepare(batch: TrajectoryBatch, cfg):
    """The step's mask, over every loss token of the step's batch (all minibatches, all processes)."""
    return second_moment_mask(sg(batch.behav_logp), sg(batch.prox_logp), batch.loss_mask, cfg.m2po.tau)


@register("m2po", needs=("prox_logp",), prepare=_prepare, prepare_when=lambda cfg: cfg.m2po.scope == "step")
def m2po(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """M2PO (arXiv:2510.01161; AReaL's `m2_threshold`): on the tokens the second-moment mask keeps,

        L = -(1 / sum_t m_t) sum_t M_t F(pi_prox / pi_behav) (pi_theta / pi_prox) A_t,

    m the loss mask (M with `loss_agg_rejected="drop"`), F the shared `is_correction`;
    `m2po.clip` swaps the ratio term for PPO's clipped surrogate.
    The learner computes the mask over the whole step (`batch.token_keep`); with
    `m2po.scope="minibatch"`, or called on a batch alone, over the batch it is called on."""
    if batch.prox_logp is None:
        raise ValueError("m2po needs TrajectoryBatch.prox_logp (the learner's proximal recompute pass fills it)")
    keep = batch.token_keep if batch.token_keep is not None else _prepare(batch, cfg)
    loss_mask = batch.loss_mask.astype(jnp.float32)
    kept = loss_mask * keep
    behav, prox = sg(batch.behav_logp), sg(batch.prox_logp)
    ic = cfg.is_correction
    weight = common.is_correction(common.safe_exp(prox - behav, cfg.log_ratio_clamp), ic.kind, ic.cap, ic.low, ic.high)
    ratio = common.safe_exp(policy.logp - prox, cfg.log_ratio_clamp)
    if cfg.m2po.clip:
        surr, clipped = common.clipped_surrogate(ratio, batch.advantages, 1.0 - cfg.clip.eps_low,
                                                 1.0 + cfg.clip.eps_high, cfg.clip.dual_clip)
    else:
        surr, clipped = -batch.advantages * ratio, jnp.zeros(ratio.shape, bool)
    m2 = jnp.square(prox - behav)
    extra = {"m2po/masked_frac": 1.0 - common.masked_mean(keep, loss_mask),
             "m2po/m2_kept": common.masked_mean(m2, kept), "m2po/m2_all": common.masked_mean(m2, loss_mask)}
    drop = cfg.loss_agg_rejected == "drop"
    return common.finish(weight * surr * keep, policy, batch, cfg, mask_BxL=kept if drop else loss_mask,
                         ratio_BxL=ratio, is_weight_BxL=weight, clipped_BxL=clipped, anchor_logp_BxL=prox,
                         kl_weight=keep, extra=extra)
