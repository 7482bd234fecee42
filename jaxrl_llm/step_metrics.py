"""Metrics of one learner step: finiteness of an update, per-minibatch values reduced to one
number, and the learner/sampler mismatch on fresh tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.objectives.common import masked_mean


def finite(tree) -> jax.Array:
    """Whether every leaf of `tree` is finite (a skipped update otherwise)."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


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
