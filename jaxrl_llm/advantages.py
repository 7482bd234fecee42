"""Group-relative advantage estimators over prompt groups (`group_ids`).

All take sequence rewards f32[B] and group ids i32[B] and return f32[B]; `to_tokens`
broadcasts them onto the response tokens. Jittable; group ids may be any integers.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from jaxrl_llm import groups

_ESTIMATORS: dict[str, Callable] = {}


def _estimator(name):
    def deco(fn):
        _ESTIMATORS[name] = fn
        return fn

    return deco


@_estimator("grpo")
def grpo(rewards_B, group_ids_B, eps: float = 1e-6, ddof: int = 1, singleton: str = "zero"):
    """A_i = (r_i - mean_g r) / (std_g r + eps) (Shao et al. 2024; unbiased std by default,
    as torch.std in TRL/verl/AReaL). A group of one has no baseline: singleton="zero" gives it 0
    (no signal); "reward" gives r_i / (1 + eps), verl's mean 0 and std 1 for such groups."""
    member = groups.membership(group_ids_B)
    centred = rewards_B - groups.mean(rewards_B, member)
    std = jnp.sqrt(groups.var(rewards_B, member, ddof=ddof))
    alone = 0.0 if singleton == "zero" else rewards_B / (1.0 + eps)
    return jnp.where(groups.count(member) > 1, centred / (std + eps), alone)


@_estimator("dr_grpo")
def dr_grpo(rewards_B, group_ids_B, **_):
    """A_i = r_i - mean_g r (Dr. GRPO, Liu et al. 2025: no std normalisation)."""
    member = groups.membership(group_ids_B)
    return rewards_B - groups.mean(rewards_B, member)


@_estimator("rloo")
def rloo(rewards_B, group_ids_B, **_):
    """Leave-one-out baseline: A_i = r_i - mean_{j in g, j != i} r_j = G/(G-1) (r_i - mean_g).
    Singleton groups get 0."""
    member = groups.membership(group_ids_B)
    n = groups.count(member)
    loo = (member @ rewards_B - rewards_B) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n > 1, rewards_B - loo, 0.0)


def nonzero_variance(rewards_B, group_ids_B, tol: float = 1e-6):
    """f32[B]: 1 where the sequence's group has reward spread > tol (DAPO; Revisiting GRPO, arXiv:2505.22257, Eq. 7)."""
    return (groups.spread(rewards_B, groups.membership(group_ids_B)) > tol).astype(jnp.float32)


def to_tokens(adv_B, loss_mask_BxL):
    """Broadcast sequence advantages onto the response tokens (0 on prompt / pad)."""
    return adv_B[:, None] * loss_mask_BxL


def names() -> tuple[str, ...]:
    return tuple(_ESTIMATORS)


def compute(name: str, rewards_B, group_ids_B, loss_mask_BxL, *, mask_zero_variance=False, **kw):
    """Per-token advantages f32[B, L] from estimator `name`.

    mask_zero_variance zeroes groups whose rewards are all equal (their advantages are ~0
    anyway; this removes the eps-sized noise and documents the intent)."""
    if name not in _ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(_ESTIMATORS)}")
    adv_B = _ESTIMATORS[name](rewards_B, group_ids_B, **kw)
    if mask_zero_variance:
        adv_B = adv_B * nonzero_variance(rewards_B, group_ids_B)
    return to_tokens(adv_B, loss_mask_BxL)
