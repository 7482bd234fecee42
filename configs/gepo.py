"""GEPO: group-expectation importance weights (Eq. 9-12) on the default async setup.
`:var` makes the mixing epsilon proportional to the group's Var(q) (Eq. 15).

    python -m jaxrl_llm.main --config=configs/gepo.py --workdir=runs/gepo
"""

from configs import default


def get_config(arg: str = "const"):
    c = default.get_config("gepo")
    c.objective.gepo.eps_mode = arg or "const"
    return c
