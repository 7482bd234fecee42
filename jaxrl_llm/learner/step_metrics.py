"""Metrics of one learner step: finiteness of an update, per-minibatch values reduced to one
number, and the learner/sampler mismatch on fresh tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives.common import masked_mean


def finite(tree) -> jax.Array:
    """Whether every leaf of `tree` is finite (a skipped update otherwise)."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def of_update(objective, cfg, policy: PolicyOutput, batch: TrajectoryBatch) -> dict:
    """One update's metrics: the objective's own, the behaviour KL (sampled and, with top-k
    stats, over pi_behav's top-k) and the mismatch on fresh tokens. The learner calls it after
    its update loop on the stats each update's loss saw (no reductions inside the loop)."""
    _, metrics = objective(policy, batch, cfg)
    mask, lp = batch.loss_mask, policy.logp
    metrics["kl_behav/sampled"] = masked_mean(batch.behav_logp - lp, mask)  # E_behav[log b - log theta]
    metrics.update(mismatch(lp, batch, policy.version, cfg.clip.eps_low, cfg.clip.eps_high))
    if policy.logp_at_behav_topk is not None:
        pb = jnp.exp(batch.topk_logp)
        # Truncated supports put -inf at some ids: 0 log 0 = 0 where pi_behav has none, and a
        # behaviour token outside pi_theta's kept set is floored at log-prob -30 (finite metric).
        gap = batch.topk_logp - jnp.maximum(policy.logp_at_behav_topk, -30.0)
        metrics["kl_behav/topk"] = masked_mean(jnp.where(pb > 0, pb * gap, 0.0).sum(-1), mask)
    return metrics


def routing(differs_BxL, batch: TrajectoryBatch, layers: int) -> dict:
    """Over trained tokens: the fraction of (token, sparse layer) pairs whose learner top k
    differs from the experts the sampler used, and of tokens with any such layer (R3's mismatch)."""
    mask = batch.loss_mask
    return {"moe/routing_differs_pairs": masked_mean(differs_BxL / layers, mask),
            "moe/routing_differs_tokens": masked_mean((differs_BxL > 0).astype(jnp.float32), mask)}


def reduce_minibatches(ms: dict) -> dict:
    """Per-minibatch metrics [M] -> one number each (max/min keep their meaning). `mismatch/`
    is the first minibatch's: only there are the params the ones the step started from."""
    out = {}
    for k, v in ms.items():
        if k.startswith("mismatch/"):
            out[k] = v[0]
        else:
            out[k] = v.max() if k.endswith("/max") else v.min() if k.endswith("/min") else v.mean()
    return out


def mismatch(logp_BxL, batch: TrajectoryBatch, version, eps_low: float, eps_high: float):
    """Learner/sampler mismatch on fresh tokens (d = 0: drawn from the params being trained):
    |log pi_theta - log pi_behav| mean and max, the k3 estimate of KL(behav || theta)
    (r - 1 - log r, r = pi_theta / pi_behav; Schulman's k3) and the fraction of ratios outside
    the clip band [1 - eps_low, 1 + eps_high]. 0 in exact arithmetic with `policy_dist` sampled."""
    fresh = batch.loss_mask * (batch.versions == version)
    log_r = logp_BxL - batch.behav_logp
    r = jnp.exp(log_r)
    outside = ((r < 1.0 - eps_low) | (r > 1.0 + eps_high)).astype(jnp.float32)
    return {"mismatch/abs_logp_mean": masked_mean(jnp.abs(log_r), fresh),
            "mismatch/abs_logp_max": jnp.max(jnp.abs(log_r) * fresh),
            "mismatch/k3_kl": masked_mean(r - 1.0 - log_r, fresh),
            "mismatch/out_of_clip_frac": masked_mean(outside, fresh),
            "mismatch/fresh_tokens": fresh.sum()}
