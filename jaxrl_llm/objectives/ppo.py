"""Token-level clipped objectives: coupled PPO/GRPO, decoupled PPO and A-3PO.

Equation numbers are those of Li et al., "A-3PO: Accelerating Asynchronous LLM Training with
Staleness-aware Proximal Policy Approximation", arXiv:2512.06547. Decoupled PPO is Hilton et al.,
"Batch size-invariance for policy optimization", arXiv:2110.00641."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.common import sg
from jaxrl_llm.objectives.registry import register


def _bounds(cfg):
    return 1.0 - cfg.clip.eps_low, 1.0 + cfg.clip.eps_high


@register("ppo")
def ppo(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """Coupled clipped surrogate (PPO / GRPO), A-3PO paper Eq. 1:

        L = -E_t min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  r = pi_theta / pi_behav,

    with clip-higher (eps_low != eps_high) and optional dual clip c. The behaviour policy is
    both the importance-sampling proposal and the trust-region anchor.
    """
    behav = sg(batch.behav_logp)  # data, never differentiated
    ratio = common.safe_exp(policy.logp - behav, cfg.log_ratio_clamp)
    lo, hi = _bounds(cfg)
    tok_loss, clipped = common.clipped_surrogate(ratio, batch.advantages, lo, hi, cfg.clip.dual_clip)
    return common.finish(
        tok_loss, policy, batch, cfg,
        ratio_BxL=ratio, is_weight_BxL=ratio, clipped_BxL=clipped, anchor_logp_BxL=behav,
    )


def decoupled_loss(policy: PolicyOutput, batch: TrajectoryBatch, cfg, prox_logp_BxL, extra=None):
    """A-3PO paper Eq. 2 (decoupled PPO, Hilton et al.):

        L = -E_t F(pi_prox / pi_behav) * min(r A, clip(r, 1-eps_low, 1+eps_high) A),
        r = pi_theta / pi_prox.

    The importance weight corrects for sampling from pi_behav (stop-gradient: it is a
    constant reweighting of the data); the trust region is centred on pi_prox.
    """
    behav = sg(batch.behav_logp)
    prox = sg(prox_logp_BxL)  # the anchor is a constant of the update
    ic = cfg.is_correction
    raw = common.safe_exp(prox - behav, cfg.log_ratio_clamp)
    weight = common.is_correction(raw, ic.kind, ic.cap, ic.low, ic.high)
    ratio = common.safe_exp(policy.logp - prox, cfg.log_ratio_clamp)
    lo, hi = _bounds(cfg)
    surr, clipped = common.clipped_surrogate(ratio, batch.advantages, lo, hi, cfg.clip.dual_clip)
    mask = None  # icepop's rejected tokens count as zeros, or leave the denominator (verl)
    if cfg.loss_agg_rejected == "drop":
        mask = batch.loss_mask * common.icepop_kept(raw, ic.kind, ic.low, ic.high)
    return common.finish(
        weight * surr, policy, batch, cfg, mask_BxL=mask,
        ratio_BxL=ratio, is_weight_BxL=weight, clipped_BxL=clipped, anchor_logp_BxL=prox,
        extra=extra,
    )


@register("decoupled_ppo", needs=("prox_logp",))
def decoupled_ppo(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """Decoupled PPO with pi_prox from the learner's recompute pass (`batch.prox_logp`),
    A-3PO paper Eq. 2; behaviour weight optionally truncated (tis) or masked (icepop)."""
    if batch.prox_logp is None:
        raise ValueError(
            "decoupled_ppo needs TrajectoryBatch.prox_logp (the learner's proximal recompute "
            "pass fills it); use objective 'a3po' to approximate pi_prox without that pass"
        )
    return decoupled_loss(policy, batch, cfg, batch.prox_logp)


def a3po_prox_logp(policy: PolicyOutput, batch: TrajectoryBatch):
    """A-3PO (Li et al., arXiv:2512.06547) Eq. 3-5: log pi_prox = alpha log pi_behav +
    (1 - alpha) sg(log pi_theta), d = v(pi_theta) - v(pi_behav) per token, with

        alpha = 1/d for d >= 1,   alpha = 1 (pi_prox = pi_behav) for d = 0.

    Eq. 5 read literally sets alpha = 0 at d = 0, i.e. pi_prox = sg(pi_theta): the ratio is then
    1 and nothing is clipped, so on the second and later minibatches of a step on fresh data the
    trust region vanishes. The paper's prose for Eq. 5 (pi_prox is the policy one version behind
    the learner, which for fresh tokens is the behaviour policy itself) and AReaL's reference
    "loglinear" approximation (alpha_AReaL = (v_prox - v_behav)/(v_theta - v_behav) when
    v_theta > v_behav, else pi_prox = pi_behav; its 1 - alpha_AReaL is our alpha = 1/d) agree
    on pi_prox = pi_behav there, which makes A-3PO exactly PPO on fresh data. This is what is
    built; tests check the d = 0 case where the two readings differ.

    Returns (prox_logp, alpha). Prompt/pad tokens (version -1, d = 0) get alpha = 1; they are
    off the loss mask. sg: pi_prox is an anchor, not a path for gradients.
    """
    d = common.staleness(policy, batch).astype(jnp.float32)
    alpha = 1.0 / jnp.maximum(d, 1.0)
    prox = alpha * sg(batch.behav_logp) + (1.0 - alpha) * sg(policy.logp)
    return prox, alpha


def time_a3po_prox(policy: PolicyOutput, batch: TrajectoryBatch, repeats: int = 50) -> list[float]:
    """Seconds of each of `repeats` calls of `a3po_prox_logp` jitted alone (dispatch included;
    the compiling call is not counted): what A-3PO pays for pi_prox, to set against the
    recompute pass of decoupled PPO (experiments/bench_learner.py, `jaxrl_llm.research.reproduce`)."""
    import time

    import jax

    fn = jax.jit(lambda p, b: a3po_prox_logp(p, b)[0])
    jax.block_until_ready(fn(policy, batch))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(policy, batch))
        times.append(time.perf_counter() - t)
    return times


# Staleness buckets of the proximal-approximation diagnostics: d = 0, 1, 2, 3-4, 5-8, 9+.
PROX_BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, None))


def bucket_name(lo, hi) -> str:
    return f"d{lo}" if lo == hi else f"d{lo}+" if hi is None else f"d{lo}-{hi}"


def prox_diagnostics(approx_BxL, true_BxL, policy: PolicyOutput, batch: TrajectoryBatch, clamp: float):
    """How far A-3PO's interpolated pi_prox is from the recomputed one (the policy at the step's
    start), over loss tokens: |log error| mean and max, relative |log error| / |log pi_prox|,
    and the errors this causes in the behaviour importance weight pi_prox / pi_behav and in the
    trust-region ratio pi_theta / pi_prox; |log error| mean and token count per staleness bucket."""
    mask = batch.loss_mask
    err = jnp.abs(approx_BxL - true_BxL)
    behav, logp = sg(batch.behav_logp), sg(policy.logp)
    iw = lambda prox: common.safe_exp(prox - behav, clamp)  # noqa: E731
    ratio = lambda prox: common.safe_exp(logp - prox, clamp)  # noqa: E731
    m = {"a3po_prox/abs_err": common.masked_mean(err, mask),
         "a3po_prox/abs_err/max": jnp.max(err * mask),
         "a3po_prox/rel_err": common.masked_mean(err / jnp.maximum(jnp.abs(true_BxL), 1e-6), mask),
         "a3po_prox/is_weight_err": common.masked_mean(jnp.abs(iw(approx_BxL) - iw(true_BxL)), mask),
         "a3po_prox/ratio_err": common.masked_mean(jnp.abs(ratio(approx_BxL) - ratio(true_BxL)), mask)}
    d = common.staleness(policy, batch)
    for lo, hi in PROX_BUCKETS:
        inside = mask * ((d >= lo) & ((d <= hi) if hi is not None else True))
        m[f"a3po_prox/abs_err/{bucket_name(lo, hi)}"] = common.masked_mean(err, inside)
        m[f"a3po_prox/tokens/{bucket_name(lo, hi)}"] = inside.sum()
    return m


@register("a3po", passes=lambda cfg: ("prox_logp",) if cfg.a3po.prox_metrics else ())
def a3po(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """A-3PO: Eq. 2 with the interpolated proximal policy of Eq. 3-5 (no extra forward).

    With that pi_prox the trust-region ratio is r = w^alpha (Eq. 7) with w = pi_theta/pi_behav,
    and pi_prox lies between pi_behav and pi_theta (sandwich property, Eq. 6). With
    `a3po.prox_metrics` the learner also recomputes pi_prox (`batch.prox_logp`, diagnostics
    only: the loss still uses the interpolation).
    """
    prox, alpha = a3po_prox_logp(policy, batch)
    extra = {"a3po/alpha_mean": common.masked_mean(alpha, batch.loss_mask)}
    if cfg.a3po.prox_metrics and batch.prox_logp is not None:
        extra.update(prox_diagnostics(prox, sg(batch.prox_logp), policy, batch, cfg.log_ratio_clamp))
    return decoupled_loss(policy, batch, cfg, prox, extra=extra)
