"""Run the papers' headline claims in miniature on the embedded task and judge them.

    python -m jaxrl_llm.research.reproduce --workdir=runs/claims             # 5 seeds, 1,000 steps per run
    python -m jaxrl_llm.research.reproduce --workdir=runs/claims_quick --quick   # 300 steps per run
    python -m jaxrl_llm.research.reproduce --workdir=W --seeds=5 --claims=gepo_high_staleness,staleness_sweep

Every arm of every claim (`jaxrl_llm.research.claims`) runs for every seed as an ordinary run in
W/runs/<arm>_seed<n> (arms with equal configs run once; a finished run is skipped, an
interrupted one resumes). Runs of one seed share their warm start (W/warm_start) and compiled
programs (W/jax_cache). Writes W/claims.json, W/claims.md and W/figures/<claim>/reward_bands.png.
`--set key=value` (repeatable) overrides every run's config, e.g. a smaller model. `--merge=DIR`
also adds (or replaces) the judged claims in the page in DIR (its claims.json, claims.md and
figures), keeping the other claims it holds: a claim added later joins the committed page
without rerunning the rest.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import shutil
import time

import numpy as np

from jaxrl_llm.run import config as config_lib
from jaxrl_llm.run import experiment, xla
from jaxrl_llm.research import claims as C
from jaxrl_llm.research import cost, report, stats, sweep

QUICK_STEPS, FULL_STEPS = 300, 1000


def settings(workdir: str, steps: int) -> dict:
    """What every run shares: its length and evaluation cadence (ten evaluations, the claims'
    metric averages the last three), groups of 8 samples (half the default's 16: 87 runs of the
    quick set fit in 30 minutes on 2 cores), a larger held-out set (512 problems) for less noise,
    no TensorBoard or progress bar, the shared warm-start cache."""
    return {"train.steps": steps, "train.eval_every": max(steps // 10, 1), "train.save_every": max(steps // 2, 1),
            "sampler.num_samples": 8, "train.progress": False, "train.tensorboard": False, "task.eval_size": 512,
            "warm_start.cache_dir": os.path.join(workdir, "warm_start")}


def load_config(spec: str):
    """"configs/<name>.py[:arg]" -> that file's get_config(arg)."""
    path, _, arg = spec.partition(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return module.get_config(arg) if arg else module.get_config()


def arm_config(arm: C.Arm, seed: int, common: dict, extra: dict):
    c = load_config(arm.config)
    for key, value in list(arm.overrides) + list(common.items()) + list(extra.items()):
        *parents, leaf = key.split(".")
        target = c
        for part in parents:
            target = target[part]
        target[leaf] = value  # a FieldReference's users follow (learner.total_steps)
    c.seed = seed
    c = c.copy_and_resolve_references()
    config_lib.validate(c)
    return c


def parse_set(items) -> dict:
    out = {}
    for item in items or ():
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"--set takes key=value; got {item!r}")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def expand(selected, seeds, common, extra):
    """[(run dir name, config)] for every distinct arm x seed, and {arm label: its run dir
    name} (an arm whose config equals an earlier arm's shares that arm's runs)."""
    runs, names, by_key = [], {}, {}
    for seed in seeds:
        for claim in selected:
            for arm in claim.arms:
                c = arm_config(arm, seed, common, extra)
                key = c.to_json_best_effort(sort_keys=True)
                if key not in by_key:
                    by_key[key] = f"{arm.label}_seed{seed}"
                    runs.append((by_key[key], c))
                names.setdefault(arm.label, {})[seed] = by_key[key]
    return runs, names


def run_all(runs, workdir: str, log=print) -> None:
    t0 = time.time()
    for i, (name, c) in enumerate(runs):
        d = os.path.join(workdir, "runs", name)
        done = os.path.join(d, "done.json")
        if _finished(done):  # a failed run is tried again (resuming from its checkpoints)
            continue
        t = time.time()
        try:
            summary = experiment.run(c, d, log=lambda line: None)
        except Exception as e:  # one failed run does not lose the others: its arm reports nan
            summary = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {name} failed: {summary['error']}")
        os.makedirs(d, exist_ok=True)  # a run can fail before it made its directory
        with open(done, "w") as f:
            json.dump(summary, f, default=float)
        log(f"[{i + 1}/{len(runs)}] {name}: eval/reward {summary.get('eval/reward_start', float('nan')):.3f} -> "
            f"{summary.get('eval/reward', float('nan')):.3f} in {time.time() - t:.0f} s (total {time.time() - t0:.0f} s)")


