"""Seeds and confidence intervals (`jaxrl_llm.research.stats`), through `report` and `sweep`."""

import importlib
import json
import re

import numpy as np
import pytest
import scipy.stats

from jaxrl_llm.research import report, stats, sweep


def test_t_quantiles_and_intervals_match_scipy():
    for df in stats._T975:
        assert stats.t975(df) == pytest.approx(scipy.stats.t.ppf(0.975, df), abs=1e-3)
    for df in (21, 33, 77, 500):  # between table entries: never narrower than the exact interval
        assert stats.t975(df) >= scipy.stats.t.ppf(0.975, df) - 1e-3
    x = [0.61, 0.72, 0.55, 0.70]
    mean, half = stats.mean_ci(x)
    lo, hi = scipy.stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=scipy.stats.sem(x))
    assert mean == pytest.approx(np.mean(x)) and half == pytest.approx((hi - lo) / 2, rel=1e-3)
    assert stats.mean_ci([0.5])[0] == 0.5 and np.isnan(stats.mean_ci([0.5])[1])
    assert stats.mean_ci([0.5, float("nan"), 0.7])[0] == pytest.approx(0.6)  # non-finite values skipped


# Held-out reward at steps 0, 10, 20 for two arms x three seeds.
CURVES = {("ppo", 0): [0.30, 0.60, 0.80], ("ppo", 1): [0.32, 0.50, 0.70], ("ppo", 2): [0.28, 0.70, 0.90],
          ("gepo", 0): [0.30, 0.40, 0.50], ("gepo", 1): [0.31, 0.45, 0.62], ("gepo", 2): [0.29, 0.35, 0.55]}


def _write_runs(root):
    dirs = []
    for (obj, seed), rewards in CURVES.items():
        d = root / f"{obj}_s4_seed{seed}"
        d.mkdir()
        config = {"seed": seed, "objective": {"name": obj}, "runtime": {"mode": "simulated", "max_staleness": 4}}
        (d / "config.json").write_text(json.dumps(config))
        lines = [{"step": s, "loss": 0.1, "tokens_per_s": 1000.0 + 100 * seed} for s in range(1, 21)]
        lines += [{"step": 10 * i, "eval/reward": r, "time_s": float(i)} for i, r in enumerate(rewards)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        dirs.append(str(d))
    return dirs


def test_report_groups_seeds_into_arms_with_intervals(tmp_path):
    dirs = _write_runs(tmp_path)
    md = open(report.write_report(dirs, str(tmp_path / "report"), threshold=0.6)).read()
    assert (tmp_path / "report" / "reward_bands.png").exists()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.split("# Runs")[0].splitlines() if line.startswith("| ") and "---" not in line}
    for obj in ("ppo", "gepo"):
        finals = [CURVES[obj, s][-1] for s in range(3)]
        lo, hi = scipy.stats.t.interval(0.95, 2, loc=np.mean(finals), scale=scipy.stats.sem(finals))
        seeds, final, to_threshold, tps = rows[f"{obj}_s4"]
        assert seeds == "3: 0, 1, 2"
        assert final == f"{np.mean(finals):.3f} ± {(hi - lo) / 2:.3f}"
        assert tps.startswith("1100 ± ")  # seeds' tokens/s 1000, 1100, 1200
    # steps to 0.6: ppo reaches it at 10, 20, 10 (all three), gepo at 20 for seed 1 only
    assert rows["ppo_s4"][2].startswith("13 ± ") and rows["ppo_s4"][2].endswith("(3/3)")
    assert rows["gepo_s4"][2] == "20 (1/3)"
    x, mean, half = stats.curve(stats.arms([report.load_run(d) for d in dirs])[0][1])
    assert list(x) == [0, 10, 20] and mean[1] == pytest.approx(0.6) and half[0] > 0


def test_sweep_runs_every_arm_for_each_seed():
    c = importlib.import_module("configs.staleness_sweep").get_config()
    c.sweep.update(dict(objectives="ppo,gepo", max_staleness="0,4", seeds="3"))
    grid = sweep.cells(c)
    assert [n for n, _ in grid][:3] == ["ppo_s0_seed0", "ppo_s0_seed1", "ppo_s0_seed2"] and len(grid) == 12
    assert {cfg.seed for _, cfg in grid} == {0, 1, 2} and {cfg.objective.name for _, cfg in grid} == {"ppo", "gepo"}
    c.sweep.seeds = "5,9"
    assert [cfg.seed for _, cfg in sweep.cells(c)][:2] == [5, 9]
    c.sweep.seeds = "1"  # one seed: the cell names of an unseeded sweep (earlier sweeps resume)
    assert [n for n, _ in sweep.cells(c)][0] == "ppo_s0"
    for bad in ("0", "x", "3,3"):
        c.sweep.seeds = bad
        with pytest.raises(ValueError, match=re.escape(f"sweep.seeds") + ".*" + re.escape(repr(bad))):
            sweep.cells(c)
