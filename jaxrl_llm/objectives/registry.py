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
             aux: Optional[Auxiliary] = None, prepare: Optional[Callable] = None,
             prepare_when: Optional[Callable] = None):
    """Decorator: ``@register("my_obj", needs=("prox_logp",))`` adds ``fn`` to the registry.

    ``fn(policy: PolicyOutput, batch: TrajectoryBatch, cfg) -> (loss, metrics)`` must be pure
    and jittable with ``cfg`` static. What the learner computes for it is declared here:
    ``needs`` (a subset of NEEDS), or ``passes(cfg) -> needs`` when the options decide; ``aux``
    an auxiliary model trained jointly (see `objectives.auxiliary`); ``prepare(batch, cfg) ->
    f32[B, L]`` a token selection made once per step over the step's whole batch, after the
    extra passes and before the minibatches (the learner stores it in `batch.token_keep`; a
    minibatch alone would see only its own tokens); ``prepare_when(cfg) -> bool`` whether the
    options ask for that step-level selection (default: always; where not, the objective selects
    within each minibatch it is called on). Re-registering a name raises (use ``unregister`` first).
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
        fn.prepare = prepare
        fn.prepare_when = prepare_when or (lambda cfg: True)
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


def _registered_name() -> "V.Rule":
    return V.Rule(lambda: "a registered objective name: " + ", ".join(sorted(_REGISTRY)), lambda x: x in _REGISTRY,
                  ("not-an-objective",))


SECTION = V.Section(
    name=("ppo", _registered_name()),
    # Trust region: clip(r, 1 - eps_low, 1 + eps_high); dual_clip c > 1 caps -A*r for A < 0.
    clip=V.Section(eps_low=(0.2, V.below_one()), eps_high=(0.2, V.non_negative()),
                   dual_clip=(0.0, V.Rule("0 (off) or a number > 1", lambda x: x == 0 or (x > 1 and x < float("inf")),
                                          (0.5, -1.0)))),
    loss_agg=("token_mean", V.one_of(*common.AGGREGATIONS)),
    loss_agg_norm_len=(0, V.integer(0)),  # the *_sum_norm divisor; 0 -> padded length L
    # Tokens an objective rejects (IcePop's zero weight, M2PO's mask): count (as zeros, the
    # papers' expectations; AReaL's IcePop) or drop (out of the denominator: verl, AReaL's M2PO).
    loss_agg_rejected=("count", V.one_of("count", "drop")),
    log_ratio_clamp=(20.0, V.positive()),  # applied to every log-ratio before exp
    kl=V.Section(coef=(0.0, V.non_negative()), estimator=("k3", V.one_of(*common.KL_ESTIMATORS))),
    # Importance-sampling correction F on the behaviour weight (decoupled_ppo, a3po):
    # none | tis (min(x, cap)) | icepop (x in [low, high] else 0).
    is_correction=V.Section(kind=("none", V.one_of(*common.IS_CORRECTIONS)), cap=(2.0, V.positive()),
                            low=(0.5, V.non_negative()), high=(2.0, V.positive())),
    # GSPO: sequence ratio exp(mean_t log(pi/pi_behav)); tiny clip range as in the GSPO paper.
    # loss_agg: GSPO's own (the paper's 1/G sum_i over sequences; AReaL's length weighting is
    # token_mean); the shared loss_agg does not apply to it.
    gspo=V.Section(variant=("seq", V.one_of("seq", "token")), eps_low=(3e-4, V.non_negative()),
                   eps_high=(4e-4, V.non_negative()),
                   loss_agg=("seq_mean_token_mean", V.one_of(*common.AGGREGATIONS))),
    # GEPO Eq. 15 defensive denominator eps*sg(p) + (1-eps)*E_q[q]:
    # eps_mode const -> eps; var -> clip(eps_var_coef * Var_group(q), 0, eps_max).
    gepo=V.Section(eps_mode=("const", V.one_of("const", "var")), eps=(0.0, V.unit()),
                   eps_var_coef=(1.0, V.non_negative()), eps_max=(0.99, V.unit())),
    # A-3PO: prox_metrics also recomputes the true pi_prox (one extra forward, as decoupled PPO
    # does) and logs the interpolation's errors per staleness bucket (AReaL's "metrics" mode).
    a3po=V.Section(prox_metrics=(False, V.boolean())),
    # Off-policy GRPO: r' = pi_k/alpha from prox_logp ("prox") or the r' ~ 1 approximation.
    offpolicy_grpo=V.Section(r_prime=("one", V.one_of("one", "prox")), zero_var_mask=(True, V.boolean())),
    # Jackpot (OBRS): lam = lambda, caps c1 (OBRS weight) and c2 (p_ref/p_target);
    # distill_coef = lambda_distill of the jointly trained rollout actor (Eq. 8), when there is one;
    # correction: obrs (Jackpot), tis (min(p_ref/p_inf, c1)) or none (the paper's baselines).
    # M2PO: tau = tau_M2, the bound on the kept tokens' mean (log pi_prox - log pi_behav)^2
    # (AReaL's m2_threshold, 0.04 in its example); clip: PPO's clip on pi_theta/pi_prox as well.
    # scope: the second-moment mask over the step's loss tokens (step) or over each minibatch's,
    # one loss call each (minibatch: AReaL's code, which computes it per call)
    m2po=V.Section(tau=(0.04, V.positive()), clip=(False, V.boolean()), scope=("step", V.one_of("step", "minibatch"))),
    # CISPO: the IS weight's clip; eps_low = 1 is no lower bound (the paper tunes eps_high only).
    cispo=V.Section(eps_low=(1.0, V.unit()), eps_high=(0.28, V.non_negative())),
    jackpot=V.Section(lam=(1.0, V.positive()), c1=(2.0, V.positive()), c2=(2.0, V.positive()),
                      p_target=("new", V.one_of("new", "ref")), p_ref=("prox", V.one_of("prox", "current")),
                      distill_coef=(1.0, V.non_negative()), correction=("obrs", V.one_of("obrs", "tis", "none"))),
)
RULES = SECTION.rules


def default_config(name: str = "ppo") -> ml_collections.ConfigDict:
    """All objective options with their defaults. Override fields, then `make_config`."""
    return SECTION.config(name=name)


_IS_USERS = ("decoupled_ppo", "a3po", "m2po")


_RESOLVED: set = set()  # configs `make_config` produced (equal configs are equally valid)


def make_config(cfg=None, **overrides) -> ml_collections.FrozenConfigDict:
    """Validate an objective config and freeze it (hashable, so it can be jit-static).

    ``cfg`` may be a ConfigDict / dict with a subset of fields (missing ones take defaults);
    ``overrides`` use dotted names with ``__``: ``make_config(name="gepo", clip__eps_high=0.28)``.
    Unknown names list the valid ones; incompatible options fail here, not inside jit.
    """
    if not overrides and isinstance(cfg, ml_collections.FrozenConfigDict) and cfg in _RESOLVED:
        return cfg  # resolved once at start-up (`plan.resolve`); later users take it as it is
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
    out = ml_collections.FrozenConfigDict(base)
    _RESOLVED.add(out)
    return out


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
    """Each field against its declared rule (`SECTION`), then the cross-field rules."""
    get(c.name)  # unknown objective -> error listing the registered names
    V.raise_all(V.check(c, V.flatten(SECTION.rules)), what="invalid objective option")
    if c.is_correction.kind != "none" and c.name not in _IS_USERS:
        raise ValueError(
            f"is_correction.kind={c.is_correction.kind!r} applies to objectives with a separate "
            f"behaviour importance weight ({', '.join(_IS_USERS)}); objective {c.name!r} has none "
            "(jackpot caps its weight with jackpot.c1/c2). Set is_correction.kind='none'."
        )
    if c.is_correction.kind == "icepop" and not c.is_correction.low < c.is_correction.high:
        raise ValueError("is_correction.low must be < is_correction.high for icepop")
    rejects = c.name == "m2po" or (c.name in _IS_USERS and c.is_correction.kind == "icepop")
    if c.loss_agg_rejected != "count" and not rejects:
        raise ValueError(
            f"loss_agg_rejected={c.loss_agg_rejected!r} applies to tokens an objective rejects: m2po's mask, "
            f"or is_correction.kind='icepop' with {', '.join(_IS_USERS)}; objective {c.name!r} "
            f"(is_correction.kind={c.is_correction.kind!r}) rejects none")
    if c.name == "gspo" and c.loss_agg != "token_mean":
        raise ValueError(
            f"gspo aggregates with gspo.loss_agg (default seq_mean_token_mean, the paper's mean over "
            f"sequences), not the shared loss_agg; set --config.objective.gspo.loss_agg={c.loss_agg} instead")
