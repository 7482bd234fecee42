"""Plots and a comparison table from one or more run directories.

    python -m jaxrl_llm.research.report runs/a3po runs/gepo [--out report/] [--threshold 0.8]

Reads each WORKDIR/metrics.jsonl (and config.json for the run's objective, mode and
max_staleness) and writes PNGs (reward vs step and vs wall-clock, is_weight max/min, clipped
tokens, entropy, staleness histogram) and report.md, a markdown table comparing the runs.
Runs that differ only in `seed` form an arm: report.md then opens with one row per arm (final
reward, steps to a threshold, tokens/s as mean ± 95% CI) and reward_bands.png.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

import numpy as np

from jaxrl_llm.research import stats

PLOTS = ("reward_vs_step", "reward_vs_time", "is_weight", "mismatch", "clipped_tokens", "entropy", "staleness_hist")


def load_run(workdir: str) -> dict:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir!r} a run directory?")
    steps, evals = {}, {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            # Later records win: a resumed run re-logs nothing before its checkpoint.
            (evals if "eval/reward" in r else steps)[r["step"]] = r
    config = {}
    if os.path.exists(os.path.join(workdir, "config.json")):
        with open(os.path.join(workdir, "config.json")) as f:
            config = json.load(f)
    return dict(name=os.path.basename(os.path.normpath(workdir)), config=config,
                steps=[steps[k] for k in sorted(steps)], evals=[evals[k] for k in sorted(evals)])


def series(records: Sequence[dict], key: str):
    """(x = step, y) over records that have `key`."""
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return (np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)) if pts else (None, None)


def staleness_counts(records: Sequence[dict]) -> np.ndarray:
    """Token counts per staleness (in learner steps), summed over the run."""
    hists = [np.asarray(r["staleness/hist"], float) for r in records if r.get("staleness/hist")]
    if not hists:
        return np.zeros(0)
    out = np.zeros(max(len(h) for h in hists))
    for h in hists:
        out[: len(h)] += h
    return out


def ema(y: np.ndarray, decay: float = 0.9) -> np.ndarray:
    out, acc = np.empty_like(y), y[0]
    for i, v in enumerate(y):
        acc = decay * acc + (1 - decay) * v
        out[i] = acc
    return out


def summary_row(run: dict) -> dict:
    _, ev = series(run["evals"], "eval/reward")
    _, st = series(run["steps"], "staleness/mean")
    _, clip = series(run["steps"], "clip_frac")
    _, tps = series(run["steps"], "tokens_per_s")
    c = run["config"]
    last = run["evals"][-1] if run["evals"] else (run["steps"][-1] if run["steps"] else {})

    def mean(y):
        return float(np.mean(y)) if y is not None and len(y) else float("nan")

    return {
        "run": run["name"],
        "objective": c.get("objective", {}).get("name", "?"),
        "mode": c.get("runtime", {}).get("mode", "?"),
        "max_staleness": c.get("runtime", {}).get("max_staleness", "?"),
        "steps": int(run["steps"][-1]["step"]) if run["steps"] else 0,
        "eval_start": float(ev[0]) if ev is not None else float("nan"),
        "eval_final": float(ev[-1]) if ev is not None else float("nan"),
        "eval_best": float(ev.max()) if ev is not None else float("nan"),
        "staleness_mean": mean(st),
        "clip_frac": mean(clip),
        "tokens_per_s": mean(tps),
        "time_s": float(last.get("time_s", float("nan"))),
    }


def markdown_table(rows: Sequence[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    for r in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) and k not in ("tokens_per_s", "time_s")
                 else f"{v:.0f}" if isinstance(v, float) else str(v) for k, v in r.items()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _finish(fig, ax, path, xlabel, ylabel, title="", many=False, **grid) -> str:
    """Label, legend (beside the axes when there are many curves, not over them), save, close."""
    import matplotlib.pyplot as plt

    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, **grid)
    if many:
        fig.set_size_inches(10, 4.5)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(runs: Sequence[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, ax, name, xlabel, ylabel, title="", **grid):
        paths.append(_finish(fig, ax, os.path.join(out, f"{name}.png"), xlabel, ylabel, title, len(runs) > 4, **grid))

    colors = (plt.rcParams["axes.prop_cycle"].by_key()["color"] if len(runs) <= 10
              else [plt.cm.tab20(i % 20) for i in range(20)])
    for panel in (_plot_rewards, _plot_is_weight, _plot_mismatch, _plot_prox, _plot_clip_and_entropy):
        panel(plt, runs, colors, save)
    if any("episode/turns" in r for run in runs for r in run["steps"]):
        paths.append(plot_episodes(runs, out, colors))
    for name, prefix, panels in EXTRA_PANELS:
        if any(k.startswith(prefix) for run in runs for r in run["steps"] for k in r):
            paths.append(plot_panels(runs, out, colors, name, panels))
    _plot_staleness(plt, runs, colors, save)
    return paths


def _plot_rewards(plt, runs, colors, save) -> None:
    for xkey, name in (("step", "reward_vs_step"), ("time_s", "reward_vs_time")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, run in enumerate(runs):
            col = colors[i % len(colors)]
            ev = [r for r in run["evals"] if "eval/reward" in r]
            tr = [r for r in run["steps"] if "reward/mean" in r]
            if tr:
                x = np.array([r[xkey] for r in tr], float)
                y = np.array([r["reward/mean"] for r in tr], float)
                ax.plot(x, ema(y), color=col, alpha=0.45, lw=1)
            if ev:
                ax.plot([r[xkey] for r in ev], [r["eval/reward"] for r in ev], "o-", color=col, lw=2,
                        label=f"{run['name']} eval")
        save(fig, ax, name, "learner step" if xkey == "step" else "wall-clock (s)", "reward",
             "held-out eval/reward (markers); thin: training reward (EMA)")


def _plot_is_weight(plt, runs, colors, save) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        col = colors[i % len(colors)]
        for key, style in (("is_weight/max", "-"), ("is_weight/min", "--")):
            x, y = series(run["steps"], key)
            if x is not None:
                ax.plot(x, y, style, color=col, label=f"{run['name']} {key.split('/')[1]}")
    ax.set_yscale("log")
    save(fig, ax, "is_weight", "learner step", "importance weight (log scale)",
         "is_weight max (solid) / min (dashed)", which="both")


def _plot_mismatch(plt, runs, colors, save) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))  # learner/sampler numerics on fresh tokens (d = 0)
    for i, run in enumerate(runs):
        fresh = [r for r in run["steps"] if r.get("mismatch/fresh_tokens", 0) > 0]
        for key, style in (("mismatch/abs_logp_mean", "o-"), ("mismatch/abs_logp_max", "x--")):
            pts = [(r["step"], max(r[key], 1e-12)) for r in fresh if key in r]
            if pts:
                ax.plot(*zip(*pts), style, color=colors[i % len(colors)], label=f"{run['name']} {key.split('_')[-1]}")
    ax.set_yscale("log")
    save(fig, ax, "mismatch", "learner step", "|log pi_theta - log pi_behav| (log scale)",
         "learner vs sampler on fresh tokens: mean (o) / max (x); exact 0 drawn at 1e-12", which="both")


def _plot_prox(plt, runs, colors, save) -> None:
    """A-3PO's proximal approximation against the recomputed pi_prox (a3po.prox_metrics runs)."""
    prox_keys = sorted({k for run in runs for r in run["steps"] for k in r
                        if k.startswith("a3po_prox/abs_err/d")}, key=lambda k: int(k.split("/d")[-1].split("-")[0].rstrip("+")))
    if not prox_keys:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-.", (0, (1, 3)), (0, (5, 1))]
    for i, run in enumerate(runs):
        for j, key in enumerate(prox_keys):
            n_key = key.replace("/abs_err/", "/tokens/")
            pts = [(r["step"], max(r[key], 1e-12)) for r in run["steps"] if r.get(n_key, 0) > 0]
            if pts:
                ax.plot(*zip(*pts), linestyle=styles[j % len(styles)], color=colors[i % len(colors)],
                        label=f"{run['name']} {key.split('/')[-1]}")
    ax.set_yscale("log")
    save(fig, ax, "prox_approx", "learner step", "|log pi_prox approx - recomputed| (log scale)",
         "A-3PO proximal approximation error by staleness d", which="both")


