"""Local paths are checked before anything is built: each mistake names the key, the path and
what was expected; several are reported together; valid layouts pass."""

import json
import os

import pytest

from configs.default import get_config
from jaxrl_llm.run import config as config_lib
from jaxrl_llm.run import experiment, paths


def _model(d, config='{"model_type": "qwen2"}', weights=True):
    os.makedirs(d, exist_ok=True)
    if config is not None:
        open(os.path.join(d, "config.json"), "w").write(config)
    if weights:
        open(os.path.join(d, "model.safetensors"), "wb").write(b"\0" * 8)
    return str(d)


def _math(model_dir, data):
    c = get_config()
    c.model.hf_path = model_dir
    c.task.update(dict(name="math", path=data))
    return c


def _err(c, workdir=None):
    with pytest.raises(ValueError) as e:
        paths.check(c, workdir)
    return str(e.value)


def test_model_directory_mistakes(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    c = get_config()
    c.model.hf_path = "Qwen/Qwen2.5-0.5B"
    msg = _err(c)
    assert "model.hf_path='Qwen/Qwen2.5-0.5B' is not a local path" in msg
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B" in msg
    c.model.hf_path = _model(tmp_path / "m", config=None)
    assert "has no config.json; expected a local Hugging Face model directory" in _err(c)
    c.model.hf_path = _model(tmp_path / "bad", config='{"model_type": "qwen2",')
    assert f"{tmp_path / 'bad' / 'config.json'} is not valid JSON" in _err(c)
    c.model.hf_path = _model(tmp_path / "noweights", weights=False)
    assert "has no *.safetensors weights" in _err(c)
    f = tmp_path / "file"
    f.write_text("x")
    c.model.hf_path = str(f)
    assert "is a file; expected a local Hugging Face model directory" in _err(c)
    c.model.hf_path = _model(tmp_path / "good")
    paths.check(c)  # a valid layout passes
    with pytest.raises(ValueError, match="has no config.json"):  # the experiment checks before building
        c.model.hf_path = _model(tmp_path / "m2", config=None)
        config_lib.validate(c)


def test_tokenizer_and_dataset_mistakes_are_reported_together(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = _model(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n{broken\n")
    c = _math(model, str(data))
    msg = _err(c)
    assert "model.hf_path (tokenizer)" in msg and "holds no tokenizer files" in msg
    assert f"task.path: {data}: line 2 is not valid JSON" in msg and msg.startswith("bad paths:")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{not json")
    c.task.tokenizer = str(tok)
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    assert f"task.tokenizer: {tok / 'tokenizer.json'} is not valid JSON" in _err(c)
    (tok / "tokenizer.json").write_text("{}")
    paths.check(c)
    c.task.path = str(tmp_path / "data.csv")
    (tmp_path / "data.csv").write_text("a,b\n")
    assert "unsupported file type .csv; valid: .parquet, .jsonl, .json" in _err(c)
    (tmp_path / "d.parquet").write_bytes(b"PAR1 truncated")
    c.task.path = str(tmp_path / "d.parquet")
    assert "is not a parquet file" in _err(c)
    c.task.path = "openai/gsm8k"
    assert "huggingface-cli download openai/gsm8k --repo-type dataset" in _err(c)
    empty = tmp_path / "empty"
    empty.mkdir()
    c.task.path = str(empty)
    assert "holds no dataset files" in _err(c)


def test_workdir_must_be_a_writable_directory(tmp_path):
    c = get_config()
    f = tmp_path / "file"
    f.write_text("x")
    assert "workdir" in _err(c, str(f)) and "is a file" in _err(c, str(f))
    assert "cannot be created" in _err(c, str(f / "sub" / "run"))
    paths.check(c, str(tmp_path / "new" / "run"))  # created later by the run
    assert "workdir 'gs://bucket/run' is a URL; expected a local or shared POSIX directory" in _err(c, "gs://bucket/run")
    with pytest.raises(ValueError, match="is a file"):  # before anything is built
        experiment.run(c, str(f), log=lambda *_: None)


def _cache_layout(cache, repo_id, files, repo_type="models"):
    """The hub cache's documented layout: <type>--org--name/{refs/main, snapshots/<sha>/...}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"{repo_type}--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    for name, content in files.items():
        (snap / name).write_bytes(content)
    return str(snap)


def test_hub_ids_resolve_through_a_local_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    c = get_config()
    c.model.hf_path = "org/tiny-model"
    msg = _err(c)  # an empty cache: says so, and how to fetch it
    assert "model.hf_path='org/tiny-model' is not a local path" in msg and "HF_HUB_OFFLINE=1" in msg
    assert "huggingface-cli download org/tiny-model" in msg and str(tmp_path / "hf" / "hub") in msg
    snap = _cache_layout(tmp_path / "hf" / "hub", "org/tiny-model",
                         {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"\0" * 8})
    paths.check(c)
    assert paths.resolved(c).model.hf_path == snap and c.model.hf_path == "org/tiny-model"
    data = _cache_layout(tmp_path / "hf" / "hub", "org/math", {"train.jsonl": b'{"question": "1", "answer": "1"}\n'},
                         repo_type="datasets")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    c = _math("org/tiny-model", "org/math")
    c.task.tokenizer = str(tmp_path / "tok")
    paths.check(c)
    assert paths.resolved(c).task.path == data
