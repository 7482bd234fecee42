"""Off-policy GRPO with the sampler's weights refreshed every v = 10 learner steps and each
batch used once (i = 1): the v > 1, i = 1 setting of
Revisiting GRPO (arXiv:2505.22257). `:V` sets v.

    python -m jaxrl_llm.main --config=configs/offpolicy_grpo.py --workdir=runs/offpolicy_grpo
    python -m jaxrl_llm.main --config=configs/offpolicy_grpo.py:4 ...
"""

from configs import default


def get_config(arg: str = "10"):
    v = int(arg or 10)
    c = default.get_config("offpolicy_grpo")
    c.runtime.update(dict(mode="offpolicy", refresh_every=v, max_staleness=v, reuse=1))
    c.runtime.mask_zero_variance = False  # the objective masks zero-variance groups itself (Eq. 7)
    return c
