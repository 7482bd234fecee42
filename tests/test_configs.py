"""Every shipped config loads, validates and (shrunk) runs; the sweep writes one table."""

import glob
import importlib
import json
import os

import numpy as np
import pytest

from jaxrl_llm.run import experiment
from jaxrl_llm.research import sweep
from tests.test_experiment import shrink

CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob("configs/*.py") if not p.endswith("__init__.py"))
# tool_arithmetic runs in tests/test_multiturn.py, agent_calculator and agent_math (on a local dataset and
# model) in tests/test_agents.py (the same configs, shrunk)
RUN_CONFIGS = [n for n in CONFIGS
               if n not in ("objectives", "staleness_sweep", "tool_arithmetic", "agent_calculator", "agent_math")]


def _shrink(c, steps=3):
    c = shrink(c, steps, eval_every=steps)
    c.train.tensorboard = False
    return c


def test_all_config_files_are_covered():
    assert set(RUN_CONFIGS) >= {"default", "ppo", "decoupled_ppo", "a3po", "gspo", "gepo", "offpolicy_grpo",
                                "jackpot", "jackpot_small_actor", "gepo_hetero"}


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_config_runs(name, tmp_path):
    c = _shrink(importlib.import_module(f"configs.{name}").get_config())
    summary = experiment.run(c, str(tmp_path), log=lambda *_: None)
    assert summary["version"] == 3
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert len(steps) == 3 and all(np.isfinite(r["loss"]) for r in steps)
    if name == "jackpot_small_actor":
        assert "actor/distill_kl" in steps[-1] and "eval/actor_reward" in open(tmp_path / "metrics.jsonl").read()


def test_offpolicy_grpo_config_refreshes_every_ten_steps(tmp_path):
    c = _shrink(importlib.import_module("configs.offpolicy_grpo").get_config(), steps=12)
    experiment.run(c, str(tmp_path), log=lambda *_: None)
    stale = [json.loads(line)["staleness/max"] for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert stale == list(range(10)) + [0, 1]


def test_gepo_hetero_realises_bounded_lognormal_staleness():
    c = importlib.import_module("configs.gepo_hetero").get_config("16")
    from jaxrl_llm.runtime import orchestrator

    model = orchestrator._delay(c.runtime)
    d = model.steps(np.random.default_rng(0), c.runtime.step_seconds, c.runtime.max_staleness, size=20_000)
    # 60 s .. 1800 s at 28.125 s/step -> 3 .. 64 steps, capped at 16; median sqrt(60*1800) s -> 12 steps
    assert d.min() == 3 and d.max() == 16 and np.median(d) == 12


def test_staleness_sweep_writes_one_table(tmp_path):
    c = _shrink(importlib.import_module("configs.staleness_sweep").get_config(), steps=3)
    c.sweep.update(dict(objectives="ppo,gepo", max_staleness="0,2"))
    c.lock()  # as config_flags hands it over
    rows = sweep.run(c, str(tmp_path), log=lambda *_: None)
    assert [(r["objective"], r["max_staleness"]) for r in rows] == [("ppo", 0), ("ppo", 2), ("gepo", 0), ("gepo", 2)]
    for r in rows:  # fixed delay: every batch is min(k, version) steps stale
        recs = [json.loads(line) for line in open(tmp_path / r["run"] / "metrics.jsonl") if '"loss"' in line]
        assert [x["staleness/max"] for x in recs] == [min(r["max_staleness"], v) for v in range(3)]
    table = open(tmp_path / "results.md").read()
    line = [x for x in table.splitlines() if x.startswith("| gepo |")][0]
    assert f"{rows[3]['eval_final']:.3f}" in line.split("|")[3]
    assert os.path.exists(tmp_path / "report" / "staleness_hist.png")
    with pytest.raises(ValueError, match="unknown objective 'ppo3'"):
        c.sweep.objectives = "ppo3"
        sweep.cells(c)
