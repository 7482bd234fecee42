"""A grid of objectives x max_staleness (x seeds): one run per cell, then one results table.

    python -m jaxrl_llm.research.sweep --config=configs/staleness_sweep.py --workdir=runs/sweep --seeds=3
    python -m jaxrl_llm.research.sweep --config=configs/staleness_sweep.py:lognormal \
        --config.sweep.objectives=ppo,gepo --config.sweep.max_staleness=0,8,32 --workdir=runs/sweep_ln

Each cell is an ordinary run in WORKDIR/<objective>_s<k> (with several seeds
WORKDIR/<objective>_s<k>_seed<n>; so it resumes, and a finished cell is skipped).
Cells of one seed warm-start once (WORKDIR/warm_start) and all share compiled programs
(WORKDIR/jax_cache). `--seeds=N` (or `--config.sweep.seeds`) runs every arm for N seeds from `config.seed`, or for
the listed ones (`--seeds=0,7,9`). WORKDIR/results.md holds the objective x staleness table
of final held-out reward (mean ± 95% CI over seeds), the per-arm table (`jaxrl_llm.research.stats`), the
per-run table, and the report's plots over all cells (reward_bands.png: mean and 95% band).
"""

from __future__ import annotations

import json
import os

from jaxrl_llm.run import config as config_lib
from jaxrl_llm import objectives
from jaxrl_llm.run import experiment, xla
from jaxrl_llm import validation as V
from jaxrl_llm.research import report, stats
from jaxrl_llm.runtime import delay as delay_lib


SECTION = V.Section(  # the `sweep` section of a sweep config (configs/staleness_sweep.py)
    objectives=("ppo,decoupled_ppo,a3po,gepo,m2po", V.text()),  # comma-separated; parsed by `cells`
    max_staleness=("0,4,16", V.text()),
    delay=("fixed", V.one_of(*delay_lib.KINDS)),
    seeds=("1", V.text()),  # N (seeds config.seed .. config.seed + N - 1) or a comma-separated list
)
RULES = SECTION.rules


def config_rules() -> dict:
    """The experiment's declared constraints plus this section's (`sweep.*`)."""
    return {**config_lib.rules(), **V.flatten(RULES, "sweep.")}


def validate(config) -> None:
    """This section's constraints, then the experiment's (every cell is validated again)."""
    V.raise_all(V.check(config, V.flatten(RULES, "sweep.")))
    config_lib.validate(config)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"sweep.max_staleness must be comma-separated integers; got {text!r}") from None


def parse_seeds(text, first: int = 0, what: str = "sweep.seeds") -> list[int]:
    """A count N (seeds first .. first + N - 1) or a comma-separated list of distinct seeds."""
    text = str(text).strip()
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a count or comma-separated integers; got {text!r}") from None
    if "," not in text:
        if len(values) != 1 or values[0] < 1:
            raise ValueError(f"{what} as a count must be >= 1; got {text!r}")
        values = [first + i for i in range(values[0])]
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{what} must list distinct seeds; got {text!r}")
    return values


def seeds(config) -> list[int]:
    """`sweep.seeds`: a count N (config.seed onwards) or a comma-separated list of seeds."""
    return parse_seeds(config.sweep.get("seeds", "1"), config.seed)


def cells(config) -> list[tuple[str, object]]:
    """(cell name, full run config) for every objective x max_staleness x seed."""
    V.raise_all(V.check(config, V.flatten(RULES, "sweep.")))
    runs_seeds = seeds(config)
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
            for seed in runs_seeds:
                one = c.copy_and_resolve_references()
                one.seed = seed
                config_lib.validate(one)
                out.append((f"{name}_s{k}" + (f"_seed{seed}" if len(runs_seeds) > 1 else ""), one))
    return out


def pivot_table(rows: list[dict]) -> str:
    """Objectives down, max_staleness across, final held-out reward: mean ± 95% CI over a
    cell's seeds (one seed: the value, its best in brackets)."""
    objs = list(dict.fromkeys(r["objective"] for r in rows))
    ks = sorted({r["max_staleness"] for r in rows})
    by: dict = {}
    for r in rows:
        by.setdefault((r["objective"], r["max_staleness"]), []).append(r)

    def cell(group):
        if len(group) == 1:
            return f"{group[0]['eval_final']:.3f} ({group[0]['eval_best']:.3f})"
        return stats.fmt(*stats.mean_ci([r["eval_final"] for r in group])) + f" (n={len(group)})"

    lines = ["| objective | " + " | ".join(f"s={k}" for k in ks) + " |", "|" + " --- |" * (len(ks) + 1)]
    for o in objs:
        lines.append(f"| {o} | " + " | ".join(cell(by[o, k]) if (o, k) in by else "" for k in ks) + " |")
    return "\n".join(lines) + "\n"


def run(config, workdir: str, log=print) -> list[dict]:
    grid = cells(config)  # validate every cell before the first one runs
    os.makedirs(workdir, exist_ok=True)
    dirs = []
    # Cells of one seed share their warm start, and all cells their compiled programs.
    with xla.compilation_cache(os.path.join(workdir, "jax_cache")):
        for i, (name, c) in enumerate(grid):
            log(f"[{i + 1}/{len(grid)}] {name}")
            d = os.path.join(workdir, name)
            c.warm_start.cache_dir = c.warm_start.cache_dir or os.path.join(workdir, "warm_start")
            experiment.run(c, d, log=lambda line: None)
            dirs.append(d)
    loaded = [report.load_run(d) for d in dirs]
    rows = [report.summary_row(r) for r in loaded]
    report.write_report(dirs, os.path.join(workdir, "report"))
    arm_rows, threshold = stats.arm_rows(loaded)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write("# Final held-out eval/reward (mean ± 95% CI over seeds; one seed: best in brackets)\n\n"
                + pivot_table(rows) + "\n## Arms\n\n" + stats.arms_table(arm_rows, threshold)
                + "\n## Runs\n\n" + report.markdown_table(rows) + "\nPlots: report/report.md\n")
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def main(argv):
    from absl import logging

    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    if _SEEDS.value:
        config.sweep.seeds = _SEEDS.value
    xla.set_cpu_devices(config.cpu_devices)
    run(config, _WORKDIR.value)
    print(open(os.path.join(_WORKDIR.value, "results.md")).read())


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", "configs/staleness_sweep.py", "sweep config file")
    _WORKDIR = flags.DEFINE_string("workdir", "runs/sweep", "one run directory per cell, results.md")
    _SEEDS = flags.DEFINE_string("seeds", None, "seeds per arm: a count N or a comma-separated list "
                                                "(overrides --config.sweep.seeds)")
    app.run(main)
