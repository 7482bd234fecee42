"""Seeds and 95% confidence intervals: runs that differ only in their seed form an arm; an arm
reports each figure as mean ± the half-width of a Student-t 95% interval over its seeds, and
its held-out reward curve as a mean with a band (`report` draws it, `sweep --seeds` feeds it).

With n seeds the interval is mean ± t(0.975, n - 1) · sd / sqrt(n) (sd with n - 1 degrees of
freedom): wide for 3 seeds (t = 4.30), which is the honest width of 3 seeds.
"""

from __future__ import annotations

import json
import math
import re
from typing import Sequence

import numpy as np

# Student-t 0.975 quantiles by degrees of freedom (a table: scipy is not a runtime dependency;
# tests check it against scipy.stats.t.ppf). Between entries and past 120 the next lower df's
# value is used, which widens the interval slightly, never narrows it.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
         18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    if df < 1:
        return float("nan")
    return _T975[max(k for k in _T975 if k <= df)]


def mean_ci(values) -> tuple[float, float]:
    """(mean, 95% half-width) of the finite values; half-width nan below two of them."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), float("nan")
    return float(v.mean()), t975(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)


def fmt(mean: float, half: float, digits: int = 3) -> str:
    if not np.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {half:.{digits}f}" if np.isfinite(half) else "")


def arms(runs: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """Group `report.load_run` results whose configs are equal but for `seed` (in first-seen
    order); an arm is labelled by its first run's name less a trailing `_seed<n>`."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        key = json.dumps({k: v for k, v in run["config"].items() if k != "seed"}, sort_keys=True, default=str)
        groups.setdefault(key, []).append(run)
    return [(re.sub(r"_seed\d+$", "", g[0]["name"]), g) for g in groups.values()]


def final(run: dict, key: str = "eval/reward") -> float:
    vals = [r[key] for r in run["evals"] if key in r]
    return float(vals[-1]) if vals else float("nan")


def steps_to(run: dict, threshold: float, key: str = "eval/reward") -> float:
    """The first evaluated step whose `key` reaches `threshold` (nan: never)."""
    return next((float(r["step"]) for r in run["evals"] if r.get(key, -np.inf) >= threshold), float("nan"))


def curve(runs: Sequence[dict], key: str = "eval/reward"):
    """(steps, mean, half-width) over the steps every run evaluated."""
    per_run = [{r["step"]: r[key] for r in run["evals"] if key in r} for run in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    stats = [mean_ci([p[s] for p in per_run]) for s in steps]
    return np.array(steps, float), np.array([m for m, _ in stats]), np.array([h for _, h in stats])


def arm_rows(runs: Sequence[dict], threshold: float | None = None) -> tuple[list[dict], float]:
    """One row per arm: seeds, final held-out reward, steps to `threshold` (default: 90% of the
    best arm's mean final reward; the mean is over the seeds that reach it, `reached` counts
    them) and trained tokens/s, each mean ± 95% half-width. Returns (rows, threshold)."""
    groups = arms(runs)
    finals = {label: mean_ci([final(r) for r in g])[0] for label, g in groups}
    if threshold is None:
        best = max((v for v in finals.values() if np.isfinite(v)), default=float("nan"))
        threshold = 0.9 * best
    rows = []
    for label, g in groups:
        tps = [float(np.mean([r["tokens_per_s"] for r in run["steps"] if "tokens_per_s" in r] or [np.nan]))
               for run in g]
        reach = [steps_to(r, threshold) for r in g]
        rows.append({"arm": label, "seeds": [r["config"].get("seed", "?") for r in g],
                     "final": mean_ci([final(r) for r in g]), "steps_to_threshold": mean_ci(reach),
                     "reached": int(np.isfinite(reach).sum()), "tokens_per_s": mean_ci(tps)})
    return rows, threshold


def arms_table(rows: Sequence[dict], threshold: float) -> str:
    lines = ["| arm | seeds | final eval/reward | steps to {:.3f} (reached) | tokens/s |".format(threshold),
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        n = len(r["seeds"])
        lines.append(f"| {r['arm']} | {n}: {', '.join(map(str, r['seeds']))} | {fmt(*r['final'])} | "
                     f"{fmt(*r['steps_to_threshold'], digits=0)} ({r['reached']}/{n}) | "
                     f"{fmt(*r['tokens_per_s'], digits=0)} |")
    return "\n".join(lines) + "\n"
