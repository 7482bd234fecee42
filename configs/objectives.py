"""Objective configs: `--config=configs/objectives.py:gepo` gives GEPO's defaults.

    python -c "from configs.objectives import get_config; print(get_config('a3po'))"

Overrides follow ml_collections conventions (`--config.clip.eps_high=0.28`); the learner
freezes and validates with `jaxrl_llm.objectives.make_config`.
"""

from jaxrl_llm import objectives


def get_config(arg: str = "ppo"):
    config = objectives.default_config(arg)
    objectives.make_config(config)  # fail fast on an unknown name
    return config
