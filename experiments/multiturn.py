"""The embedded multi-turn task over seeds: does RL raise held-out reward with the calculator tool?

    python experiments/multiturn.py --workdir=runs/multiturn            # 3 seeds, one after another
    python experiments/multiturn.py --workdir=runs/multiturn --report_only

Each seed is an ordinary run of configs/tool_arithmetic.py (warm start included: no cache), run
alone and timed from the command's start to its end. The rule (`RULE`) was fixed before the first
run. Writes experiments/results/multiturn/README.md with the table, the verdict, the CPU kind and
the run report's plots (reward, turns and tool calls, tool errors, staleness by turn).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.common import cpu_kind  # noqa: E402
from jaxrl_llm.research import report  # noqa: E402

CONFIG = "configs/tool_arithmetic.py"
GAIN, BUDGET_S = 0.05, 900.0
RULE = (f"holds when every seed's final held-out reward (greedy, 128 problems) exceeds its start (before RL, "
        f"after the warm start) by at least {GAIN} and every seed's run, warm start included, takes at most "
        f"{BUDGET_S:.0f} s wall-clock on this machine")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "multiturn")


def run_seed(workdir: str, seed: int, extra: list) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxrl_llm.main", f"--config={CONFIG}", f"--workdir={workdir}",
                    f"--config.seed={seed}", *extra], check=True)
    return time.perf_counter() - t


def page(rows: list, verdict: str, report_md: str) -> str:
    lines = ["# Multi-turn with a calculator tool: held-out reward before and after RL", "",
             f"`python experiments/multiturn.py` runs `{CONFIG}` (products of three 2-digit numbers; the model "
             "may call `<calc>a*b</calc>` and receives the value as an observation) once per seed.", "",
             f"CPU: {rows[0]['cpu']} ({rows[0]['isa']}), 2 cores.", "", f"**Rule** (fixed before running): {RULE}.",
             "", f"**Verdict: {verdict}**", "",
             "| seed | start reward | end reward | gain | wall-clock (s) | steps | turns / episode | tool calls / episode "
             "| tool error frac |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['start']:.3f} | {r['end']:.3f} | {r['end'] - r['start']:+.3f} | "
                     f"{r['seconds']:.0f} | {r['steps']} | {r['turns']:.2f} | {r['calls']:.2f} | {r['errors']:.3f} |")
    body = open(report_md).read().split("# Runs", 1)[-1]
    return "\n".join(lines) + "\n\n## Runs (the run report)" + body


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--report_only", action="store_true", help="judge and write the page from finished runs")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("extra", nargs="*", help="config overrides passed to every run (e.g. --config.train.steps=20)")
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    times_path = os.path.join(args.workdir, "seconds.json")
    seconds = json.load(open(times_path)) if os.path.exists(times_path) else {}
    dirs = [os.path.join(args.workdir, f"seed{s}") for s in range(args.seeds)]
    if not args.report_only:
        for s, d in enumerate(dirs):
            seconds[str(s)] = run_seed(d, s, args.extra)
            json.dump(seconds, open(times_path, "w"))
    rows = []
    for s, d in enumerate(dirs):
        run = report.load_run(d)
        evals = [r for r in run["evals"] if "eval/reward" in r]
        last = run["steps"][-1] if run["steps"] else {}
        rows.append(dict(seed=s, start=evals[0]["eval/reward"], end=evals[-1]["eval/reward"], steps=last.get("step", 0),
                         seconds=seconds.get(str(s), float("nan")), turns=last.get("episode/turns", float("nan")),
                         calls=last.get("tools/calls_per_episode", float("nan")),
                         errors=last.get("tools/error_frac", float("nan")), **cpu_kind()))
    ok = all(r["end"] - r["start"] >= GAIN and r["seconds"] <= BUDGET_S for r in rows)
    verdict = "holds" if ok else "does not hold"
    md = report.write_report(dirs, args.out)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(page(rows, verdict, md))
    os.remove(md)
    with open(os.path.join(args.out, "multiturn.json"), "w") as f:
        json.dump({"rule": RULE, "verdict": verdict, "seeds": rows}, f, indent=2)
    for r in rows:
        print(f"seed {r['seed']}: {r['start']:.3f} -> {r['end']:.3f} in {r['seconds']:.0f} s")
    print(f"verdict: {verdict}; wrote {args.out}/README.md")


if __name__ == "__main__":
    main()
