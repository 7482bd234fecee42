"""One staleness for the whole project: the queue, the objectives, the metrics and the report.

A token's staleness is the number of policy versions between the params that sampled it and
the params being trained on it (A-3PO, arXiv:2512.06547, Eq. 4):

    d = v(learner) - v(token),

where v(learner) is the learner's version *during* the step that trains the token (the number
of completed steps) and v(token) the version of the params whose logits the token was drawn
from. Prompt and pad positions carry version -1 and have d = 0; a token claiming to be newer
than the learner has d = 0 too. A batch is as stale as its oldest token.

`runtime.max_staleness` = k bounds d in every mode (-1: unbounded) and `staleness_policy` says
what happens to a batch beyond it: "drop" discards it (counted in `runtime/dropped`), "keep"
trains on it (counted in `runtime/over_stale`), "admit" (async with continuous batching,
`runtime/admission.py`) holds prompts back so that their tokens are trained within the bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("drop", "keep", "admit")


def staleness(learner_version, token_versions):
    """d per token (see the module docstring). Python ints, NumPy or JAX arrays (jit-safe)."""
    xp = jnp if isinstance(learner_version, jax.Array) or isinstance(token_versions, jax.Array) else np
    d = xp.asarray(learner_version) - xp.asarray(token_versions)
    return xp.where(xp.asarray(token_versions) < 0, 0, xp.maximum(d, 0))


def exceeds(d, max_staleness: int) -> bool:
    """Whether staleness `d` is beyond the bound `max_staleness` (-1 or None: unbounded)."""
    return max_staleness is not None and max_staleness >= 0 and d > max_staleness


def of_batch(learner_version: int, versions_BxL, loss_mask_BxL) -> np.ndarray:
    """Host-side d of every loss token of a batch (for histograms and the bound)."""
    d = staleness(int(learner_version), np.asarray(versions_BxL))
    return d[np.asarray(loss_mask_BxL) > 0]


def oldest_version(versions_BxL, loss_mask_BxL) -> int:
    """The version of a batch's oldest loss token (its staleness bound is checked on this);
    -1 for a batch without loss tokens."""
    v = np.asarray(versions_BxL)[np.asarray(loss_mask_BxL) > 0]
    return int(v.min()) if v.size else -1


def by_turn(learner_version: int, versions_BxL, loss_mask_BxL, turns: int) -> np.ndarray:
    """[2, turns]: the sum of d and the token count of each model turn of multi-turn rows (a turn
    is a run of loss tokens; observations between turns carry none), turns past the last bin
    counted in it. Sums, so processes can add theirs before the mean."""
    keep = np.asarray(loss_mask_BxL) > 0
    starts = keep & ~np.pad(keep, ((0, 0), (1, 0)))[:, :-1]
    turn = np.minimum(np.cumsum(starts, 1) - 1, turns - 1)[keep]
    d = staleness(int(learner_version), np.asarray(versions_BxL))[keep]
    return np.stack([np.bincount(turn, d, minlength=turns), np.bincount(turn, minlength=turns)]).astype(np.float64)
