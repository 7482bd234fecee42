"""PPO/GRPO (coupled clipped surrogate, clip-higher) on the default async setup.

    python -m jaxrl_llm.main --config=configs/ppo.py --workdir=runs/ppo
"""

from configs import default


def get_config(arg: str = ""):
    c = default.get_config("ppo")
    c.objective.clip.update(dict(eps_low=0.2, eps_high=0.28))  # DAPO-style clip-higher
    return c
