"""Jackpot: optimal budgeted rejection sampling (OBRS) for actor-policy mismatch.

Chen et al., "Jackpot: Optimal Budgeted Rejection Sampling for Extreme Actor-Policy Mismatch
Reinforcement Learning", arXiv:2602.06107. The jointly trained rollout actor (Eq. 6-7) is the
auxiliary model in `jackpot_actor.py`.

Names follow the paper: p_inf = the rollout (actor) distribution the tokens were sampled
from (`batch.behav_logp`, top-K in `batch.topk_*`); p_new = the policy being trained
(`policy.logp`); p_ref = the policy's PPO anchor, i.e. the trained model at the rollout's
version (`batch.prox_logp`, or sg(p_new) with jackpot.p_ref="current" when each batch gets
a single update); p_target in {new, ref} is what OBRS aligns p_inf to.

Randomness: the Bernoulli acceptance mask is drawn as `uniform(policy.rng, [B, L]) < a`.
The key rides on `PolicyOutput.rng` because acceptance depends on p_new, which changes on
every update, so each update (including reuse of a batch) draws a fresh mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.common import sg
from jaxrl_llm.objectives.jackpot_actor import ACTOR
from jaxrl_llm.objectives.registry import register


def obrs_log_accept(log_target, log_inf, lam: float):
    """Eq. 3: log a = log min(1, p_target / (lam p_inf))."""
    return jnp.minimum(0.0, log_target - jnp.log(lam) - log_inf)


def obrs_acceptance(p_V, q_V, lam):
    """Expected acceptance sum_v q_v min(1, p_v / (lam q_v)) = sum_v min(q_v, p_v / lam) = Z."""
    return jnp.minimum(q_V, p_V / lam).sum(-1)


def obrs_lambda_for_acceptance(p_V, q_V, target, iters: int = 200):
    """Theorem 3.4: the unique lam with expected acceptance == target (bisection in log lam).

    Acceptance is continuous and non-increasing in lam, 1 for lam <= min p/q and 1/lam for
    lam >= max p/q, so the root lies in [min p/q, max(max p/q, 1/target)].
    """
    ratio = p_V / q_V
    lo = jnp.log(jnp.min(ratio, -1))
    hi = jnp.log(jnp.maximum(jnp.max(ratio, -1), 1.0 / target))

    def body(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        too_few = obrs_acceptance(p_V, q_V, jnp.exp(mid)[..., None]) < target
        return jnp.where(too_few, lo, mid), jnp.where(too_few, mid, hi)

    lo, hi = jax.lax.fori_loop(0, iters, body, (lo, hi))
    return jnp.exp(0.5 * (lo + hi))


def z_approx(log_inf_topk, log_tgt_at_inf_topk, lam, union=None):
    """§4.4.1: Z_approx = sum_{x in V_k} min(p_inf(x), p_target(x) / lam).

    The behaviour top-K part is always available. `union = (inf_topk_ids, tgt_topk_ids,
    log_tgt_topk, log_inf_at_tgt_topk)` adds pi_theta's top-K' ids not already counted,
    where p_inf there is known (the learner ran the rollout model). Left out otherwise: the
    sum only shrinks (Z_approx <= Z either way) and kappa recalibrates it.
    """
    log_lam = jnp.log(lam)
    z = jnp.exp(jnp.minimum(log_inf_topk, log_tgt_at_inf_topk - log_lam)).sum(-1)
    if union is not None:
        inf_ids, tgt_ids, log_tgt, log_inf_at_tgt = union
        dup = (tgt_ids[..., :, None] == inf_ids[..., None, :]).any(-1)
        extra = jnp.exp(jnp.minimum(log_inf_at_tgt, log_tgt - log_lam))
        z = z + jnp.where(dup, 0.0, extra).sum(-1)
    return z


def _require(value, what):
    if value is None:
        raise ValueError(f"jackpot needs {what}")
    return value


def _passes(cfg) -> frozenset:
    """p_ref = sg(pi_theta) needs no recompute pass; p_target = ref reads p_ref on the
    behaviour top-K (for Z_approx)."""
    needs = {"logp_at_behav_topk", "topk", "rng"}
    if cfg.jackpot.p_ref == "prox":
        needs.add("prox_logp")
        if cfg.jackpot.p_target == "ref":
            needs.add("prox_topk_logp")
    return frozenset(needs)


@register("jackpot", needs=("prox_logp", "logp_at_behav_topk", "topk", "rng"), passes=_passes, aux=ACTOR)
def jackpot(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """PPO-OBRS (Eq. 3-5, Algorithm 1):

        a      = min(1, p_target / (lam p_inf)),  Mask ~ Bernoulli(a)
        Z_t    = kappa Z_approx,  kappa = accept_rate / mean(Z_approx)   (§4.4.2)
        w_OBRS = Z_t max(lam, p_target / p_inf)       (= p_target / P_OBRS)
        rho    = min(w_OBRS, c1) min(p_ref / p_target, c2)
        L      = -E Mask sg(rho) min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  r = p_new / p_ref

    With p_target = new this is Algorithm 1 verbatim. Rejected tokens are zeros that still
    count in the mean (Eq. 5 is an expectation over x ~ p_inf).

    `jackpot.correction` selects the paper's baselines on the same tokens (Fig. 1, §5): "tis"
    keeps every token with rho = min(p_ref / p_inf, c1) (truncated importance sampling); "none"
    keeps every token with rho = 1, i.e. PPO on the actor's tokens as if the policy had
    sampled them (the "without any alignment" run, with distill_coef = 0).
    """
    jc = cfg.jackpot
    if batch.topk == 0:
        raise ValueError("jackpot needs behaviour top-k log-probs (K > 0) for Z_approx")
    rng = _require(policy.rng, "PolicyOutput.rng (key for the Bernoulli acceptance mask)")
    log_inf = sg(batch.behav_logp)
    log_new = sg(policy.logp)
    if jc.p_ref == "prox":
        log_ref = sg(_require(batch.prox_logp, "TrajectoryBatch.prox_logp (p_ref); or set jackpot.p_ref='current'"))
    else:
        log_ref = log_new
    union = None
    if jc.p_target == "new":
        log_tgt = log_new
        log_tgt_topk = sg(_require(policy.logp_at_behav_topk, "PolicyOutput.logp_at_behav_topk"))
        if policy.topk_ids is not None and policy.behav_logp_at_topk is not None:
            union = (batch.topk_ids, policy.topk_ids, sg(policy.topk_logp), sg(policy.behav_logp_at_topk))
    else:
        log_tgt = log_ref
        if jc.p_ref == "prox":
            log_tgt_topk = sg(_require(batch.prox_topk_logp, "TrajectoryBatch.prox_topk_logp for p_target='ref'"))
        else:
            log_tgt_topk = sg(_require(policy.logp_at_behav_topk, "PolicyOutput.logp_at_behav_topk"))

    mask = batch.loss_mask.astype(jnp.float32)
    clamp = cfg.log_ratio_clamp
    ratio = common.safe_exp(policy.logp - log_ref, clamp)
    surr, clipped = common.clipped_surrogate(
        ratio, batch.advantages, 1.0 - cfg.clip.eps_low, 1.0 + cfg.clip.eps_high, cfg.clip.dual_clip
    )
    if jc.correction != "obrs":
        rho = (jnp.ones_like(mask) if jc.correction == "none"
               else jnp.minimum(common.safe_exp(log_ref - log_inf, clamp), jc.c1))
        return common.finish(rho * surr, policy, batch, cfg, ratio_BxL=ratio, is_weight_BxL=rho, clipped_BxL=clipped,
                             anchor_logp_BxL=log_ref, extra={})
    log_a = obrs_log_accept(log_tgt, log_inf, jc.lam)
    u = jax.random.uniform(rng, log_a.shape)
    accepted = (u < jnp.exp(log_a)).astype(jnp.float32)
    z = z_approx(sg(batch.topk_logp), log_tgt_topk, jc.lam, union)
    accept_rate = common.masked_mean(accepted, mask)
    z_mean = common.masked_mean(z, mask)
    kappa = accept_rate / jnp.maximum(z_mean, 1e-30)
    log_w = jnp.log(jnp.maximum(kappa * z, 1e-30)) + jnp.maximum(jnp.log(jc.lam), log_tgt - log_inf)
    w_obrs = common.safe_exp(log_w, clamp)
    rho = jnp.minimum(w_obrs, jc.c1) * jnp.minimum(common.safe_exp(log_ref - log_tgt, clamp), jc.c2)
    rho = sg(rho)  # a data weight (Algorithm 1 line 26)
    extra = {
        "jackpot/accept_rate": accept_rate,
        "jackpot/kappa": kappa,
        "jackpot/z_approx_mean": z_mean,
        "jackpot/w_obrs_max": jnp.where(mask > 0, w_obrs, 0.0).max(),
    }
    return common.finish(
        accepted * rho * surr, policy, batch, cfg,
        ratio_BxL=ratio, is_weight_BxL=rho, clipped_BxL=clipped & (accepted > 0),
        anchor_logp_BxL=log_ref, extra=extra,
    )
