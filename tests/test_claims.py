"""The claims' verdict rules (`jaxrl_llm.research.claims`) and the reproduce entry point on a tiny model."""

import json

import numpy as np
import pytest
import scipy.stats

from jaxrl_llm.research import claims as C
from jaxrl_llm.research import reproduce


def _interval(x):
    x = np.asarray(x, float)
    return scipy.stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=scipy.stats.sem(x))


@pytest.mark.parametrize("diff,verdict", [([0.01, 0.02, 0.03], "holds"), ([-0.2, -0.21, -0.19], "fails"),
                                          ([-0.1, 0.1, 0.0], "inconclusive"), ([-0.04, -0.05, -0.06], "inconclusive")])
def test_noninferior_uses_the_paired_t_interval_against_the_margin(diff, verdict):
    b = np.array([0.5, 0.6, 0.7])
    check = C.noninferior(b + np.array(diff), b, "x")
    lo, hi = _interval(diff)
    assert check["verdict"] == verdict
    assert check["mean"] - check["ci95"] == pytest.approx(lo, abs=1e-3) and check["values"] == pytest.approx(diff)
    # the rule restated from scipy's interval
    assert verdict == ("holds" if lo > -C.MARGIN else "fails" if hi < -C.MARGIN else "inconclusive")


def test_greater_at_least_and_combine():
    assert C.greater([0.6, 0.7, 0.8], [0.5, 0.6, 0.71], "x")["verdict"] == "holds"
    assert C.greater([0.5, 0.6, 0.71], [0.6, 0.7, 0.8], "x")["verdict"] == "fails"
    assert C.greater([0.6, 0.5, 0.8], [0.5, 0.6, 0.7], "x")["verdict"] == "inconclusive"
    assert C.at_least([0.97, 0.98, 0.99], 0.95, "r")["verdict"] == "holds"
    assert C.at_least([0.5, 0.52, 0.51], 0.95, "r")["verdict"] == "fails"
    assert C.at_least([0.9, 1.0, 0.95], 0.95, "r")["verdict"] == "inconclusive"
    assert C.at_least([0.99], 0.95, "one seed")["verdict"] == "inconclusive"  # no interval from one value
    assert C.at_least([0.99, float("nan")], 0.95, "r")["verdict"] == "inconclusive"
    assert C.at_least([0.99, 0.99, 0.98, float("nan")], 0.95, "a failed seed")["verdict"] == "inconclusive"
    v = lambda *xs: [{"verdict": x} for x in xs]  # noqa: E731
    assert C.combine(v("holds", "holds")) == "holds"
    assert C.combine(v("holds", "inconclusive")) == "inconclusive"
    assert C.combine(v("inconclusive", "fails", "holds")) == "fails"


def _run(evals, **step_metrics):
    steps = [{"step": i + 1, **step_metrics} for i in range(10)]
    return {"name": "r", "config": {}, "steps": steps, "evals": [{"step": 10 * i, "eval/reward": r} for i, r in enumerate(evals)]}


def test_final_is_the_mean_of_the_last_three_evaluations_and_every_rule_finds_its_arms():
    assert C.final(_run([0.1, 0.2, 0.4, 0.5, 0.6])) == pytest.approx(0.5)
    assert C.mean_of("prox_time_s")(_run([0.1], prox_time_s=0.25)) == 0.25
    for claim in C.all_claims():  # synthetic runs for every arm: the rule reads only those
        runs = {a.label: [_run([0.5, 0.6 + 0.01 * s, 0.7], prox_time_s=0.01, step_time_s=0.1) for s in range(3)]
                for a in claim.arms}
        verdict = C.judge(claim, C.Results(runs, {"a3po_cost": {"prox_pass_s": [2.0] * 3, "a3po_prox_s": [1e-4] * 3}}))
        assert verdict["verdict"] in ("holds", "fails", "inconclusive") and verdict["checks"]
    # every claim cites its source: a paper, or the issue that set the project's own goal
    assert len(C.all_claims()) >= 5 and all(c.paper[1].startswith(("arXiv:", "issue #")) for c in C.all_claims())


TINY = ["--set", "model.hidden_size=16", "--set", "model.intermediate_size=32", "--set", "model.num_heads=2",
        "--set", "model.num_kv_heads=1", "--set", "model.head_dim=8", "--set", "model.num_layers=1",
        "--set", "warm_start.steps=5", "--set", "runtime.prompts_per_batch=2", "--set", "sampler.num_samples=4",
        "--set", "learner.num_minibatches=2", "--set", "task.eval_size=8"]


