"""A-3PO: decoupled PPO with the proximal policy interpolated from the staleness (Eq. 3-5),
no extra forward. The default objective; this file names it explicitly.

    python -m jaxrl_llm.main --config=configs/a3po.py --workdir=runs/a3po
"""

from configs import default


def get_config(arg: str = ""):
    return default.get_config("a3po")
