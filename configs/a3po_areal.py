"""A-3PO with the objective settings of AReaL's A-3PO example,
examples/experimental/prox_approx/gsm8k_grpo_prox_approx.yaml (inclusionAI/AReaL): decoupled
PPO with the log-linear proximal policy (`prox_logp_method: loglinear`), `eps_clip: 0.4` on both
sides, `behav_imp_weight_cap: 5.0` (AReaL's current options: `rejection_sampling: {level: token,
action: mask, metric: ratio, upper: 5.0}`; tokens whose pi_prox/pi_behav exceeds 5 are masked and stay
in the token-mean denominator: icepop on [0, 5] with loss_agg_rejected=count), no KL
(`kl_ctl: 0`), one minibatch per step (`ppo_n_minibatches: 1`), group reward normalisation with
AReaL's eps 1e-5 (`reward_norm`, NormConfig's default eps) and at most 2 versions of staleness
(`max_head_offpolicyness: 2`). Differences that remain: AReaL also normalises advantages over
the batch (`adv_norm`), which has no option here, and scales rewards by 10 after a -0.5 bias,
which group normalisation cancels up to its eps.

    python -m jaxrl_llm.main --config=configs/a3po_areal.py --workdir=runs/a3po_areal
"""

from configs import default


def get_config(arg: str = ""):
    c = default.get_config("a3po")
    c.objective.clip.update(dict(eps_low=0.4, eps_high=0.4))
    c.objective.is_correction.update(dict(kind="icepop", low=0.0, high=5.0))
    c.objective.loss_agg, c.objective.loss_agg_rejected = "token_mean", "count"
    c.objective.kl.coef = 0.0
    c.learner.num_minibatches = 1
    c.runtime.advantage, c.runtime.advantage_eps = "grpo", 1e-5
    c.runtime.max_staleness = 2
    return c
