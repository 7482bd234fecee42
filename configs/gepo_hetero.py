"""GEPO under the heterogeneous-network delays of its paper (arXiv:2508.17850), simulated deterministically: the delay
before a sampler sees new weights is log-normal, bounded to [60 s, 1800 s] with 99.5% of the
mass inside; 1800 s corresponds to 64 learner steps (28.1 s per step), and each batch's
staleness is capped at `arg` steps (the paper sweeps 0, 4, 8, 16, 32, 64). KL is off here;
the paper adds a small KL term (coefficient 0.005) in this setting: --config.objective.kl.coef.

    python -m jaxrl_llm.main --config=configs/gepo_hetero.py:8 --workdir=runs/gepo_hetero_8
    python -m jaxrl_llm.main --config=configs/gepo_hetero.py:8 --config.runtime.delay.kind=weibull ...
"""

from configs import default


def get_config(arg: str = "8"):
    c = default.get_config("gepo")
    c.runtime.update(dict(mode="simulated", max_staleness=int(arg or 8), step_seconds=1800.0 / 64))
    c.runtime.delay.update(dict(kind="lognormal", min=60.0, max=1800.0))
    return c
