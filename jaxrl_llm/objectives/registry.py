"""Objective registry and the objective config (ml_collections, frozen -> jit-static)."""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional

import ml_collections

from jaxrl_llm import validation as V
from jaxrl_llm.objectives import common
from jaxrl_llm.objectives.auxiliary import Auxiliary

_REGISTRY: dict[str, Callable] = {}

# Batch/policy fields an objective reads beyond the required ones; the learner uses this to
# decide which extra passes to run (prox recompute, reference, top-k capture, rng).
NEEDS = ("prox_logp", "prox_topk_logp", "ref_logp", "logp_at_behav_topk", "topk", "rng")


def register(name: str, needs: Iterable[str] = (), passes: Optional[Callable] = None,
             aux: Optional[Auxiliary] = None):
    """Decorator: ``@register("my_obj", needs=("prox_logp",))`` adds ``fn`` to the registry.

    ``fn(policy: PolicyOutput, batch: TrajectoryBatch, cfg) -> (loss, metrics)`` must be pure
    and jittable with ``cfg`` static. What the learner computes for it is declared here:
    ``needs`` (a subset of NEEDS), or ``passes(cfg) -> needs`` when the options decide; ``aux``
    an auxiliary model trained jointly (see `objectives.auxiliary`). Re-registering a name
    raises (use ``unregister`` first).
    """
    needs = tuple(needs)
    for n in needs:
        common.check_choice("objective need", n, NEEDS)

    def deco(fn: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"objective {name!r} is already registered")
        if getattr(fn, "objective_name", name) != name:  # registered under another name: leave that entry be
            fn = functools.wraps(fn)(functools.partial(fn))
        fn.needs = frozenset(needs)
        fn.passes = passes
        fn.aux = aux
        fn.objective_name = name
        _REGISTRY[name] = fn
        return fn

    return deco


def required_passes(cfg) -> frozenset:
    """What the learner must compute for the objective config `cfg`: the objective's declared
    needs (refined by its options when it registered `passes`), plus the reference forward
    when a KL penalty is on."""
    fn = get(cfg.name)
    needs = set(fn.passes(cfg) if fn.passes is not None else fn.needs)
    for n in needs:
        common.check_choice(f"need of objective {cfg.name!r}", n, NEEDS)
    if cfg.kl.coef > 0:
        needs.add("ref_logp")
    return frozenset(needs)


def with_aux() -> list:
    """Names of the registered objectives that train an auxiliary model."""
    return sorted(n for n, fn in _REGISTRY.items() if fn.aux is not None)


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registry() -> dict[str, Callable]:
    """{name: objective fn} (a copy)."""
    return dict(_REGISTRY)


