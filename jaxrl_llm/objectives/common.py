"""Pieces every surrogate objective shares: aggregation, KL penalty, IS correction F,
clipped surrogate, safe exponentials and the standard metrics.

Sign convention: objectives return a *loss* to minimise (the negated surrogate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import staleness as staleness_lib
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch

sg = jax.lax.stop_gradient

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                "token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_CORRECTIONS = ("none", "tis", "icepop")


def check_choice(what: str, value: str, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")


def safe_exp(log_x, clamp: float):
    """exp of a log-ratio clamped to [-clamp, clamp]: stale tokens never overflow."""
    return jnp.exp(jnp.clip(log_x, -clamp, clamp))


def _safe_div(num, den):
    return num / jnp.maximum(den, 1.0)


def masked_mean(x, mask):
    """Mean of x over mask > 0 positions (0 when the mask is empty)."""
    return _safe_div((x * mask).sum(), mask.sum())


def aggregate(loss_BxL, mask_BxL, mode: str, norm_len: int = 0):
    """Reduce per-token losses to a scalar.

    token_mean              sum(l*m) / sum(m)                   (DAPO token-level)
    seq_mean_token_mean     mean_b [ sum_t(l*m) / sum_t(m) ]     (GRPO paper)
    seq_mean_token_sum      mean_b [ sum_t(l*m) ]
    seq_mean_token_sum_norm sum(l*m) / (B * norm_len)           (Dr. GRPO; norm_len=0 -> L)
    token_sum_norm          sum(l*m) / norm_len                 (verl's "seq-mean-token-sum-norm")
    Sequence means run over sequences with at least one loss token. The Dr. GRPO paper's
    constant is per sequence and per token (1/G of the group mean times 1/MAX_TOKENS); verl's
    mode of that name divides the minibatch's sum by L alone, B times the value.
    """
    check_choice("loss aggregation", mode, AGGREGATIONS)
    masked = loss_BxL * mask_BxL
    if mode == "token_mean":
        return masked_mean(loss_BxL, mask_BxL)
    if mode in ("seq_mean_token_sum_norm", "token_sum_norm"):
        n = norm_len or loss_BxL.shape[1]
        return masked.sum() / (n * (loss_BxL.shape[0] if mode == "seq_mean_token_sum_norm" else 1))
    tokens_B = mask_BxL.sum(-1)
    seq_B = masked.sum(-1)
    if mode == "seq_mean_token_mean":
        seq_B = _safe_div(seq_B, tokens_B)
    has_tokens_B = (tokens_B > 0).astype(loss_BxL.dtype)
    return _safe_div((seq_B * has_tokens_B).sum(), has_tokens_B.sum())


def kl_penalty(logp_BxL, ref_logp_BxL, estimator: str, clamp: float):
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    With log r = log pi_ref - log pi_theta:
      k1 = -log r,  k2 = (log r)^2 / 2,  k3 = r - 1 - log r  (Schulman's unbiased, >= 0).
    """
    check_choice("kl estimator", estimator, KL_ESTIMATORS)
    log_r = jnp.clip(ref_logp_BxL - logp_BxL, -clamp, clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    return jnp.exp(log_r) - 1.0 - log_r


def icepop_kept(weight, kind: str, low: float, high: float):
    """1 where the behaviour weight F keeps the token (icepop's [low, high]), else 0; all 1 for
    the other kinds (they reweight, not reject)."""
    if kind != "icepop":
        return jnp.ones_like(weight)
    return ((weight >= low) & (weight <= high)).astype(weight.dtype)


def is_correction(weight, kind: str, cap: float, low: float, high: float):
    """Importance-sampling correction F (Jackpot §2): none (x), tis (min(x, C)),
    icepop (x if low <= x <= high else 0). AReaL's behaviour-weight cap == icepop(0, C)."""
    check_choice("is_correction", kind, IS_CORRECTIONS)
    if kind == "tis":
        return jnp.minimum(weight, cap)
    if kind == "icepop":
        return weight * icepop_kept(weight, kind, low, high)
    return weight


def clipped_surrogate(ratio, adv, lo, hi, dual_clip: float = 0.0):
    """PPO clipped surrogate as a loss: max(-A r, -A clip(r, lo, hi)), optionally dual-clipped
    (Ye et al. 2020: for A < 0 the loss is capped at -A c, c > 1).

    `lo`/`hi` may be arrays (off-policy GRPO clips around r'). Returns (loss, clipped) where
    `clipped` marks tokens whose gradient the clip removed.
    """
    unclipped = -adv * ratio
    clipped_loss = -adv * jnp.clip(ratio, lo, hi)
    loss = jnp.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip > 0.0:
        cap = -adv * dual_clip
        dual = (adv < 0) & (loss > cap)
        loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
        clipped = clipped | dual
    return loss, clipped


def masked_stats(prefix: str, x, mask):
    """{prefix/mean, /max, /min} of x over mask (mask all zero -> 0s)."""
    m = mask > 0
    any_m = m.any()
    return {
        f"{prefix}/mean": masked_mean(jnp.where(m, x, 0.0), mask),
        f"{prefix}/max": jnp.where(any_m, jnp.where(m, x, -jnp.inf).max(), 0.0),
        f"{prefix}/min": jnp.where(any_m, jnp.where(m, x, jnp.inf).min(), 0.0),
    }


def masked_var(x, mask):
    return masked_mean(jnp.square(x - masked_mean(x, mask)), mask)


def staleness(policy: PolicyOutput, batch: TrajectoryBatch):
    """d = v(pi_theta) - v(pi_behav) per token (`jaxrl_llm.staleness`, A-3PO Eq. 4)."""
    return staleness_lib.staleness(jnp.asarray(policy.version, jnp.int32), batch.versions)


def finish(
    tok_loss_BxL,
    policy: PolicyOutput,
    batch: TrajectoryBatch,
    cfg,
    *,
    mask_BxL=None,
    ratio_BxL,
    is_weight_BxL,
    clipped_BxL,
    anchor_logp_BxL,
    kl_weight=1.0,
    extra=None,
    loss_agg=None,
):
    """Add the KL penalty, aggregate, and assemble the stable metric names.

    `mask_BxL` (default batch.loss_mask) is the aggregation mask; `tok_loss_BxL` may already
    carry multiplicative masks (zero-variance groups, Jackpot rejections) so those tokens
    count in the denominator as zeros, as in the expectations of the papers; `kl_weight`
    (scalar or [B, L]) applies such masks to the KL term too (off-policy GRPO Eq. 7).
    `loss_agg` overrides `cfg.loss_agg` (an objective with its own aggregation, e.g. GSPO).
    """
    mask = batch.loss_mask if mask_BxL is None else mask_BxL
    mask = mask.astype(jnp.float32)
    metrics = {}
    if cfg.kl.coef > 0.0:
        if batch.ref_logp is None:
            raise ValueError(
                "kl.coef > 0 needs TrajectoryBatch.ref_logp (reference log-probs); set "
                "kl.coef=0 or let the learner compute ref_logp"
            )
        kl_BxL = kl_penalty(policy.logp, sg(batch.ref_logp), cfg.kl.estimator, cfg.log_ratio_clamp)
        metrics["kl_ref"] = masked_mean(kl_BxL, mask)
        tok_loss_BxL = tok_loss_BxL + cfg.kl.coef * kl_BxL * kl_weight
    loss = aggregate(tok_loss_BxL, mask, loss_agg or cfg.loss_agg, cfg.loss_agg_norm_len)

    log_r = sg(policy.logp) - sg(anchor_logp_BxL)
    clipped = clipped_BxL.astype(jnp.float32) * mask
    metrics.update(
        {
            "loss": loss,
            "clipped_tokens": clipped.sum(),
            "clip_frac": masked_mean(clipped, mask),
            # k3 estimate of KL(anchor || theta) on tokens drawn from the anchor side.
            "approx_kl": masked_mean(jnp.expm1(log_r) - log_r, mask),
            "is_weight/var": masked_var(sg(is_weight_BxL), mask),
        }
    )
    metrics.update(masked_stats("is_weight", sg(is_weight_BxL), mask))
    metrics.update(masked_stats("ratio", sg(ratio_BxL), mask))
    if policy.entropy is not None:
        metrics["entropy"] = masked_mean(sg(policy.entropy), mask)
    d = staleness(policy, batch).astype(jnp.float32)
    metrics["staleness/mean"] = masked_mean(d, mask)
    metrics["staleness/max"] = jnp.where(mask > 0, d, 0.0).max()
    for k, v in (extra or {}).items():
        metrics[k] = v
    return loss, metrics
