"""CISPO (MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
arXiv:2506.13585, Sec. 3.1): clip the importance-sampling weight, not the update.

PPO's clip zeroes the gradient of every token whose ratio left the trust region; under stale
data those are often the rare, informative tokens (the paper's "fork" tokens). CISPO keeps
every token's gradient and bounds its weight instead:

    J = (1 / sum_i |o_i|) sum_i sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_theta(o_t),
    r_t = pi_theta(o_t) / pi_behav(o_t)

(token-level aggregation, the shared `loss_agg`). The paper imposes no lower bound (a large
eps_low; here eps_low = 1, i.e. r >= 0 always) and tunes eps_high only.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.common import sg
from jaxrl_llm.objectives.registry import register


@register("cispo")
def cispo(policy: PolicyOutput, batch: TrajectoryBatch, cfg):
    """Per-token loss -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta: the gradient is the
    importance-weighted policy gradient with the weight capped, on every token (none is zeroed).
    Without a cap in effect it equals REINFORCE with importance weights, grad -(r A)."""
    behav = sg(batch.behav_logp)
    ratio = common.safe_exp(sg(policy.logp) - behav, cfg.log_ratio_clamp)
    weight = jnp.clip(ratio, 1.0 - cfg.cispo.eps_low, 1.0 + cfg.cispo.eps_high)
    tok_loss = -sg(weight) * batch.advantages * policy.logp
    return common.finish(tok_loss, policy, batch, cfg, ratio_BxL=ratio, is_weight_BxL=weight,
                         clipped_BxL=weight != ratio, anchor_logp_BxL=behav)
