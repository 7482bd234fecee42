"""Decoupled PPO (A-3PO Eq. 2): clip against a recomputed proximal policy, behaviour weight
truncated (TIS). Costs one extra forward per step for log pi_prox.

    python -m jaxrl_llm.main --config=configs/decoupled_ppo.py --workdir=runs/decoupled_ppo
"""

from configs import default


def get_config(arg: str = ""):
    c = default.get_config("decoupled_ppo")
    c.objective.is_correction.update(dict(kind="tis", cap=2.0))
    return c
