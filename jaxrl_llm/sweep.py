"""A grid of objectives x max_staleness: one run per cell, then one results table.

    python -m jaxrl_llm.sweep --config=configs/staleness_sweep.py --workdir=runs/sweep
    python -m jaxrl_llm.sweep --config=configs/staleness_sweep.py:lognormal \
        --config.sweep.objectives=ppo,gepo --config.sweep.max_staleness=0,8,32 --workdir=runs/sweep_ln

Each cell is an ordinary run in WORKDIR/<objective>_s<k> (so it resumes, and a finished cell
is skipped); WORKDIR/results.md holds the objective x staleness table of final held-out
reward, the per-run table, and the report's plots over all cells.
"""

from __future__ import annotations

import json
import os

from jaxrl_llm import experiment, objectives, report
from jaxrl_llm import validation as V
from jaxrl_llm.runtime import delay as delay_lib


RULES = {  # the `sweep` section of a sweep config (configs/staleness_sweep.py)
    "objectives": V.text(), "max_staleness": V.text(),  # comma-separated; parsed by `cells`
    "delay": V.one_of(*delay_lib.KINDS),
}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"sweep.max_staleness must be comma-separated integers; got {text!r}") from None


def cells(config) -> list[tuple[str, object]]:
    """(cell name, full run config) for every objective x max_staleness."""
    names = [n.strip() for n in str(config.sweep.objectives).split(",") if n.strip()]
    for n in names:
        objectives.get(n)  # unknown names list the registered ones
    out = []
    for name in names:
        for k in _ints(config.sweep.max_staleness):
            if k < 0:
                raise ValueError("a staleness sweep needs max_staleness >= 0 in every cell")
            c = config.copy_and_resolve_references()
            with c.unlocked():  # config_flags hands over a locked config
                del c["sweep"]
            c.objective.name = name
            c.runtime.max_staleness = k
            if config.sweep.delay != "fixed":  # a bounded random delay in [0.5, k] steps
                c.runtime.delay.update(dict(kind=config.sweep.delay if k else "none", min=0.5, max=float(max(k, 1))))
                c.runtime.step_seconds = 1.0
            experiment.validate(c)
            out.append((f"{name}_s{k}", c))
    return out


def pivot_table(rows: list[dict]) -> str:
    """Objectives down, max_staleness across, final held-out reward (best in brackets)."""
    objs = list(dict.fromkeys(r["objective"] for r in rows))
    ks = sorted({r["max_staleness"] for r in rows})
    by = {(r["objective"], r["max_staleness"]): r for r in rows}
    lines = ["| objective | " + " | ".join(f"s={k}" for k in ks) + " |", "|" + " --- |" * (len(ks) + 1)]
    for o in objs:
        cells_ = [f"{by[o, k]['eval_final']:.3f} ({by[o, k]['eval_best']:.3f})" if (o, k) in by else "" for k in ks]
        lines.append(f"| {o} | " + " | ".join(cells_) + " |")
    return "\n".join(lines) + "\n"


def run(config, workdir: str, log=print) -> list[dict]:
    grid = cells(config)  # validate every cell before the first one runs
    os.makedirs(workdir, exist_ok=True)
    dirs = []
    for i, (name, c) in enumerate(grid):
        log(f"[{i + 1}/{len(grid)}] {name}")
        d = os.path.join(workdir, name)
        experiment.run(c, d, log=lambda line: None)
        dirs.append(d)
    rows = [report.summary_row(report.load_run(d)) for d in dirs]
    report.write_report(dirs, os.path.join(workdir, "report"))
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write("# Final held-out eval/reward (best in brackets)\n\n" + pivot_table(rows) + "\n## Runs\n\n"
                + report.markdown_table(rows) + "\nPlots: report/report.md\n")
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def main(argv):
    from absl import logging

    from jaxrl_llm.main import CONFIG, WORKDIR  # the same --config / --workdir flags

    del argv
    logging.set_verbosity(logging.WARNING)
    experiment.set_cpu_devices(CONFIG.value.cpu_devices)
    run(CONFIG.value, WORKDIR.value)
    print(open(os.path.join(WORKDIR.value, "results.md")).read())


if __name__ == "__main__":
    from absl import app

    import jaxrl_llm.main  # noqa: F401  (defines the flags before parsing)

    app.run(main)