def get(name: str) -> Callable:
    if name not in _REGISTRY:
        raise ValueError(f"unknown objective {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def default_config(name: str = "ppo") -> ml_collections.ConfigDict:
    """All objective options with their defaults. Override fields, then `make_config`."""
    c = ml_collections.ConfigDict()
    c.name = name
    # Trust region: clip(r, 1 - eps_low, 1 + eps_high); dual_clip c > 1 caps -A*r for A < 0.
    c.clip = ml_collections.ConfigDict(dict(eps_low=0.2, eps_high=0.2, dual_clip=0.0))
    c.loss_agg = "token_mean"
    c.loss_agg_norm_len = 0  # seq_mean_token_sum_norm divisor; 0 -> padded length L
    c.log_ratio_clamp = 20.0  # applied to every log-ratio before exp
    c.kl = ml_collections.ConfigDict(dict(coef=0.0, estimator="k3"))
    # Importance-sampling correction F on the behaviour weight (decoupled_ppo, a3po):
    # none | tis (min(x, cap)) | icepop (x in [low, high] else 0).
    c.is_correction = ml_collections.ConfigDict(dict(kind="none", cap=2.0, low=0.5, high=2.0))
    # GSPO: sequence ratio exp(mean_t log(pi/pi_behav)); tiny clip range as in the GSPO paper.
    c.gspo = ml_collections.ConfigDict(dict(variant="seq", eps_low=3e-4, eps_high=4e-4))
    # GEPO Eq. 15 defensive denominator eps*sg(p) + (1-eps)*E_q[q]:
    # eps_mode const -> eps; var -> clip(eps_var_coef * Var_group(q), 0, eps_max).
    c.gepo = ml_collections.ConfigDict(
        dict(eps_mode="const", eps=0.0, eps_var_coef=1.0, eps_max=0.99)
    )
    # A-3PO: prox_metrics also recomputes the true pi_prox (one extra forward, as decoupled PPO
    # does) and logs the interpolation's errors per staleness bucket (AReaL's "metrics" mode).
    c.a3po = ml_collections.ConfigDict(dict(prox_metrics=False))
    # Off-policy GRPO: r' = pi_k/alpha from prox_logp ("prox") or the r' ~ 1 approximation.
    c.offpolicy_grpo = ml_collections.ConfigDict(dict(r_prime="one", zero_var_mask=True))
    # Jackpot (OBRS): lam = lambda, caps c1 (OBRS weight) and c2 (p_ref/p_target);
    # distill_coef = lambda_distill of the jointly trained rollout actor (Eq. 8), when there is one;
    # correction: obrs (Jackpot), tis (min(p_ref/p_inf, c1)) or none (the paper's baselines).
    c.jackpot = ml_collections.ConfigDict(
        dict(lam=1.0, c1=2.0, c2=2.0, p_target="new", p_ref="prox", distill_coef=1.0, correction="obrs")
    )
    return c


def _registered_name() -> "V.Rule":
    return V.Rule(lambda: "a registered objective name: " + ", ".join(sorted(_REGISTRY)), lambda x: x in _REGISTRY,
                  ("not-an-objective",))


RULES = {
    "name": _registered_name(),
    "clip": {"eps_low": V.below_one(), "eps_high": V.non_negative(),
             "dual_clip": V.Rule("0 (off) or a number > 1", lambda x: x == 0 or (x > 1 and x < float("inf")), (0.5, -1.0))},
    "loss_agg": V.one_of(*common.AGGREGATIONS), "loss_agg_norm_len": V.integer(0), "log_ratio_clamp": V.positive(),
    "kl": {"coef": V.non_negative(), "estimator": V.one_of(*common.KL_ESTIMATORS)},
    "is_correction": {"kind": V.one_of(*common.IS_CORRECTIONS), "cap": V.positive(), "low": V.non_negative(),
                      "high": V.positive()},
    "gspo": {"variant": V.one_of("seq", "token"), "eps_low": V.non_negative(), "eps_high": V.non_negative()},
    "gepo": {"eps_mode": V.one_of("const", "var"), "eps": V.unit(), "eps_var_coef": V.non_negative(),
             "eps_max": V.unit()},
    "a3po": {"prox_metrics": V.boolean()},
    "offpolicy_grpo": {"r_prime": V.one_of("one", "prox"), "zero_var_mask": V.boolean()},
    "jackpot": {"lam": V.positive(), "c1": V.positive(), "c2": V.positive(), "p_target": V.one_of("new", "ref"),
                "p_ref": V.one_of("prox", "current"), "distill_coef": V.non_negative(),
                "correction": V.one_of("obrs", "tis", "none")},
}

_VALID = {
    "gspo.variant": ("seq", "token"),
    "gepo.eps_mode": ("const", "var"),
    "offpolicy_grpo.r_prime": ("one", "prox"),
    "jackpot.p_target": ("new", "ref"),
    "jackpot.p_ref": ("prox", "current"),
    "jackpot.correction": ("obrs", "tis", "none"),
}
_IS_USERS = ("decoupled_ppo", "a3po")


def make_config(cfg=None, **overrides) -> ml_collections.FrozenConfigDict:
    """Validate an objective config and freeze it (hashable, so it can be jit-static).

    ``cfg`` may be a ConfigDict / dict with a subset of fields (missing ones take defaults);
    ``overrides`` use dotted names with ``__``: ``make_config(name="gepo", clip__eps_high=0.28)``.
    Unknown names list the valid ones; incompatible options fail here, not inside jit.
    """
    base = default_config()
    given = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else (cfg or {}))
    for key, value in overrides.items():
        node = given
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    _merge(base, given, prefix="")
    _validate(base)
    return ml_collections.FrozenConfigDict(base)