def _finished(done: str) -> bool:
    try:
        with open(done) as f:
            return "error" not in json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def run_seconds(runs, workdir: str) -> float:
    """Wall-clock seconds the runs took (each run's own `time_s`, resumed parts not counted)."""
    total = 0.0
    for name, _ in runs:
        with open(os.path.join(workdir, "runs", name, "done.json")) as f:
            total += float(json.load(f).get("time_s", 0.0))
    return total


def a3po_cost(workdir: str, seeds, shapes: str = "qwen2.5-0.5b") -> dict:
    """A-3PO's proximal-policy cost at model size (`research.cost`), measured once per workdir
    and seed set (W/a3po_cost.json); `shapes="tiny"` measures a small model instead (tests)."""
    path = os.path.join(workdir, "a3po_cost.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("seeds") == list(seeds) and saved.get("shapes") == shapes:
            return saved
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    kw = {} if shapes == "qwen2.5-0.5b" else dict(shapes=TINY_SHAPES, rows=2, seq_len=64, repeats=5)
    out = dict(cost.prox_costs(seeds, **kw), seeds=list(seeds), shapes=shapes)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


TINY_SHAPES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8)


def _load(workdir: str, name: str) -> dict:
    d = os.path.join(workdir, "runs", name)
    try:
        return report.load_run(d)
    except FileNotFoundError:  # failed before its first record
        return dict(name=name, config={}, steps=[], evals=[])


def judge_all(selected, seeds, names, workdir, extra_measured) -> list[dict]:
    rows = []
    for claim in selected:
        labels = [a.label for a in claim.arms]
        runs = {label: [_load(workdir, names[label][s]) for s in seeds] for label in labels}
        res = C.Results(runs, extra_measured)
        row = {"claim": claim.key, "paper": claim.paper[0], "arxiv": claim.paper[1], "statement": claim.statement,
               "metric": claim.metric, "rule": claim.rule_text, "seeds": list(seeds),
               "arms": {label: dict(zip(("mean", "ci95"), stats.mean_ci(res.final(label))),
                                    values=[float(v) for v in res.final(label)],
                                    runs=[names[label][s] for s in seeds]) for label in labels}}
        row.update({k: extra_measured[k] for k in claim.measured}, **C.judge(claim, res))
        out = os.path.join(workdir, "figures", claim.key)
        os.makedirs(out, exist_ok=True)
        row["figure"] = os.path.relpath(report.plot_bands([r for label in labels for r in runs[label]], out), workdir)
        rows.append(row)
    return rows


def _fmt(m, h, digits=3):
    return stats.fmt(m, h, digits)


def markdown(rows: list[dict], header: str) -> str:
    out = [header, "", "| claim | paper | arms: final held-out reward (mean ± 95% CI) | seeds | verdict |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        arms = ("; ".join(f"{k} {_fmt(v['mean'], v['ci95'])}" for k, v in r["arms"].items())
                if len(r["arms"]) <= 4 else f"{len(r['arms'])} arms: the table in its section")
        out.append(f"| {r['claim']} | {r['arxiv']} | {arms} | {', '.join(map(str, r['seeds']))} | **{r['verdict']}** |")
    for r in rows:
        out += ["", f"## {r['claim']}: {r['verdict']}", "", f"*{r['paper']}* ({r['arxiv']})", "",
                f"Claim: {r['statement']}", "", f"Metric: {r['metric']}. Rule: `{r['rule']}`.", "",
                "| check | per seed | mean ± 95% CI | verdict |", "| --- | --- | --- | --- |"]
        for c in r["checks"]:  # 4 significant digits: rewards, ratios and seconds alike
            ci = f" ± {c['ci95']:.2g}" if np.isfinite(c["ci95"]) else ""
            out.append(f"| {c['check']} | {', '.join(f'{v:.4g}' for v in c['values'])} | "
                       f"{c['mean']:.4g}{ci} | {c['verdict']} |")
        if "a3po_cost" in r:
            c = r["a3po_cost"]
            out += ["", f"Proximal-policy cost measured at {c['shape']}: recompute pass "
                        f"{np.mean(c['prox_pass_s']):.2f} s, interpolation {np.mean(c['a3po_prox_s']) * 1e6:.0f} µs "
                        "(means over seeds)."]
        if r["claim"] == "staleness_sweep":
            out += ["", sweep_table(r)]
        out += ["", f"![{r['claim']}]({r['figure']})"]
    return "\n".join(out) + "\n"


