"""M2PO for very stale data (arXiv:2510.01161): decoupled PPO's recompute pass gives pi_prox,
the step's tokens with the largest (log pi_prox - log pi_behav)^2 are masked until the rest's
mean is below tau_M2 = 0.04 (AReaL's examples/math/gsm8k_m2po.yaml, `m2_threshold: 0.04`), and
the kept tokens train with the unclipped importance-weighted gradient. Here at max staleness 16.

    python -m jaxrl_llm.main --config=configs/m2po.py --workdir=runs/m2po
    python -m jaxrl_llm.main --config=configs/m2po.py:64 ...   # arg: runtime.max_staleness
"""

from configs import default


def get_config(arg: str = "16"):
    c = default.get_config("m2po")
    c.objective.m2po.update(dict(tau=0.04, clip=False))
    c.runtime.max_staleness = int(arg or 16)
    return c
