"""The papers' headline claims in miniature (and the project's own, each citing the issue that set
it), and the rules that judge them (`reproduce` runs them).

Each claim names its paper, says what it claims in one sentence, lists its arms (a config file
plus overrides; every arm runs for every seed) and a rule. Rules are fixed here, before any
run, and see only per-seed numbers:

- `noninferior(a, b)`: "a is comparable to b": the paired (same seed) difference a - b has a
  95% interval whose lower end is above -MARGIN (holds), or whose upper end is below -MARGIN
  (fails); anything else is inconclusive.
- `greater(a, b)`: the paired difference a - b has a 95% interval above 0 (holds) or below 0
  (fails); an interval containing 0 is inconclusive.
- `at_least(x, t)`: the interval of x lies at or above t (holds) or below t (fails).

A claim with several checks holds when all hold and fails when any fails. The reward metric is
`final`: the mean held-out reward of a run's last three evaluations (less noise than the last
one alone; with the reproduce cadence, the last 20% of the run).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxrl_llm.research import stats

MARGIN = 0.05  # held-out reward: "comparable" = no worse than this, absolute
RETAIN = 0.95  # GEPO: share of its fresh-data reward kept under high staleness
PROX_SPEEDUP = 1000.0  # A-3PO: how many times cheaper its proximal policy must be
STALENESS = (0, 2, 4, 8, 16)
SWEEP_OBJECTIVES = ("ppo", "decoupled_ppo", "a3po", "gepo", "m2po")

A3PO = ("A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation",
        "arXiv:2512.06547")
GEPO = ("Group Expectation Policy Optimization for Stable Heterogeneous Reinforcement Learning in LLMs",
        "arXiv:2508.17850")
OFFPOLICY = ("Revisiting Group Relative Policy Optimization: Insights into On-Policy and Off-Policy Training",
             "arXiv:2505.22257")
M2PO = ("Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", "arXiv:2510.01161")
JACKPOT = ("Jackpot: Optimal Budgeted Rejection Sampling for Extreme Actor-Policy Mismatch Reinforcement Learning",
           "arXiv:2602.06107")
R3 = ("Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", "arXiv:2510.11370")
GATEWAY = ("Issue #52: agents written against an OpenAI-style client, trained through the gateway", "issue #52")
# A random 4-expert, top-2 policy whose samplers route in bfloat16 while its learner routes in float32
# (an inference engine's numerics against a trainer's); TIS on the behaviour weight in both arms.
MOE = (("model.moe.experts", 4), ("model.moe.top_k", 2), ("model.moe.sampler_router_dtype", "bfloat16"),
       ("objective.is_correction.kind", "tis"))


@dataclasses.dataclass(frozen=True)
class Arm:
    label: str
    config: str  # "configs/<file>.py[:arg]"
    overrides: tuple = ()  # ((dotted key, value), ...), applied after the config file


@dataclasses.dataclass(frozen=True)
class Claim:
    key: str
    paper: tuple  # (title, arXiv id)
    statement: str
    metric: str
    arms: tuple
    rule: Callable  # Results -> list of check dicts
    rule_text: str
    measured: tuple = ()  # names of `Results.extra` figures the rule reads (recorded with the claim)


class Results:
    """Per-arm, per-seed runs (`report.load_run` dicts, seed order) plus measured extras."""

    def __init__(self, runs: dict, extra: dict | None = None):
        self.runs, self.extra = runs, extra or {}

    def per_seed(self, label: str, fn: Callable) -> np.ndarray:
        return np.array([fn(r) for r in self.runs[label]], float)

    def final(self, label: str) -> np.ndarray:
        return self.per_seed(label, final)


def final(run: dict, key: str = "eval/reward", last: int = 3) -> float:
    vals = [r[key] for r in run["evals"] if key in r][-last:]
    return float(np.mean(vals)) if vals else float("nan")


def mean_of(key: str, skip: int = 5) -> Callable:
    """A run's mean of a per-step metric, past its first `skip` (compiling) steps."""
    def fn(run):
        vals = [r[key] for r in run["steps"][min(skip, len(run["steps"]) // 2):] if key in r]
        return float(np.mean(vals)) if vals else float("nan")
    return fn


def _check(text: str, values, verdict_of) -> dict:
    mean, half = stats.mean_ci(values)
    lo, hi = mean - half, mean + half
    # a seed without a number (a failed run) leaves the claim unjudged, not judged on fewer seeds
    complete = np.isfinite(np.asarray(values, float)).all() and np.isfinite(half)
    verdict = verdict_of(lo, hi) if complete else "inconclusive"
    return {"check": text, "values": [float(v) for v in values], "mean": mean, "ci95": half, "verdict": verdict}


def noninferior(a, b, text: str, margin: float = MARGIN) -> dict:
    return _check(f"{text}: paired difference > -{margin}", np.asarray(a) - np.asarray(b),
                  lambda lo, hi: "holds" if lo > -margin else "fails" if hi < -margin else "inconclusive")


def greater(a, b, text: str) -> dict:
    return _check(f"{text}: paired difference > 0", np.asarray(a) - np.asarray(b),
                  lambda lo, hi: "holds" if lo > 0 else "fails" if hi < 0 else "inconclusive")


def at_least(x, threshold: float, text: str) -> dict:
    return _check(f"{text} >= {threshold:g}", x,
                  lambda lo, hi: "holds" if lo >= threshold else "fails" if hi < threshold else "inconclusive")


def combine(checks: Sequence[dict]) -> str:
    verdicts = [c["verdict"] for c in checks]
    return "fails" if "fails" in verdicts else "holds" if all(v == "holds" for v in verdicts) else "inconclusive"


# ---- the claims -------------------------------------------------------------------------------

SWEEP = "configs/staleness_sweep.py"  # simulated mode: each batch exactly max_staleness steps stale


def sweep_arm(objective: str, k: int) -> Arm:
    return Arm(f"{objective}_s{k}", SWEEP, (("objective.name", objective), ("runtime.max_staleness", k)))


ON_POLICY = (("runtime.mode", "simulated"), ("runtime.max_staleness", 0), ("runtime.delay.kind", "none"))


def _a3po_rule(r: Results) -> list:
    cost = r.extra["a3po_cost"]  # measured at Qwen2.5-0.5B shapes (`research.cost`), one batch per seed
    prox_speedup = np.asarray(cost["prox_pass_s"]) / np.asarray(cost["a3po_prox_s"])
    return [noninferior(r.final("a3po_s4"), r.final("decoupled_ppo_s4"), "final reward a3po - decoupled_ppo"),
            at_least(prox_speedup, PROX_SPEEDUP, "prox time decoupled_ppo / a3po"),
            greater(r.per_seed("decoupled_ppo_s4", mean_of("step_time_s")),
                    r.per_seed("a3po_s4", mean_of("step_time_s")), "step time decoupled_ppo - a3po (s)")]


def _retention(r: Results, objective: str) -> np.ndarray:
    return r.final(f"{objective}_hetero64") / r.final(f"{objective}_hetero0")


def _gepo_rule(r: Results) -> list:
    return [at_least(_retention(r, "gepo"), RETAIN, "gepo reward at staleness 64 / at 0"),
            greater(_retention(r, "gepo"), _retention(r, "ppo"), "retention gepo - ppo")]


def _m2po_rule(r: Results) -> list:
    return [at_least(_retention(r, "m2po"), RETAIN, "m2po reward at staleness 64 / at 0"),
            greater(_retention(r, "m2po"), _retention(r, "ppo"), "retention m2po - ppo")]


def _offpolicy_rule(r: Results) -> list:
    return [noninferior(r.final("offpolicy_grpo_v10"), r.final("offpolicy_grpo_v1"), "final reward v=10 - v=1")]


def _jackpot_rule(r: Results) -> list:
    return [noninferior(r.final("jackpot_small_actor"), r.final("ppo_on_policy"),
                        "final reward jackpot (small actor) - on-policy ppo"),
            greater(r.final("jackpot_small_actor"), r.final("small_actor_no_correction"),
                    "final reward jackpot - no correction")]


def _r3_rule(r: Results) -> list:
    gap = mean_of("mismatch/abs_logp_mean")  # fresh tokens: the routing's share of the mismatch, not staleness'
    return [greater(r.per_seed("r3_recompute", gap), r.per_seed("r3_replay", gap),
                    "mean |log-prob mismatch| on fresh tokens: recompute - replay"),
            noninferior(r.final("r3_replay"), r.final("r3_recompute"), "final reward replay - recompute")]


def _gateway_rule(r: Results) -> list:
    return [noninferior(r.final("agent_gateway"), r.final("builtin_tool"), "final reward gateway agent - built-in")]


def _drop(r: Results, objective: str) -> np.ndarray:
    return r.final(f"{objective}_s0") - r.final(f"{objective}_s{STALENESS[-1]}")


def _sweep_rule(r: Results) -> list:
    return [greater(_drop(r, "ppo"), _drop(r, o), f"reward drop s=0 -> s={STALENESS[-1]}: ppo - {o}")
            for o in ("decoupled_ppo", "a3po")]


def all_claims() -> list[Claim]:
    hetero = lambda obj, k: Arm(  # noqa: E731
        f"{obj}_hetero{k}", f"configs/gepo_hetero.py:{k}",
        (("objective.name", obj),) + ((("runtime.delay.kind", "none"),) if k == 0 else ()))
    return [
        Claim("a3po_vs_decoupled_ppo", A3PO,
              "A-3PO matches decoupled PPO's reward while its proximal policy costs >= 1000x less than "
              "decoupled PPO's recompute pass and its training step is faster.",
              "final held-out reward and learner step time (miniature); proximal policy seconds at "
              "Qwen2.5-0.5B shapes (recompute pass / interpolation on one batch per seed)", (
                  sweep_arm("a3po", 4), sweep_arm("decoupled_ppo", 4)), _a3po_rule,
              f"noninferior(a3po, decoupled_ppo, {MARGIN}); at_least(prox speedup at 0.5B, {PROX_SPEEDUP:g}); "
              "greater(step time decoupled_ppo, a3po)", measured=("a3po_cost",)),
        Claim("gepo_high_staleness", GEPO,
              f"Under heterogeneous-network delays with max staleness 64, GEPO keeps >= {RETAIN:.0%} of its "
              "fresh-data reward while GRPO (ppo objective, group advantages) loses more.",
              "final held-out reward at max staleness 64 / at 0 (same seed)", (
                  hetero("gepo", 0), hetero("gepo", 64), hetero("ppo", 0), hetero("ppo", 64)), _gepo_rule,
              f"at_least(gepo retention, {RETAIN}); greater(gepo retention, ppo retention)"),
        Claim("m2po_high_staleness", M2PO,
              f"Under heterogeneous-network delays with max staleness 64, M2PO keeps >= {RETAIN:.0%} of its "
              "fresh-data reward while GRPO (ppo objective) loses more.",
              "final held-out reward at max staleness 64 / at 0 (same seed)", (
                  hetero("m2po", 0), hetero("m2po", 64), hetero("ppo", 0), hetero("ppo", 64)), _m2po_rule,
              f"at_least(m2po retention, {RETAIN}); greater(m2po retention, ppo retention)"),
        Claim("offpolicy_grpo_v10", OFFPOLICY,
              "Off-policy GRPO with the sampler refreshed every v = 10 updates reaches the reward of "
              "on-policy GRPO (v = 1).",
              "final held-out reward", (
                  Arm("offpolicy_grpo_v10", "configs/offpolicy_grpo.py:10"),
                  Arm("offpolicy_grpo_v1", "configs/offpolicy_grpo.py:1")), _offpolicy_rule,
              f"noninferior(v=10, v=1, {MARGIN})"),
        Claim("jackpot_small_actor", JACKPOT,
              "A smaller rollout model with OBRS (and the actor's distillation) trains the policy to near "
              "on-policy reward, while the same setup without correction falls behind.",
              "final held-out reward of the policy", (
                  Arm("ppo_on_policy", "configs/default.py:ppo", ON_POLICY),
                  Arm("jackpot_small_actor", "configs/jackpot_small_actor.py", ON_POLICY),
                  Arm("small_actor_no_correction", "configs/jackpot_small_actor.py",
                      ON_POLICY + (("objective.jackpot.correction", "none"), ("objective.jackpot.distill_coef", 0.0)))),
              _jackpot_rule,
              f"noninferior(jackpot, on-policy, {MARGIN}); greater(jackpot, no correction)"),
        Claim("staleness_sweep", A3PO,
              f"Decoupled objectives (decoupled_ppo, a3po) lose less reward than PPO as max staleness grows "
              f"from 0 to {STALENESS[-1]} (sweep: {', '.join(map(str, STALENESS))} for "
              f"{', '.join(SWEEP_OBJECTIVES)}).",
              f"final held-out reward; drop = reward at s=0 - at s={STALENESS[-1]} (same seed)",
              tuple(sweep_arm(o, k) for o in SWEEP_OBJECTIVES for k in STALENESS), _sweep_rule,
              "greater(ppo drop, decoupled_ppo drop); greater(ppo drop, a3po drop)"),
        Claim("r3_routing_replay", R3,
              "With the samplers' routers perturbed (a bfloat16 router matmul against the learner's float32) "
              "in async training at max staleness 4, replaying the experts each token was sampled with (R3) "
              "leaves a smaller log-prob mismatch than recomputing them with TIS, and no worse a reward.",
              "mean |log pi_learner - log pi_behav| on fresh tokens per step (past the first 5); final "
              "held-out reward", (
                  Arm("r3_replay", "configs/default.py", MOE + (("model.moe.routing", "replay"),)),
                  Arm("r3_recompute", "configs/default.py", MOE)), _r3_rule,
              f"greater(recompute mismatch, replay mismatch); noninferior(replay, recompute, {MARGIN})"),
        Claim("agent_gateway", GATEWAY,
              "The calculator task written as an ordinary OpenAI function-calling agent "
              "(examples/calculator_agent.py, the stock client) and trained through the gateway reaches the "
              "held-out reward of the built-in tool_arithmetic environment (within the margin).",
              "final held-out reward", (
                  Arm("agent_gateway", "configs/agent_calculator.py"),
                  Arm("builtin_tool", "configs/tool_arithmetic.py")), _gateway_rule,
              f"noninferior(gateway agent, built-in, {MARGIN})"),
    ]


def judge(claim: Claim, results: Results) -> dict:
    checks = claim.rule(results)
    return {"checks": checks, "verdict": combine(checks)}
