"""M2PO with the objective settings of AReaL's example examples/math/gsm8k_m2po.yaml
(inclusionAI/AReaL): `m2_threshold: 0.04`, the behaviour-weight cap of 5 (`behav_imp_weight_cap:
5.0` in that file; `rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0}`
in AReaL's current options): a kept token whose pi_prox/pi_behav exceeds 5 is masked and stays
in the denominator (icepop on [0, 5], which `configs/m2po.py` leaves out: there such a token
trains at full weight), tokens the second-moment mask removes leave the denominator
(`loss_agg_rejected=drop`, AReaL's code), no KL, one minibatch per step, group reward
normalisation with AReaL's eps 1e-5 and at most 2 versions of staleness
(`max_head_offpolicyness: 2`). The loss stays unclipped (`m2po.clip=False`), as in configs/m2po.py.
Differences that remain: AReaL also normalises advantages over the batch (`adv_norm`), which has
no option here, and scales rewards by 10 after a -0.5 bias, which group normalisation cancels up
to its eps.

    python -m jaxrl_llm.main --config=configs/m2po_areal.py --workdir=runs/m2po_areal
"""

from configs import m2po


def get_config(arg: str = ""):
    c = m2po.get_config("2")
    c.objective.is_correction.update(dict(kind="icepop", low=0.0, high=5.0))
    c.objective.loss_agg, c.objective.loss_agg_rejected = "token_mean", "drop"
    c.objective.kl.coef = 0.0
    c.learner.num_minibatches = 1
    c.runtime.advantage, c.runtime.advantage_eps = "grpo", 1e-5
    return c
