"""GSPO: length-normalised sequence ratio with a sequence-level clip; `:token` for GSPO-token.
Clip ranges are the paper's (3e-4, 4e-4): the sequence ratio is a geometric mean, so it moves
far less than a token ratio. The loss averages over sequences, (1/G) sum_i, as the paper's Eq. 5
(`objective.gspo.loss_agg`; token_mean weights sequences by length, as AReaL does).

    python -m jaxrl_llm.main --config=configs/gspo.py:token --workdir=runs/gspo_token
"""

from configs import default


def get_config(arg: str = "seq"):
    c = default.get_config("gspo")
    c.objective.gspo.update(dict(variant=arg or "seq", eps_low=3e-4, eps_high=4e-4))
    c.objective.gspo.loss_agg = "seq_mean_token_mean"
    return c
