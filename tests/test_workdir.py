"""Every input of a real run checked at start-up (dataset, weight files, sampling options), resumes
that changed (refused, or allowed with the flag and recorded), one run per workdir."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from jaxrl_llm import models
from jaxrl_llm.run import experiment
from jaxrl_llm.run import plan as plan_lib
from jaxrl_llm.store import workdir as workdir_lib
from tests import hf_fixtures
from tests.test_experiment import _tiny
from tests.test_math_dataset import TEST, TRAIN, tokenizer_dir  # noqa: F401  (a fixture)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _math(path, model_dir, **over):
    c = _tiny("ppo")
    c.task.update(dict(name="math", path=str(path), eval_size=2, max_answer_len=8, eval_holdout=0.5))
    c.model.hf_path = str(model_dir)
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


ROWS = [{"question": q, "answer": a} for q, a in TRAIN]


def _empty_dataset(tmp, model):
    d = tmp / "empty"
    d.mkdir()
    (d / "train.jsonl").write_text("")
    (d / "test.jsonl").write_text("\n")
    return _math(d, model), r"'train' split's file\(s\) .*empty/train.jsonl hold no rows"


def _filtered_dataset(tmp, model):
    return (_math(_jsonl(tmp / "d.jsonl", ROWS), model, **{"task.max_prompt_len": 3}),
            r"d.jsonl': none of the 2 'train' problems fits task.max_prompt_len=3")


def _numeric_question(tmp, model):
    return (_math(_jsonl(tmp / "n.jsonl", [{"question": 7, "answer": "#### 7"}] * 4), model),
            r"n.jsonl': column 'question' \(task.question_key\) of the 'train' split must hold text; row 0 holds int")


def _truncated_weights(tmp, model):
    bad = tmp / "truncated"
    shutil.copytree(model, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    return (_math(_jsonl(tmp / "d.jsonl", ROWS), bad),
            r"truncated/model.safetensors is truncated: its header declares \d+ bytes, the file holds \d+")


def _other_models_weights(tmp, model):
    other = tmp / "other"
    shutil.copytree(model, other)
    vocab = models.load_config(str(model)).vocab_size
    hf_fixtures.save(hf_fixtures.make_hf_model("qwen2_tied", vocab=vocab, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2), str(tmp / "small"))
    shutil.copy(tmp / "small" / "model.safetensors", other / "model.safetensors")  # config.json stays the big one's
    return (_math(_jsonl(tmp / "d.jsonl", ROWS), other),
            r"weights in .*other are not those of its config.json's model: model.embed_tokens.weight in "
            r".*other/model.safetensors has shape \[\d+, 32\], this model needs \d+ values")


def _top_k_beyond_vocab(tmp, model):
    return (_math(_jsonl(tmp / "d.jsonl", ROWS), model, **{"sampler.top_k": 100_000}),
            r"sampler.top_k=100000 exceeds the model's vocabulary of \d+ tokens")


def _beyond_positions(tmp, model):
    return (_math(_jsonl(tmp / "d.jsonl", ROWS), model, **{"task.max_answer_len": 100_000}),
            r"the longest prompt \(\d+ tokens\) \+ 100000 new tokens .* exceed the \d+ positions of .*"
            r"\(max_position_embeddings\)")


@pytest.mark.parametrize("case", [_empty_dataset, _filtered_dataset, _numeric_question, _truncated_weights,
                                  _other_models_weights, _top_k_beyond_vocab, _beyond_positions])
def test_bad_inputs_are_named_at_start_up_and_the_workdir_holds_only_the_lock(case, tokenizer_dir, tmp_path):  # noqa: F811
    c, match = case(tmp_path, tokenizer_dir)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        experiment.run(c, str(run), log=lambda *_: None)
    assert os.listdir(run) == [workdir_lib.LOCK]


def test_an_evaluation_set_smaller_than_asked_is_used_whole_with_one_warning(tokenizer_dir, tmp_path):  # noqa: F811
    d = tmp_path / "split"
    d.mkdir()
    _jsonl(d / "train.jsonl", ROWS)
    _jsonl(d / "test.jsonl", [{"question": q, "answer": a} for q, a in TEST])
    p = plan_lib.resolve(_math(d, tokenizer_dir, **{"task.eval_size": 50, "task.eval_holdout": 0.0}))
    assert len(p.task.eval_prompts()) == 2
    assert p.warnings == ("task.eval_size=50 but the 'test' evaluation set holds 2 usable problems: evaluating on all 2",)


def test_resumes_with_changes_are_refused_or_allowed_and_recorded(tmp_path):
    wd = str(tmp_path)
    experiment.run(_tiny(), wd, log=lambda *_: None)
    before = sorted(os.listdir(os.path.join(wd, "checkpoints")))

    def resume(**over):
        c = _tiny()
        for key, value in over.items():
            section, field = key.split(".")
            c[section][field] = value
        lines = []
        experiment.run(c, wd, log=lines.append)
        return lines

    with pytest.raises(ValueError, match=r"changed settings: learner.lr: 0.0001 -> 0.001; objective.name: 'a3po' -> "
                                         r"'ppo'\. Pass --config.train.allow_changes=True"):
        resume(**{"objective.name": "ppo", "learner.lr": 1e-3})
    with pytest.raises(ValueError, match=r"different model; cannot resume: model hidden_size: 16 -> 24"):
        resume(**{"model.hidden_size": 24, "train.allow_changes": True})
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before  # nothing restored, moved or written
    lines = resume(**{"train.steps": 3})  # free: only the cosine schedule's stretch is said
    assert any("train.steps: 2 -> 3 (the cosine" in x for x in lines)
    resume(**{"train.steps": 4, "objective.name": "ppo", "train.allow_changes": True})
    records = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    said = [r for r in records if "config_changes" in r]
    assert [r["step"] for r in said] == [2, 3] and "objective.name: 'a3po' -> 'ppo'" in said[1]["config_changes"]
    history = [json.loads(x) for x in open(os.path.join(wd, workdir_lib.HISTORY))]
    assert [h["version"] for h in history] == [0, 2, 3]
    assert history[-1]["config"]["objective.name"] == "ppo" and "objective.name: 'a3po' -> 'ppo'" in history[-1]["changes"]
    # model.dtype=auto is recorded as it resolved here: a workdir of the old float32 default resumes unchanged.
    assert {h["config"]["model.dtype"] for h in history} == {"float32"}
    # A workdir from before a setting existed resumes: the new setting is recorded, not refused.
    del history[-1]["config"]["model.matmul_precision"]
    with open(os.path.join(wd, workdir_lib.HISTORY), "w") as f:
        f.write("".join(json.dumps(h) + "\n" for h in history))
    resume(**{"train.steps": 5, "objective.name": "ppo"})
    last = json.loads(open(os.path.join(wd, workdir_lib.HISTORY)).read().splitlines()[-1])
    assert last["changes"][0] == "model.matmul_precision: new setting -> 'default'" and len(last["changes"]) == 2


def test_the_token_is_never_written_and_a_new_one_resumes(tmp_path, monkeypatch):
    wd = str(tmp_path)
    c = _tiny()
    c.runtime.remote.token = "s3cret-token"
    argv = ["main.py", "--config.runtime.remote.token=s3cret-token", "--token", "s3cret-token"]
    monkeypatch.setattr(sys, "argv", argv)
    experiment.run(c, wd, log=lambda *_: None)
    for name in ("config.json", workdir_lib.HISTORY, workdir_lib.LOCK):
        text = open(os.path.join(wd, name)).read()
        assert "s3cret-token" not in text and workdir_lib.REDACTED in text, name
    assert json.load(open(os.path.join(wd, "config.json")))["runtime"]["remote"]["token"] == workdir_lib.REDACTED
    c = _tiny()
    c.runtime.remote.token, c.train.steps = "rotated", 3  # a deployment setting: free on resume
    experiment.run(c, wd, log=lambda *_: None)
    assert workdir_lib.redact_argv(["a", "--token=x", "--config.runtime.remote.token", "y", "--tokens=z"]) == [
        "a", "--token=***", "--config.runtime.remote.token", "***", "--tokens=z"]


def test_a_live_run_holds_its_workdir_and_a_killed_one_does_not(tmp_path):
    """A second run on a workdir that a live run (another process) holds is refused, naming the
    holder; once the holder is killed with SIGKILL the next run starts without clean-up (it
    resumes, or starts afresh if the kill came before the first checkpoint was committed)."""
    from tests.test_distributed import ENV, ROOT, TINY

    cmd = [sys.executable, "-m", "jaxrl_llm.main", *TINY, f"--workdir={tmp_path}", "--config.runtime.mode=sync",
           "--config.train.save_every=1", "--config.train.eval_every=1000", "--config.train.steps=100000"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and (not path.exists() or path.read_text().count('"loss"') < 2):
        time.sleep(0.1)
    try:
        with pytest.raises(workdir_lib.WorkdirBusy, match=rf"held by a live run \(.*\"pid\": {p.pid}.*jaxrl_llm"):
            experiment.run(_tiny(), str(tmp_path), log=lambda *_: None)
        busy = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert busy.returncode == 2 and "Traceback" not in busy.stderr, busy.stderr[-2000:]
        assert re.search(rf"^jaxrl_llm.main: error: .*held by a live run .*{p.pid}", busy.stderr, re.M), busy.stderr
    finally:
        p.kill()
        p.wait()
    steps = path.read_text().count('"loss"') + 1
    r = subprocess.run([*cmd[:-1], f"--config.train.steps={steps}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "held by a live run" not in r.stdout + r.stderr, r.stderr[-2000:]
