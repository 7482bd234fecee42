"""`python -m jaxrl_llm.evaluate` (`run/evaluate.py`, `evaluation/sampled.py`): a trained run's
checkpoint and the HF directory exported from it evaluate alike; the greedy reward equals the one
the run logged at that version; answers, lengths and pass@1 agree with the drawn samples;
multi-turn tasks evaluate through their environment; bad requests are refused by name."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_llm import tasks
from jaxrl_llm.evaluate import request as evaluate
from jaxrl_llm.tasks import estimators, evaluation as sampled
from jaxrl_llm.rollout import backend
from jaxrl_llm.run import experiment, plan
from jaxrl_llm.store import export
from tests.test_distributed import ENV, ROOT
from tests.test_experiment import _tiny
from tests.test_math_dataset import _hf_config, tokenizer_dir  # noqa: F401  (a fixture)


def _config():
    c = _tiny("ppo")
    c.task.reward = "digits"  # partial credit, so a barely trained policy scores above 0
    c.warm_start.update(steps=60, target=0.0)
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("evaluate") / "run")
    experiment.run(_config(), d, log=lambda *_: None)
    return d


METRICS = ("reward", "pass@1", "pass@2", "pass@4", "maj@1", "maj@4", "answered", "length/mean", "length/max",
           "truncated", "greedy/reward", "problems")


def test_a_checkpoint_and_its_hf_export_evaluate_alike(run, tmp_path):
    req = evaluate.Request(workdir=run, n=4, ks=(1, 2, 4), success=0.5)
    got = evaluate.evaluate(req)
    assert got["out"] == os.path.join(run, "eval", "v2") and got["version"] == 2
    assert json.load(open(os.path.join(got["out"], "eval.json"))) == got
    assert "| pass@4 |" in open(os.path.join(got["out"], "eval.md")).read()
    logged = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    greedy = [r["eval/reward"] for r in logged if r.get("step") == 2 and "eval/reward" in r]
    assert got["greedy/reward"] == pytest.approx(greedy[-1], abs=1e-6)  # the run's own greedy evaluation
    assert got["problems"] == 8 and 0 < got["reward"] < 1 and got["pass@1"] <= got["pass@2"] <= got["pass@4"]
    export.export(run, str(tmp_path / "hf"))
    hf = evaluate.evaluate(evaluate.Request(hf_path=str(tmp_path / "hf"), n=4, ks=(1, 2, 4), success=0.5,
                                            out=str(tmp_path / "hf_eval")), config=_config())
    assert {k: hf[k] for k in METRICS} == {k: got[k] for k in METRICS}
    with pytest.raises(ValueError, match="already holds eval.json; pass --overwrite"):
        evaluate.evaluate(req)
    with pytest.raises(ValueError, match="pass --workdir .* or --hf_path"):
        evaluate.evaluate(evaluate.Request(workdir=run, hf_path=str(tmp_path / "hf")))
    with pytest.raises(ValueError, match="--hf_path: name where the results go with --out"):
        evaluate.evaluate(evaluate.Request(hf_path=str(tmp_path / "hf")))
    with pytest.raises(ValueError, match="--split='test' picks a dataset split; task 'arithmetic'"):
        evaluate.evaluate(evaluate.Request(workdir=run, split="test"))
    with pytest.raises(FileNotFoundError, match="no checkpoint of version 7"):
        evaluate.evaluate(evaluate.Request(workdir=run, version=7))


def test_drawn_samples_agree_with_the_report(run):
    """pass@1 is the success rate; each answer is the one the task's reward compared; lengths
    count the loss tokens; maj@n is the plain vote, recomputed here."""
    c = evaluate.sections(evaluate.Request(workdir=run))
    task, pol = tasks.make(c.task), evaluate.policy_lib.load(run)
    req = evaluate.Request(workdir=run, n=6)
    drawer, _ = evaluate.samplers(req, c, task, pol.cfg.replace(dtype=plan.auto_dtype()))
    prompts = task.eval_prompts()
    d = sampled.draw(drawer, pol.params, task, tasks.scorer(task, c.task), prompts, jax.random.key(3), chunk=3)
    assert d.rewards.shape == d.lengths.shape == d.truncated.shape == (8, 6) and len(d.answers) == 8
    for p, said, got in zip(prompts, d.answers, d.rewards):
        want = task.answer(p)
        for a, r in zip(said, got):  # digits reward: 1 exactly when the answer is the gold one
            assert (r == 1.0) == (a == want)
    r = sampled.report(d, (1, 6), success=1.0)
    assert r["pass@1"] == pytest.approx(np.mean(d.rewards >= 1.0))
    by_hand = []
    for said, got in zip(d.answers, d.rewards):
        votes = {a: said.count(a) for a in said if a is not None}
        top = [a for a, m in votes.items() if m == max(votes.values())] if votes else []
        by_hand.append(np.mean([any(g >= 1 for s, g in zip(said, got) if s == a) for a in top]) if top else 0.0)
    assert r["maj@6"] == pytest.approx(np.mean(by_hand))
    assert r["length/max"] <= drawer.cfg.max_new_tokens and 0 <= r["truncated"] <= 1
    assert estimators.pass_at_k(6, 0, 6) == 0.0


def test_a_multi_turn_task_evaluates_through_its_environment():
    c = tasks.default_config()
    c.update(name="tool_arithmetic", eval_size=3, tool_isolation="weak")
    task = tasks.make(c)
    cfg = plan.model_cfg(_tiny().model, task)
    holder = _tiny()
    holder.task = c
    try:
        drawer, _ = evaluate.samplers(evaluate.Request(n=2), evaluate.sections(evaluate.Request(), holder), task, cfg)
        params = __import__("jaxrl_llm.models", fromlist=["init_params"]).init_params(cfg, jax.random.key(0))
        d = sampled.draw(drawer, params, task, tasks.scorer(task, c), task.eval_prompts(), jax.random.key(0))
    finally:
        task.close()
    lo, hi = tasks.reward_range(task)
    assert d.rewards.shape == (3, 2) and d.answers is None and np.all((d.rewards >= lo) & (d.rewards <= hi))
    assert isinstance(drawer, backend.RolloutBackend) and drawer.mesh.size == 1


def test_the_command_line(run, tmp_path):
    out = str(tmp_path / "cli")
    cmd = [sys.executable, "-m", "jaxrl_llm.evaluate", f"--workdir={run}", "--n=2", "--k=1,2", f"--out={out}",
           "--temperature=0.5"]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "8 problems" in p.stdout and "pass@2=" in p.stdout and f"wrote {out}" in p.stdout
    assert json.load(open(os.path.join(out, "eval.json")))["sampling"]["temperature"] == 0.5
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "jaxrl_llm.evaluate: error: " in p.stderr and "--overwrite" in p.stderr


def test_an_hf_directory_on_a_local_dataset(tokenizer_dir, tmp_path):  # noqa: F811
    """A math dataset through an HF directory's own tokenizer: math-verify scores in its worker
    processes; maj@k votes on boxed answers; a missing split is refused by name."""
    c = _hf_config(tokenizer_dir, tmp_path)
    req = evaluate.Request(hf_path=str(tokenizer_dir), n=2, ks=(1, 2), out=str(tmp_path / "out"), max_new_tokens=4)
    got = evaluate.evaluate(req, config=c)
    assert got["problems"] == 2 and got["sampling"]["max_new_tokens"] == 4 and got["reward_failures"] == 0
    assert {"maj@2", "answered", "pass@2"} <= set(got) and 0 <= got["reward"] <= 1
    with pytest.raises(ValueError, match="no 'dev' split"):
        evaluate.evaluate(evaluate.Request(hf_path=str(tokenizer_dir), split="dev", out=str(tmp_path / "o2")), config=c)


def test_training_evaluates_pass_at_k_on_a_schedule(tmp_path):
    """`train.eval_samples=n`: every evaluation also reports pass@k and maj@k of n samples per
    held-out problem; with the exact reward (0 or 1) pass@1 is the sampled reward itself."""
    c = _tiny("ppo")
    c.train.update(steps=2, eval_every=2, save_every=2, eval_samples=4)
    experiment.run(c, str(tmp_path), log=lambda *_: None)
    evals = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"eval/reward"' in x]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@4", "eval/sampled_length"} <= set(e)
        assert e["eval/pass@1"] == pytest.approx(e["eval/sampled_reward"])
        assert e["eval/pass@1"] <= e["eval/pass@2"] <= e["eval/pass@4"] <= 1.0
