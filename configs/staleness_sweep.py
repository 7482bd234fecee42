"""Staleness sweep: objectives x max_staleness on the embedded task, simulated mode, so every
cell is deterministic and each batch is exactly k steps stale (`:fixed`, the default) or has a
random delay in [1, k] steps (`:lognormal`, `:weibull`, `:exponential`, as in GEPO, arXiv:2508.17850).

    python -m jaxrl_llm.research.sweep --config=configs/staleness_sweep.py --workdir=runs/sweep
    python -m jaxrl_llm.research.sweep --config=configs/staleness_sweep.py:lognormal \
        --config.sweep.objectives=ppo,a3po,gepo,jackpot --config.sweep.max_staleness=0,4,8,16 ...
"""

from configs import default
from jaxrl_llm.research import sweep


def get_config(arg: str = "fixed"):
    c = default.get_config("a3po")
    c.runtime.mode = "simulated"
    c.runtime.delay.update(dict(kind="fixed", value=1e9))  # fixed: always the cap, k
    c.train.update(dict(steps=200, eval_every=50, save_every=100, progress=False))
    c.sweep = sweep.SECTION.config(delay=arg or "fixed")  # seeds: N per arm from c.seed, or a list "0,7,9"
    return c