def _plot_clip_and_entropy(plt, runs, colors, save) -> None:
    for key, name, label in (("clip_frac", "clipped_tokens", "fraction of tokens clipped"),
                             ("entropy", "entropy", "policy entropy (nats/token)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, run in enumerate(runs):
            x, y = series(run["steps"], key)
            if x is not None:
                ax.plot(x, y, color=colors[i % len(colors)], label=run["name"])
        save(fig, ax, name, "learner step", label)


def _plot_staleness(plt, runs, colors, save) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        counts = staleness_counts(run["steps"])
        if counts.size:
            ax.bar(np.arange(len(counts)) + i * width - 0.4 + width / 2, counts / counts.sum(), width,
                   color=colors[i % len(colors)], label=run["name"])
    longest = max((staleness_counts(r["steps"]).size for r in runs), default=0)
    ax.set_xticks(range(longest))
    save(fig, ax, "staleness_hist", "staleness (learner steps between sampling and training)",
         "fraction of trained tokens", "staleness histogram", axis="y")


def plot_episodes(runs: Sequence[dict], out: str, colors) -> str:
    """Multi-turn runs: turns and tool calls per episode, tool errors and timeouts, observation
    tokens (run totals so far, by step), and staleness by model turn (mean over the run)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = ((axes[0, 0], (("episode/turns", "-"), ("tools/calls_per_episode", "--")), "per episode",
               "turns (solid), tool calls (dashed)"),
              (axes[0, 1], (("tools/error_frac", "-"), ("tools/timeout_frac", "--")), "fraction of tool calls",
               "tool errors (solid), timeouts (dashed)"),
              (axes[1, 0], (("episode/obs_tokens", "-"),), "tokens per episode", "observation tokens"))
    for ax, keys, ylabel, title in panels:
        _lines(ax, runs, colors, keys, ylabel, title)
    ax = axes[1, 1]
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        per = [r["staleness/turn"] for r in run["steps"] if r.get("staleness/turn")]
        if per:
            m = np.nanmean(np.array([[np.nan if v is None else v for v in p] for p in per], float), 0)
            ax.bar(np.arange(len(m)) + i * width - 0.4 + width / 2, np.nan_to_num(m), width,
                   color=colors[i % len(colors)], label=run["name"])
            ax.set_xticks(range(len(m)))
    ax.set(xlabel="model turn (0: first)", ylabel="mean staleness (steps)", title="staleness by turn")
    ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "episodes.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lines(ax, runs, colors, keys, ylabel: str, title: str) -> None:
    """One panel: each run's `keys` ((metric, line style), ...) over learner steps."""
    for i, run in enumerate(runs):
        for key, style in keys:
            x, y = series(run["steps"], key)
            if x is not None:
                ax.plot(x, y, style, color=colors[i % len(colors)], label=f"{run['name']} {key.split('/')[1]}")
    ax.set(xlabel="learner step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)


# name, the metric prefix that calls for it, and its panels ((key, line style), ...), y label, title)
EXTRA_PANELS = (
    ("gateway", "gateway/", (
        ((("gateway/sessions_closed", "-"), ("gateway/sessions_timed_out", "--"), ("gateway/sessions_dropped", ":"),
          ("gateway/sessions_branched", "-.")), "sessions so far", "closed (solid), timed out (dashed), dropped "
                                                                  "(dotted), branched (dash-dot)"),
        ((("gateway/request_p50_ms", "-"), ("gateway/request_p99_ms", "--")), "ms", "request latency p50 (solid), "
                                                                                    "p99 (dashed)"),
        ((("gateway/slot_occupancy", "-"),), "decoded tokens / (slots x steps)", "decode slot occupancy so far"))),
    ("moe", "moe/", (
        ((("moe/routing_differs_tokens", "-"), ("moe/routing_differs_pairs", "--")), "fraction of trained tokens",
         "learner top k != sampler's experts: any layer (solid), per layer (dashed)"),
        ((("moe/expert_load_max_over_mean", "-"), ("moe/expert_load_worst_layer", "--")), "busiest / mean share",
         "expert load: mean over layers (solid), worst layer (dashed)"))),
)


def plot_panels(runs: Sequence[dict], out: str, colors, name: str, panels) -> str:
    """One figure of line panels over learner steps (`EXTRA_PANELS`): `<out>/<name>.png`."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (keys, ylabel, title) in zip(axes[0], panels):
        _lines(ax, runs, colors, keys, ylabel, title)
        ax.title.set_fontsize(9)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bands(runs: Sequence[dict], out: str) -> str:
    """Each arm's mean held-out reward over its seeds with a 95% confidence band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = stats.arms(runs)
    many = len(groups) > 4  # bands fainter
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, group) in enumerate(groups):
        x, mean, half = stats.curve(group)
        if x.size:
            color = plt.cm.tab20(i % 20) if len(groups) > 10 else f"C{i}"
            ax.plot(x, mean, "o-", lw=2, color=color, label=f"{label} (n={len(group)})")
            if len(group) > 1:
                ax.fill_between(x, mean - half, mean + half, color=color, alpha=0.08 if many else 0.2)
    return _finish(fig, ax, os.path.join(out, "reward_bands.png"), "learner step", "held-out eval/reward",
                   "mean over seeds, 95% confidence band", many)


def write_report(workdirs: Sequence[str], out: str, threshold: float | None = None) -> str:
    """Plots + report.md for `workdirs` into `out`; returns the markdown path. Runs that differ
    only in their seed are also summarised per arm (mean ± 95% CI, `jaxrl_llm.research.stats`)."""
    runs = [load_run(w) for w in workdirs]
    os.makedirs(out, exist_ok=True)
    paths = plot(runs, out)
    seeded = any(len(g) > 1 for _, g in stats.arms(runs))
    md = os.path.join(out, "report.md")
    with open(md, "w") as f:
        if seeded:
            rows, threshold = stats.arm_rows(runs, threshold)
            f.write("# Arms (mean ± 95% CI over seeds)\n\n" + stats.arms_table(rows, threshold) + "\n")
            paths.insert(0, plot_bands(runs, out))
        f.write("# Runs\n\n" + markdown_table([summary_row(r) for r in runs]) + "\n")
        for p in paths:
            f.write(f"![{os.path.basename(p)}]({os.path.basename(p)})\n\n")
    return md


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdirs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", default="", help="output directory (default: WORKDIR/report for one run, "
                                             "./report for several)")
    ap.add_argument("--threshold", type=float, default=None,
                    help="seeded arms: report steps to this eval/reward (default: 90%% of the best arm's final)")
    args = ap.parse_args(argv)
    out = args.out or (os.path.join(args.workdirs[0], "report") if len(args.workdirs) == 1 else "report")
    md = write_report(args.workdirs, out, args.threshold)
    print(open(md).read().split("\n\n![")[0])
    print(f"wrote {md} and {len(PLOTS)} plots in {out}")


if __name__ == "__main__":
    main()
