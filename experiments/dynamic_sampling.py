"""Dynamic sampling (DAPO) on the embedded default, with and without, over seeds.

    python experiments/dynamic_sampling.py --workdir=runs/dynamic            # 3 seeds x 2 arms, one at a time
    python experiments/dynamic_sampling.py --workdir=runs/dynamic --report_only
    python experiments/dynamic_sampling.py --workdir=runs/dyn_quick -- --config.train.steps=300

Each run is an ordinary run of configs/default.py (`runtime.dynamic_sampling=True` in the
`dynamic` arm), run alone and timed from the command's start to its end. Per run: the final
held-out reward (greedy, the mean of the last three evaluations), the loss tokens of informative
groups (rewards not all equal: what a group-normalised advantage trains on) trained per second of
the whole run, draws per batch and capped batches. The rule (`RULE`) was fixed before the first
run. Writes experiments/results/dynamic_sampling/README.md and dynamic_sampling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.common import cpu_kind  # noqa: E402
from jaxrl_llm.research import report, stats  # noqa: E402

CONFIG = "configs/default.py"
ARMS = {"default": [], "dynamic": ["--config.runtime.dynamic_sampling=True"]}
MARGIN = 0.05
RULE = ("holds when the dynamic arm trains more informative-group tokens per second than the default arm in "
        f"every seed, and the 95% Student-t interval of the paired difference (dynamic - default) of the final "
        f"held-out reward (mean of the last three evaluations) lies above -{MARGIN}; fails when the first part "
        "fails or that interval lies below -0.05; otherwise inconclusive")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dynamic_sampling")


def run(workdir: str, seed: int, extra: list) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxrl_llm.main", f"--config={CONFIG}", f"--workdir={workdir}",
                    f"--config.seed={seed}", "--config.train.progress=False", *extra], check=True)
    return time.perf_counter() - t


def row(arm: str, seed: int, workdir: str, seconds: float) -> dict:
    r = report.load_run(workdir)
    evals = [e["eval/reward"] for e in r["evals"] if "eval/reward" in e]
    steps = r["steps"]
    tokens = sum(s.get("tokens/informative", 0.0) for s in steps)
    return dict(arm=arm, seed=seed, final=float(np.mean(evals[-3:])), start=evals[0], seconds=seconds,
                steps=len(steps), informative_tokens=tokens, informative_tokens_per_s=tokens / seconds,
                trained_tokens_per_s=float(np.mean([s["tokens_per_s"] for s in steps])),
                draws_per_batch=float(np.mean([s.get("dynamic/draws", 1.0) for s in steps])),
                capped=float(np.mean([s.get("dynamic/capped", 0.0) for s in steps])))


def verdict(rows: list) -> tuple[str, dict]:
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    faster = all(by["dynamic", s]["informative_tokens_per_s"] > by["default", s]["informative_tokens_per_s"]
                 for s in seeds)
    diff, half = stats.mean_ci([by["dynamic", s]["final"] - by["default", s]["final"] for s in seeds])
    check = {"informative_tokens_per_s_higher_every_seed": faster, "reward_diff_mean": diff, "reward_diff_ci": half}
    if not faster or diff + half < -MARGIN:
        return "fails", check
    return ("holds" if diff - half > -MARGIN else "inconclusive"), check


def page(rows: list, result: str, check: dict, cpu: dict, note: str = "") -> str:
    lines = ["# Dynamic sampling (DAPO) on the embedded default", "",
             f"`python experiments/dynamic_sampling.py` runs `{CONFIG}` with and without "
             "`runtime.dynamic_sampling=True`, once per seed, one run at a time.", "",
             f"CPU: {cpu['cpu']} ({cpu['isa']}), 2 cores." + (f" {note}" if note else ""), "",
             f"**Rule** (fixed before running): {RULE}.", "",
             f"**Verdict: {result}** (reward difference {stats.fmt(check['reward_diff_mean'], check['reward_diff_ci'])}; "
             f"informative tokens/s higher in every seed: {check['informative_tokens_per_s_higher_every_seed']})", "",
             "| arm | seed | start reward | final reward | wall-clock (s) | steps | informative tokens/s | "
             "trained tokens/s (learner) | draws / batch | capped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['seed']} | {r['start']:.3f} | {r['final']:.3f} | {r['seconds']:.0f} | "
                     f"{r['steps']} | {r['informative_tokens_per_s']:.0f} | {r['trained_tokens_per_s']:.0f} | "
                     f"{r['draws_per_batch']:.2f} | {r['capped']:.3f} |")
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        lines.append(f"| **{arm}** (mean ± 95% CI) | | | {stats.fmt(*stats.mean_ci([r['final'] for r in mine]))} | "
                     f"{np.mean([r['seconds'] for r in mine]):.0f} | | "
                     f"{stats.fmt(*stats.mean_ci([r['informative_tokens_per_s'] for r in mine]), digits=0)} | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--report_only", action="store_true", help="judge and write the page from finished runs")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--note", default="", help="a sentence for the page (e.g. what else ran on the machine)")
    ap.add_argument("extra", nargs="*", help="config overrides passed to every run (e.g. --config.train.steps=300)")
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    times_path = os.path.join(args.workdir, "seconds.json")
    seconds = json.load(open(times_path)) if os.path.exists(times_path) else {}
    rows = []
    for seed in range(args.seeds):
        for arm, flags in ARMS.items():
            d, name = os.path.join(args.workdir, f"{arm}_seed{seed}"), f"{arm}_seed{seed}"
            if not args.report_only and name not in seconds:
                seconds[name] = run(d, seed, [*flags, *args.extra])
                json.dump(seconds, open(times_path, "w"))
            rows.append(row(arm, seed, d, seconds[name]))
    result, check = verdict(rows)
    os.makedirs(args.out, exist_ok=True)
    cpu = cpu_kind()
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(page(rows, result, check, cpu, args.note))
    with open(os.path.join(args.out, "dynamic_sampling.json"), "w") as f:
        json.dump({"rule": RULE, "verdict": result, "check": check, "cpu": cpu, "extra": args.extra, "note": args.note,
                   "runs": rows},
                  f, indent=2)
    print(f"verdict: {result} {check}; wrote {args.out}/README.md")


if __name__ == "__main__":
    main()