def test_every_claim_arm_builds_a_valid_config(tmp_path):
    runs, names = reproduce.expand(C.all_claims(), [0, 1], reproduce.settings(str(tmp_path), 2), reproduce.parse_set(TINY[1::2]))
    assert all(set(seeds) == {0, 1} for seeds in names.values())
    # arms with equal configs share runs: the sweep's a3po/decoupled_ppo at s=4 serve the A-3PO claim
    assert names["a3po_s4"][0] == "a3po_s4_seed0" and len(runs) == 2 * len({n[0] for n in names.values()})
    c = dict(runs)["small_actor_no_correction_seed1"]
    assert c.seed == 1 and c.objective.jackpot.correction == "none" and c.runtime.mode == "simulated"
    assert c.train.steps == 2 and c.learner.total_steps == 2 * c.learner.num_minibatches  # the schedule follows
    with pytest.raises(ValueError, match="key=value"):
        reproduce.parse_set(["model.hidden_size"])


def test_reproduce_writes_claims_with_seeds_and_verdicts_and_skips_finished_runs(tmp_path, capsys):
    args = [f"--workdir={tmp_path}", "--seeds=2", "--steps=2", "--claims=a3po_vs_decoupled_ppo,offpolicy_grpo_v10",
            "--cost_shapes=tiny", *TINY]
    rows = reproduce.main(args)
    out = capsys.readouterr().out
    assert "8 runs" in out and out.count("/8] ") == 8
    saved = json.load(open(tmp_path / "claims.json"))
    assert [r["claim"] for r in saved] == ["a3po_vs_decoupled_ppo", "offpolicy_grpo_v10"] == [r["claim"] for r in rows]
    for r in saved:
        assert r["seeds"] == [0, 1] and r["verdict"] in ("holds", "fails", "inconclusive") and r["arxiv"].startswith("arXiv:")
        assert all(len(a["values"]) == 2 for a in r["arms"].values()) and (tmp_path / r["figure"]).exists()
    a3po, cost = saved[0]["checks"], saved[0]["a3po_cost"]
    # the recompute pass over the interpolation, per seed, on the model the cost check names
    np.testing.assert_allclose(a3po[1]["values"], np.divide(cost["prox_pass_s"], cost["a3po_prox_s"]))
    assert a3po[1]["values"][0] > 0 and cost["seeds"] == [0, 1] and cost["shape"].startswith("small")
    md = (tmp_path / "claims.md").read_text()
    assert "| a3po_vs_decoupled_ppo | arXiv:2512.06547 |" in md and "## offpolicy_grpo_v10" in md
    assert "Proximal-policy cost measured at small" in md
    reproduce.main(args)  # every run finished: nothing runs again
    assert "/8]" not in capsys.readouterr().out
    page = tmp_path / "page"  # a committed page holding one claim; the other joins it
    page.mkdir()
    (page / "claims.json").write_text(json.dumps(saved[:1]))
    (page / "claims.md").write_text("# Claims in miniature (an earlier set)\n\n| claim | ...\n")
    reproduce.main([*args, "--claims=offpolicy_grpo_v10", f"--merge={page}"])
    merged = json.load(open(page / "claims.json"))
    assert [r["claim"] for r in merged] == ["a3po_vs_decoupled_ppo", "offpolicy_grpo_v10"]
    assert merged[1]["arms"] == saved[1]["arms"] and (page / merged[1]["figure"]).exists()
    md = (page / "claims.md").read_text()
    assert md.startswith("# Claims in miniature (an earlier set)\n\nAdded later (offpolicy_grpo_v10: 4 runs of 2 steps")
    assert "| offpolicy_grpo_v10 | arXiv:2505.22257 |" in md and "| a3po_vs_decoupled_ppo |" in md
    for bad in ("--claims=nope", "--seeds=0", "--seeds=1,1"):  # argparse errors name the flag
        with pytest.raises(SystemExit):
            reproduce.main([f"--workdir={tmp_path}", bad])


def test_a_failed_run_is_tried_again_and_a_finished_one_is_not(tmp_path, monkeypatch):
    calls = []

    def run(config, workdir, log=None):
        calls.append(workdir)
        if len(calls) == 1:
            raise RuntimeError("disk went away")
        return {"eval/reward": 0.5}

    monkeypatch.setattr(reproduce.experiment, "run", run)
    lines = []
    for _ in range(3):
        reproduce.run_all([("a_seed0", None)], str(tmp_path), log=lines.append)
    assert len(calls) == 2 and "failed: RuntimeError: disk went away" in lines[0]
    assert json.load(open(tmp_path / "runs" / "a_seed0" / "done.json")) == {"eval/reward": 0.5}
