"""CISPO (MiniMax-M1, arXiv:2506.13585): every token keeps its gradient, weighted by the
importance weight pi_theta/pi_behav clipped above at 1 + eps_high (no lower bound, as the paper).

    python -m jaxrl_llm.main --config=configs/cispo.py --workdir=runs/cispo
"""

from configs import default


def get_config(arg: str = ""):
    c = default.get_config("cispo")
    c.objective.cispo.update(dict(eps_low=1.0, eps_high=0.28))
    return c
