"""Local paths are checked before anything is built: each mistake names the key, the path and
what was expected; several are reported together; valid layouts pass."""

import json
import os

import pytest

from configs.default import get_config
from jaxrl_llm import experiment, paths


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


def test_model_directory_mistakes(tmp_path):
    c = get_config()
    c.model.hf_path = "Qwen/Qwen2.5-0.5B"
    msg = _err(c)
    assert "model.hf_path='Qwen/Qwen2.5-0.5B' does not exist" in msg and "huggingface-cli download Qwen/Qwen2.5-0.5B" in msg
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
        experiment.validate(c)


def test_tokenizer_and_dataset_mistakes_are_reported_together(tmp_path):
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
    assert "looks like a Hugging Face hub id" in _err(c)
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
    with pytest.raises(ValueError, match="is a file"):  # before anything is built
        experiment.run(c, str(f), log=lambda *_: None)
