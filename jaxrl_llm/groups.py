"""Per-group reductions over sequences (GRPO groups), jittable for arbitrary `group_ids`.

A dense [B, B] same-group mask keeps this free of `num_segments` and id ranges: B is the
number of sequences in a (mini)batch, so B^2 stays small next to the model's work.
Every reduction broadcasts the group's value back onto its members.
"""

from __future__ import annotations

import jax.numpy as jnp


def membership(group_ids_B, valid_B=None):
    """f32[B, B]: 1 where sequences i and j share a group and j is valid."""
    same = (group_ids_B[:, None] == group_ids_B[None, :]).astype(jnp.float32)
    if valid_B is not None:
        same = same * valid_B.astype(jnp.float32)[None, :]
    return same


def count(member_BxB):
    return member_BxB.sum(-1)


def mean(x_B, member_BxB):
    return (member_BxB @ x_B) / jnp.maximum(count(member_BxB), 1.0)


def var(x_B, member_BxB, ddof: int = 0):
    n = count(member_BxB)
    dev = x_B[None, :] - mean(x_B, member_BxB)[:, None]
    ss = (member_BxB * jnp.square(dev)).sum(-1)
    return ss / jnp.maximum(n - ddof, 1.0)


def logsumexp(logx_B, member_BxB):
    """log sum_{j in group(i)} exp(logx_j), stable; -inf for an empty group."""
    masked = jnp.where(member_BxB > 0, logx_B[None, :], -jnp.inf)
    top = jnp.max(masked, axis=-1)
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.exp(masked - safe_top[:, None]), axis=-1)
    return jnp.log(total) + safe_top


def spread(x_B, member_BxB):
    """max - min of x within each group (0 for singleton groups)."""
    hi = jnp.where(member_BxB > 0, x_B[None, :], -jnp.inf).max(-1)
    lo = jnp.where(member_BxB > 0, x_B[None, :], jnp.inf).min(-1)
    return jnp.where(jnp.isfinite(hi - lo), hi - lo, 0.0)
