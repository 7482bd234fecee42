"""Auxiliary models: a second set of parameters an objective trains jointly with the policy.

An objective that needs one (a rollout actor, a value head, a second tiny decoder, ...) passes
an `Auxiliary` to `register(..., aux=...)`. The learner then keeps the model's params and its
own optimizer state in `TrainState.aux`, and at every update calls `aux.loss` after the
policy's loss, handing it the policy's (stop-gradient) final hidden states so that the
auxiliary needs no second policy forward. The learner never learns which objective it serves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional


class AuxContext(NamedTuple):
    """Static facts an auxiliary's hooks may use (hashable, closed over by jit)."""

    policy_cfg: Any  # the policy's ModelConfig
    model_cfg: Any  # the auxiliary's own ModelConfig, when it is a decoder (else None)
    dist: Any  # models.PolicyDist: temperature / truncation the log-probs are taken under
    chunk: int  # sequence chunk for [B, C, V] logits (never the whole [B, L, V])


class AuxInputs(NamedTuple):
    """What the learner hands `Auxiliary.loss` from the policy's side of the update."""

    params: Any  # the policy's params (the loss is differentiated w.r.t. the aux params only)
    hidden_BxLxD: Any  # stop-gradient final hidden states of this update's policy forward


@dataclasses.dataclass(frozen=True)
class Auxiliary:
    """Hooks of an auxiliary model.

    name          prefix of its metrics and of `eval/<name>_reward`
    init          (key, ctx) -> params
    loss          (aux_params, inputs: AuxInputs, batch, cfg, ctx) -> (loss, metrics);
                  `cfg` is the frozen objective config
    logical_axes  ctx -> logical axis names per param (sharded like a decoder), or None to
                  replicate every leaf
    needs_model   active only when the run supplies a model config for it (e.g. a separate
                  rollout decoder); otherwise always active
    samples       the samplers generate with this model's params instead of the policy's
    """

    name: str
    init: Callable
    loss: Callable
    logical_axes: Optional[Callable] = None
    needs_model: bool = False
    samples: bool = False
