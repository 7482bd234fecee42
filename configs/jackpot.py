"""Jackpot (OBRS accept/reweight with top-K normaliser) with the policy itself as rollout
model. For a separate, smaller rollout model see configs/jackpot_small_actor.py.

    python -m jaxrl_llm.main --config=configs/jackpot.py --workdir=runs/jackpot
"""

from configs import default


def get_config(arg: str = ""):
    c = default.get_config("jackpot")
    c.sampler.capture_topk = 8  # Z_approx sums over the behaviour top-K
    return c
