"""The two data contracts every objective reads: `TrajectoryBatch` and `PolicyOutput`.

Alignment: index ``t`` of every per-token array describes token
``tokens[:, t]`` given ``tokens[:, :t]``. Prompt and pad positions have ``loss_mask == 0``
and ``versions == -1``.

Shapes use B = sequences, L = sequence length, K = top-k width (static, K = 0 allowed).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array

# Field -> (shape template, dtype kind). Templates name the dims; "f" float, "i" int, "b" bool.
_BATCH_SPEC = {
    "tokens": (("B", "L"), "i"),
    "loss_mask": (("B", "L"), "f"),
    "behav_logp": (("B", "L"), "f"),
    "versions": (("B", "L"), "i"),
    "topk_ids": (("B", "L", "K"), "i"),
    "topk_logp": (("B", "L", "K"), "f"),
    "rewards": (("B",), "f"),
    "group_ids": (("B",), "i"),
    "advantages": (("B", "L"), "f"),
    "prox_logp": (("B", "L"), "f"),
    "prox_topk_logp": (("B", "L", "K"), "f"),
    "ref_logp": (("B", "L"), "f"),
    "truncated": (("B",), "b"),
    "input_mask": (("B", "L"), "f"),
    "behav_kept": (("B", "L"), "i"),
    "token_keep": (("B", "L"), "f"),
    "routing": (("B", "L", "M", "R"), "i"),
}

_POLICY_SPEC = {
    "logp": (("B", "L"), "f"),
    "version": ((), "i"),
    "entropy": (("B", "L"), "f"),
    "logp_at_behav_topk": (("B", "L", "K"), "f"),
    "topk_ids": (("B", "L", "Kp"), "i"),
    "topk_logp": (("B", "L", "Kp"), "f"),
    "behav_logp_at_topk": (("B", "L", "Kp"), "f"),
}


@struct.dataclass
class TrajectoryBatch:
    """Version-tagged rollouts as the sampler produced them (plus learner-side extras).

    Required:
      tokens      i32[B, L]     prompt + completion + pad.
      loss_mask   f32[B, L]     1 on generated tokens that are trained on, else 0.
      behav_logp  f32[B, L]     log-prob of each token under the distribution actually
                                sampled from (after temperature / truncation): pi_behav.
      versions    i32[B, L]     policy version that produced each token; -1 on prompt/pad.
      topk_ids    i32[B, L, K]  behaviour top-K token ids at each step (K may be 0).
      topk_logp   f32[B, L, K]  their behaviour log-probs.
      rewards     f32[B]        sequence rewards.
      group_ids   i32[B]        prompt group of each sequence (GRPO groups).
      advantages  f32[B, L]     per-token advantages (0 off the loss mask).
    Optional (None when absent):
      prox_logp       f32[B, L]     pi_prox from the learner's recompute pass (decoupled PPO,
                                    off-policy GRPO's pi_k, Jackpot's p_ref).
      prox_topk_logp  f32[B, L, K]  pi_prox at the behaviour top-K ids (Jackpot, p_target=ref).
      ref_logp        f32[B, L]     frozen reference policy, for the KL penalty.
      truncated       bool[B]       completion hit the length limit without EOS.
      input_mask      f32[B, L]     1 on real tokens (prompt + generated), 0 on padding; the
                                    learner rebuilds RoPE positions and attention from it.
                                    None means every position is a real token.
      behav_kept      i32[B, L]     size of the truncated support (top-k / top-p) each token
                                    was drawn from; 0 on prompt/pad. None: no truncation, or
                                    not recorded (the learner then re-applies the rule).
      routing         i16[B, L, M, R]  the experts each position was routed to when sampled, per
                                    sparse layer (a mixture of experts; R = experts per token);
                                    replayed by the learner with `model.moe.routing=replay`.
      token_keep      f32[B, L]     1 on loss tokens an objective's step-level selection keeps,
                                    0 on those it drops, computed once over the step's whole
                                    batch (every minibatch and process; `register(prepare=)`),
                                    e.g. M2PO's second-moment mask. None: nothing selected.
    """

    tokens: Array
    loss_mask: Array
    behav_logp: Array
    versions: Array
    topk_ids: Array
    topk_logp: Array
    rewards: Array
    group_ids: Array
    advantages: Array
    prox_logp: Optional[Array] = None
    prox_topk_logp: Optional[Array] = None
    ref_logp: Optional[Array] = None
    truncated: Optional[Array] = None
    input_mask: Optional[Array] = None
    behav_kept: Optional[Array] = None
    token_keep: Optional[Array] = None
    routing: Optional[Array] = None

    @classmethod
    def concat(cls, batches) -> "TrajectoryBatch":
        """Rows of `batches` stacked (same L and K): e.g. a learner batch assembled from whole
        prompt groups. Group ids are renumbered so that no two batches share one."""
        fields, offset, ids = {}, 0, []
        for b in batches:
            g = np.asarray(b.group_ids)
            ids.append(g - g.min() + offset)
            offset += int(g.max() - g.min()) + 1
        for f in cls.__dataclass_fields__:
            xs = [getattr(b, f) for b in batches]
            xp = np if all(isinstance(x, np.ndarray) for x in xs) else jnp  # host batches stay on the host
            fields[f] = None if xs[0] is None else xp.concatenate(xs, 0)
        fields["group_ids"] = np.concatenate(ids).astype(np.int32)
        return cls(**fields)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    @property
    def topk(self) -> int:
        return int(self.topk_ids.shape[-1])

    def validate(self) -> "TrajectoryBatch":
        """Raise ValueError naming the offending field on a wrong shape or dtype.

        Works on concrete arrays and under `jax.jit` tracing alike (shapes are static).
        """
        if np.ndim(self.tokens) != 2:
            raise ValueError(
                f"TrajectoryBatch.tokens: expected rank 2 [B, L], got shape {np.shape(self.tokens)}"
            )
        b, l = np.shape(self.tokens)
        if np.ndim(self.topk_ids) != 3:
            raise ValueError(
                f"TrajectoryBatch.topk_ids: expected rank 3 [B, L, K], got shape {np.shape(self.topk_ids)}"
            )
        dims = {"B": b, "L": l, "K": np.shape(self.topk_ids)[-1]}
        if self.routing is not None:
            if np.ndim(self.routing) != 4:
                raise ValueError(f"TrajectoryBatch.routing: expected rank 4 [B, L, M, R], got shape "
                                 f"{np.shape(self.routing)}")
            dims.update(M=np.shape(self.routing)[2], R=np.shape(self.routing)[3])
        _check_fields("TrajectoryBatch", self, _BATCH_SPEC, dims)
        return self


@struct.dataclass
class PolicyOutput:
    """What the learner's forward pass hands an objective.

    Gradients flow only through ``logp``; objectives stop-gradient every other field.

      logp                f32[B, L]       log pi_theta of the batch tokens (same temperature
                                          as the sampler).
      version             i32[]           the learner's policy version (completed steps).
      entropy             f32[B, L]       optional, per-token entropy of pi_theta.
      logp_at_behav_topk  f32[B, L, K]    optional, log pi_theta at the batch's behaviour
                                          top-K ids.
      topk_ids/topk_logp  [B, L, K']      optional, pi_theta's own top-K'.
      behav_logp_at_topk  f32[B, L, K']   optional, the rollout distribution at pi_theta's
                                          top-K' ids (available when the learner also runs the
                                          rollout/actor model, as in Jackpot joint training).
      rng                 PRNG key        optional, per-update randomness. Jackpot draws its
                                          Bernoulli acceptance mask from it; the learner folds
                                          a fresh key per minibatch update so reused batches
                                          get fresh masks.
    """

    logp: Array
    version: Array
    entropy: Optional[Array] = None
    logp_at_behav_topk: Optional[Array] = None
    topk_ids: Optional[Array] = None
    topk_logp: Optional[Array] = None
    behav_logp_at_topk: Optional[Array] = None
    rng: Optional[Array] = None

    def validate(self, batch: Optional[TrajectoryBatch] = None) -> "PolicyOutput":
        """Shape/dtype check; with ``batch``, also checks alignment with it."""
        if np.ndim(self.logp) != 2:
            raise ValueError(
                f"PolicyOutput.logp: expected rank 2 [B, L], got shape {np.shape(self.logp)}"
            )
        b, l = np.shape(self.logp)
        dims = {"B": b, "L": l}
        if batch is not None:
            dims["K"] = batch.topk
            if tuple(batch.shape) != (b, l):
                raise ValueError(
                    f"PolicyOutput.logp: shape {(b, l)} does not match TrajectoryBatch.tokens "
                    f"shape {tuple(batch.shape)}"
                )
        elif self.logp_at_behav_topk is not None:
            dims["K"] = np.shape(self.logp_at_behav_topk)[-1]
        if self.topk_ids is not None:
            dims["Kp"] = np.shape(self.topk_ids)[-1]
        elif self.topk_logp is not None:
            dims["Kp"] = np.shape(self.topk_logp)[-1]
        elif self.behav_logp_at_topk is not None:
            dims["Kp"] = np.shape(self.behav_logp_at_topk)[-1]
        _check_fields("PolicyOutput", self, _POLICY_SPEC, dims)
        return self


def _check_fields(owner: str, obj, spec: dict, dims: dict) -> None:
    for name, (template, kind) in spec.items():
        value = getattr(obj, name)
        if value is None:
            continue
        shape = tuple(np.shape(value))
        want = tuple(dims[d] for d in template)
        if shape != want:
            named = "[" + ", ".join(f"{d}={dims[d]}" for d in template) + "]"
            raise ValueError(f"{owner}.{name}: expected shape {named} = {want}, got {shape}")
        dtype = jnp.result_type(value)
        ok = {
            "f": jnp.issubdtype(dtype, jnp.floating),
            "i": jnp.issubdtype(dtype, jnp.integer),
            "b": jnp.issubdtype(dtype, jnp.bool_),
        }[kind]
        if not ok:
            wanted = {"f": "a float dtype", "i": "an integer dtype", "b": "bool"}[kind]
            raise ValueError(f"{owner}.{name}: expected {wanted}, got {dtype}")
