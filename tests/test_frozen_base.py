"""A LoRA run end to end: kill -9 and resume bit-identically, checkpoints without the base, the
base referenced and checked on resume, export loaded by PEFT, a start from a PEFT adapter."""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.learner import learner
from jaxrl_llm.run import experiment
from jaxrl_llm.store import checkpoint, export, frozen_base, policy
from jaxrl_llm.models import adapters as peft_dir
from jaxrl_llm.models import lora
from tests import hf_fixtures as F
from tests.test_distributed import ENV, ROOT, TINY
from tests.test_experiment import shrink

LORA = ["--config.model.lora.rank=4", "--config.model.lora.alpha=8", "--config.task.reward=digits",
        "--config.runtime.mode=sync", "--config.train.eval_every=1000"]


def _steps(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"loss"' in line]


def _main(workdir, *extra, steps):
    cmd = [sys.executable, "-m", "jaxrl_llm.main", *TINY, *LORA, f"--workdir={workdir}", *extra,
           f"--config.train.steps={steps}"]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A LoRA run killed with SIGKILL after its 4th step (saves every 2), resumed to the end; and
    the same run straight through."""
    tmp = tmp_path_factory.mktemp("lora_run")
    run, ref = str(tmp / "run"), str(tmp / "ref")
    cmd = [sys.executable, "-m", "jaxrl_llm.main", *TINY, *LORA, f"--workdir={run}", "--config.train.save_every=2",
           "--config.train.steps=1000"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path, deadline = os.path.join(run, "metrics.jsonl"), time.monotonic() + 240
    while time.monotonic() < deadline and (not os.path.exists(path) or open(path).read().count('"loss"') < 5):
        time.sleep(0.1)
    p.kill()  # no chance to save or clean up
    p.wait()
    end = len(_steps(run)) + 2
    r = _main(run, "--config.train.save_every=2", steps=end)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _main(ref, "--config.train.save_every=2", steps=end)
    assert r.returncode == 0, r.stderr[-3000:]
    return run, ref, end


def test_kill_9_and_resume_is_bit_identical_and_checkpoints_hold_adapters_only(killed_and_resumed):
    run, ref, end = killed_and_resumed
    got, want = _steps(run), _steps(ref)
    assert [x["step"] for x in got] == list(range(1, end + 1))
    for g, w in zip(got, want):
        for k in ("loss", "param_norm", "reward/mean", "grad_norm"):
            assert g[k] == w[k], (g["step"], k)
    # What a publication carried: the adapters, in the sampler's dtype (float32 here).
    cfg = policy.lora_model(run)[1]
    assert got[-1]["weights/publish_bytes"] == 4 * lora.num_params(cfg)
    saved = checkpoint.Checkpointer(os.path.join(run, "checkpoints"), async_save=False).saved_tree()
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved["params"])]
    assert names and all(lora.MARK in n for n in names), names[:3]
    base_leaves = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)
                   if any(f"'{w}'" in jax.tree_util.keystr(p) for w in ("kernel", "embedding", "scale"))]
    assert base_leaves == []  # no base weight (nor its moments) in any checkpoint
    rec = frozen_base.read(run)
    assert rec["path"] == os.path.join(run, frozen_base.COPY) and rec["lora"]["rank"] == 4


def test_resume_refuses_another_base_other_adapters_or_full_weights(killed_and_resumed, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(killed_and_resumed[0], run)
    c = shrink(_tiny_lora())
    with pytest.raises(ValueError, match=r"model.lora.rank: saved 4, now 8"):
        experiment.run(_with(c, rank=8), run, log=lambda *_: None)
    with pytest.raises(ValueError, match=r"checkpoints of a LoRA run \(rank 4.*--config.model.lora.rank=4"):
        experiment.run(_with(c, rank=0), run, log=lambda *_: None)
    # The workdir's copy of the base, changed behind the run's back: refused by fingerprint.
    base = os.path.join(run, frozen_base.COPY)
    params, cfg = models.load_params(base)
    params["embed"] = params["embed"] + 1e-3
    models.save_params(base, params, cfg)
    with pytest.raises(ValueError, match=r"different LoRA base: .*trained on .*lora_base \(weights fingerprint"):
        experiment.run(_with(c, rank=4), run, log=lambda *_: None)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == sorted(
        os.listdir(os.path.join(killed_and_resumed[0], "checkpoints")))  # nothing moved aside


def _tiny_lora():
    from configs.default import get_config

    c = get_config()
    c.runtime.mode, c.task.reward, c.learner.schedule = "sync", "digits", "constant"
    c.model.lora.alpha = 8.0
    return c


def _with(c, rank):
    c = c.copy_and_resolve_references()
    c.model.lora.rank = rank
    c.train.steps = 100
    return c


def test_export_loads_in_peft_with_our_logits_and_a_run_starts_from_it(killed_and_resumed, tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    run = killed_and_resumed[0]
    out, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    version = export.export(run, out, merged)
    rec, cfg = policy.lora_model(run)
    assert version == killed_and_resumed[2]
    adapters = checkpoint.Checkpointer(os.path.join(run, "checkpoints"), async_save=False).saved_tree()["params"]
    base = frozen_base.restore(run, "", None, cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    ours = np.asarray(models.full_logits(lora.combine(base, adapters), cfg, tokens))
    hf = AutoModelForCausalLM.from_pretrained(rec["path"], local_files_only=True).float()
    tuned = peft.PeftModel.from_pretrained(hf, out).eval()
    np.testing.assert_allclose(F.hf_logits(tuned, tokens), ours, atol=1e-4, rtol=0)
    whole = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).float().eval()
    np.testing.assert_allclose(F.hf_logits(whole, tokens), ours, atol=1e-4, rtol=0)
    read = policy.load(run)  # what `python -m jaxrl_llm.evaluate --workdir` evaluates: the merged policy
    assert read.version == version and read.cfg.lora_rank == 0
    np.testing.assert_allclose(np.asarray(models.full_logits(read.params, read.cfg, tokens)), ours, atol=1e-5, rtol=0)
    # A new run starts from the exported adapter directory.
    seen = {}
    real = learner.Learner.init

    def init(self, key, params=None, aux_params=None, adapters=None):
        seen["adapters"] = adapters
        return real(self, key, params, aux_params, adapters)

    monkeypatch.setattr(learner.Learner, "init", init)
    c = shrink(_tiny_lora(), steps=1)
    c.model.lora.update(rank=4, init_from=out)
    experiment.run(c, str(tmp_path / "next"), log=lambda *_: None)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y),
                           adapters, peft_dir.load(out, cfg))
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y),
                           seen["adapters"], peft_dir.load(out, cfg))
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint of version 999 in .*; saved versions: \[.*{version}"):
        export.export(run, str(tmp_path / "none"), version=999)
    bad = tmp_path / "bad_adapter"
    shutil.copytree(out, bad)
    for text, why in (("{not json", "JSONDecodeError"), ("[1, 2]", "is not a JSON object"),
                      ('{"peft_type": "LORA", "r": 4, "lora_alpha": "eight"}', "lora_alpha .* has 'eight'")):
        (bad / "adapter_config.json").write_text(text)
        with pytest.raises(ValueError, match=rf"model.lora.*{why}"):
            peft_dir.load(str(bad), cfg)
    c.model.lora.rank = 0
    from jaxrl_llm.run import config as config_lib

    with pytest.raises(ValueError, match=r"model.lora.init_from=.* needs LoRA on"):
        config_lib.validate(c)