def sweep_table(row: dict) -> str:
    lines = ["| objective | " + " | ".join(f"s={k}" for k in C.STALENESS) + " |",
             "|" + " --- |" * (len(C.STALENESS) + 1)]
    for o in C.SWEEP_OBJECTIVES:
        cells = [_fmt(row["arms"][f"{o}_s{k}"]["mean"], row["arms"][f"{o}_s{k}"]["ci95"]) for k in C.STALENESS]
        lines.append(f"| {o} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(rows: list[dict], header: str, workdir: str, page: str) -> None:
    """`rows` into the claims page in `page`: the claims it holds keep their rows, these replace
    theirs or are added; the page keeps its header and notes what joined it."""
    with open(os.path.join(page, "claims.json")) as f:
        old = json.load(f)
    with open(os.path.join(page, "claims.md")) as f:
        lines = f.read().split("\n| claim |")[0].strip()
    keys = {r["claim"] for r in rows}
    for key in keys:
        shutil.copytree(os.path.join(workdir, "figures", key), os.path.join(page, "figures", key), dirs_exist_ok=True)
    merged = [r for r in old if r["claim"] not in keys] + rows
    with open(os.path.join(page, "claims.json"), "w") as f:
        json.dump(merged, f, indent=1, default=float)
    joined = f"{', '.join(sorted(keys))}: {header.removeprefix('# Claims in miniature ').strip('()')}"
    with open(os.path.join(page, "claims.md"), "w") as f:
        f.write(markdown(merged, f"{lines}\n\nAdded later ({joined})."))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--seeds", default="5", help="a count N (seeds 0..N-1) or a comma-separated list")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per run instead of {FULL_STEPS}")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (overrides --quick)")
    ap.add_argument("--claims", default="", help="comma-separated claim keys (default: all)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="override every run's config")
    ap.add_argument("--cost_shapes", default="qwen2.5-0.5b", choices=("qwen2.5-0.5b", "tiny"),
                    help="model of the A-3PO cost check (tiny: a small one, for tests)")
    ap.add_argument("--merge", default="", help="a claims page directory to add these claims to (e.g. "
                                                "experiments/results/claims)")
    args = ap.parse_args(argv)
    known = {c.key: c for c in C.all_claims()}
    wanted = [k.strip() for k in args.claims.split(",") if k.strip()] or list(known)
    unknown = [k for k in wanted if k not in known]
    if unknown:
        ap.error(f"unknown claim(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    try:
        seeds = sweep.parse_seeds(args.seeds, what="--seeds")
    except ValueError as e:
        ap.error(str(e))
    selected = [known[k] for k in wanted]
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    runs, names = expand(selected, seeds, settings(args.workdir, steps), parse_set(args.set))  # all validated first
    os.makedirs(args.workdir, exist_ok=True)
    print(f"{len(runs)} runs ({len(selected)} claims, seeds {seeds}, {steps} steps each) in {args.workdir}/runs")
    t0, measured = time.time(), {}
    with xla.compilation_cache(os.path.join(args.workdir, "jax_cache")):
        run_all(runs, args.workdir)
    if any(c.key == "a3po_vs_decoupled_ppo" for c in selected):
        measured["a3po_cost"] = a3po_cost(args.workdir, seeds, args.cost_shapes)
    rows = judge_all(selected, seeds, names, args.workdir, measured)
    with open(os.path.join(args.workdir, "claims.json"), "w") as f:
        json.dump(rows, f, indent=1, default=float)
    header = (f"# Claims in miniature ({len(runs)} runs of {steps} steps, seeds {', '.join(map(str, seeds))}; "
              f"{run_seconds(runs, args.workdir):.0f} s of run time, {time.time() - t0:.0f} s this invocation)")
    with open(os.path.join(args.workdir, "claims.md"), "w") as f:
        f.write(markdown(rows, header))
    if args.merge:
        merge(rows, header, args.workdir, args.merge)
    for r in rows:
        print(f"{r['claim']}: {r['verdict']}")
    return rows


if __name__ == "__main__":
    main()
