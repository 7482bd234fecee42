"""Surrogate objectives, each a pure function registered by name.

    loss, metrics = registry()[name](policy: PolicyOutput, batch: TrajectoryBatch, cfg)

`cfg` is the frozen config from `make_config` (hashable: pass it as a jit static argument).
Importing this package registers the nine built-ins. It imports `models`, `batch`,
`advantages`, `groups`, `staleness` and `validation` only: an objective never sees a run, its
runtime or its files.
"""

from jaxrl_llm.objectives.registry import (  # noqa: F401
    NEEDS,
    default_config,
    get,
    make_config,
    register,
    registry,
    required_passes,
    unregister,
    with_aux,
)
from jaxrl_llm.objectives.auxiliary import AuxContext, AuxInputs, Auxiliary  # noqa: F401
from jaxrl_llm.objectives import common  # noqa: F401
from jaxrl_llm.objectives import ppo as _ppo  # noqa: F401  (registers ppo, decoupled_ppo, a3po)
from jaxrl_llm.objectives import sequence as _sequence  # noqa: F401  (gspo, gepo)
from jaxrl_llm.objectives import offpolicy_grpo as _offpolicy_grpo  # noqa: F401
from jaxrl_llm.objectives import jackpot as _jackpot  # noqa: F401
from jaxrl_llm.objectives import m2po as _m2po  # noqa: F401
from jaxrl_llm.objectives import cispo as _cispo  # noqa: F401

BUILTIN = ("ppo", "decoupled_ppo", "a3po", "gspo", "gepo", "offpolicy_grpo", "jackpot", "m2po", "cispo")