def _merge(base, given: dict, prefix: str) -> None:
    for key, value in given.items():
        if key not in base:
            raise ValueError(
                f"unknown objective option {prefix + key!r}; valid: {', '.join(sorted(base.keys()))}"
            )
        if isinstance(base[key], ml_collections.ConfigDict):
            if hasattr(value, "to_dict"):
                value = value.to_dict()
            if not isinstance(value, dict):
                raise ValueError(f"objective option {prefix + key!r} is a group; got {value!r}")
            _merge(base[key], value, prefix + key + ".")
        elif isinstance(base[key], bool) or isinstance(base[key], str):
            if type(value) is not type(base[key]):
                raise ValueError(
                    f"objective option {prefix + key!r} expects {type(base[key]).__name__}; got {value!r}"
                )
            base[key] = value
        else:  # int / float: accept any real number, keep the field's type
            base[key] = type(base[key])(value)


def _validate(c) -> None:
    get(c.name)  # unknown objective -> error listing the registered names
    common.check_choice("loss aggregation (loss_agg)", c.loss_agg, common.AGGREGATIONS)
    common.check_choice("kl estimator (kl.estimator)", c.kl.estimator, common.KL_ESTIMATORS)
    common.check_choice("is_correction.kind", c.is_correction.kind, common.IS_CORRECTIONS)
    for dotted, valid in _VALID.items():
        group, leaf = dotted.split(".")
        common.check_choice(dotted, c[group][leaf], valid)
    if not (0.0 <= c.clip.eps_low < 1.0 and c.clip.eps_high >= 0.0):
        raise ValueError(f"clip.eps_low must be in [0, 1) and eps_high >= 0; got {c.clip}")
    if c.clip.dual_clip and c.clip.dual_clip <= 1.0:
        raise ValueError(f"clip.dual_clip must be 0 (off) or > 1; got {c.clip.dual_clip}")
    if c.kl.coef < 0:
        raise ValueError(f"kl.coef must be >= 0; got {c.kl.coef}")
    if c.log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be > 0; got {c.log_ratio_clamp}")
    if c.is_correction.kind != "none" and c.name not in _IS_USERS:
        raise ValueError(
            f"is_correction.kind={c.is_correction.kind!r} applies to objectives with a separate "
            f"behaviour importance weight ({', '.join(_IS_USERS)}); objective {c.name!r} has none "
            "(jackpot caps its weight with jackpot.c1/c2). Set is_correction.kind='none'."
        )
    if c.is_correction.kind == "icepop" and not c.is_correction.low < c.is_correction.high:
        raise ValueError("is_correction.low must be < is_correction.high for icepop")
    if not 0.0 <= c.gepo.eps <= 1.0 or not 0.0 <= c.gepo.eps_max <= 1.0:
        raise ValueError("gepo.eps and gepo.eps_max must lie in [0, 1]")
    if c.jackpot.lam <= 0 or c.jackpot.c1 <= 0 or c.jackpot.c2 <= 0:
        raise ValueError("jackpot.lam, jackpot.c1 and jackpot.c2 must be > 0")
    if c.jackpot.distill_coef < 0:
        raise ValueError(f"jackpot.distill_coef must be >= 0; got {c.jackpot.distill_coef}")
