"""Every local path a run reads or writes, checked before anything is built.

A missing model directory, a file where a directory belongs, a malformed config.json or
tokenizer file, a dataset with a broken line, or a workdir that cannot be written gives one
error naming the config key, the path and what was expected, instead of a hub-lookup message
from transformers or a bare parser traceback minutes into the run. All problems are reported
together.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

_MODEL_EXPECTED = "a local Hugging Face model directory (config.json + *.safetensors)"


def looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not os.path.exists(path)


def _download(repo_id: str, repo_type: str = "model") -> str:
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    return f"pre-download it with `huggingface-cli download {repo_id}{kind}` (into $HF_HOME) or pass a local directory"


def hub_cache() -> str:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                     "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub(key: str, repo_id: str, repo_type: str = "model") -> str:
    """A hub id -> its local snapshot directory, through the Hugging Face cache as peers resolve
    names (`huggingface_hub.snapshot_download`). With HF_HUB_OFFLINE=1 only a cached copy is
    used; without one the error says so and shows the command that fetches it."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, repo_type=repo_type, cache_dir=hub_cache(), local_files_only=offline())
    except Exception as e:  # not cached offline, no network, unknown repo, ...
        where = f"no cached copy in {hub_cache()}" + (" and HF_HUB_OFFLINE=1" if offline() else "")
        raise ValueError(f"{key}={repo_id!r} is not a local path and resolving it as a hub id failed "
                         f"({where}; {type(e).__name__}); {_download(repo_id, repo_type)}") from None


HUB_FIELDS = (("model", "hf_path", "model"), ("aux_model", "hf_path", "model"), ("task", "tokenizer", "model"),
              ("task", "path", "dataset"))


def resolved(config):
    """A copy of `config` whose hub ids (model.hf_path, aux_model.hf_path, task.tokenizer,
    task.path) are replaced by local snapshot directories; local paths are left alone."""
    import copy

    out = copy.deepcopy(config)
    for section, field, repo_type in HUB_FIELDS:
        sec = out.get(section)
        value = sec.get(field) if sec is not None else None
        if value and looks_like_hub_id(value):
            sec[field] = resolve_hub(f"{section}.{field}", value, repo_type)
    return out


def _json_problem(path: str, lines: bool = False) -> Optional[str]:
    """None if `path` parses as JSON (every line, for JSON Lines), else what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            if not lines:
                json.load(f)
                return None
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as e:
                        return f"line {n} is not valid JSON ({e.msg})"
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at line {e.lineno})"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None


def _directory(key: str, path: str, expected: str) -> Optional[str]:
    if not os.path.exists(path):
        return f"{key}={path!r} does not exist; expected {expected}"
    if not os.path.isdir(path):
        return f"{key}={path!r} is a file; expected {expected}"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{key}={path!r} is not readable"
    return None


def model_dir(key: str, path: str) -> list:
    problem = _directory(key, path, _MODEL_EXPECTED)
    if problem:
        return [problem]
    out = []
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        out.append(f"{key}={path!r} has no config.json; expected {_MODEL_EXPECTED}")
    else:
        bad = _json_problem(cfg)
        if bad:
            out.append(f"{key}: {cfg} is {bad}; expected the model's Hugging Face config")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        bad = _json_problem(index)
        if bad:
            out.append(f"{key}: {index} is {bad}")
    elif not glob.glob(os.path.join(path, "*.safetensors")):
        out.append(f"{key}={path!r} has no *.safetensors weights; expected {_MODEL_EXPECTED}")
    return out


def tokenizer_dir(key: str, path: str) -> list:
    expected = "a local tokenizer directory (tokenizer.json or tokenizer_config.json + vocabulary files)"
    problem = _directory(key, path, expected)
    if problem:
        return [problem]
    files = [f for f in ("tokenizer.json", "tokenizer_config.json") if os.path.isfile(os.path.join(path, f))]
    if not files and not glob.glob(os.path.join(path, "vocab.*")) and not os.path.isfile(
            os.path.join(path, "tokenizer.model")):
        return [f"{key}={path!r} holds no tokenizer files; expected {expected}"]
    out = []
    for f in files:
        bad = _json_problem(os.path.join(path, f))
        if bad:
            out.append(f"{key}: {os.path.join(path, f)} is {bad}")
    return out


def dataset(key: str, path: str) -> list:
    from jaxrl_llm.tasks.math_dataset import FORMATS

    expected = (f"a local dataset: a {'/'.join(FORMATS)} file, a directory of them (<split>*.jsonl, ...), "
                "or a datasets.save_to_disk directory")
    if not os.path.exists(path):
        return [f"{key}={path!r} does not exist; expected {expected}"]
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
            return []
        files = [f for ext in FORMATS for f in glob.glob(os.path.join(path, "**", f"*{ext}"), recursive=True)]
        if not files:
            return [f"{key}={path!r} holds no dataset files; expected {expected}"]
    else:
        files = [path]
    out = []
    for f in files:
        ext = os.path.splitext(f)[1]
        if ext not in FORMATS:
            out.append(f"{key}={f!r}: unsupported file type {ext or '(none)'}; valid: {', '.join(FORMATS)}")
        elif ext in (".json", ".jsonl"):
            bad = _json_problem(f, lines=ext == ".jsonl")
            if bad:
                out.append(f"{key}: {f} is {bad}" if not bad.startswith("line") else f"{key}: {f}: {bad}")
        else:  # parquet: the magic bytes at both ends
            with open(f, "rb") as h:
                head = h.read(4)
                h.seek(max(os.path.getsize(f) - 4, 0))
                if head != b"PAR1" or h.read(4) != b"PAR1":
                    out.append(f"{key}: {f} is not a parquet file (truncated or another format)")
    return out


def workdir(path: str) -> list:
    # Checkpoints, records and the workdir lock go through POSIX file calls: a URL would become
    # a local directory named "gs:" (a bucket mounted as a file system, e.g. gcsfuse, works).
    if "://" in path:
        return [f"workdir {path!r} is a URL; expected a local or shared POSIX directory (mount the bucket, "
                "e.g. with gcsfuse, and give its mount path)"]
    if os.path.exists(path):
        if not os.path.isdir(path):
            return [f"workdir {path!r} is a file; expected a directory (created if missing)"]
        if not os.access(path, os.W_OK | os.X_OK):
            return [f"workdir {path!r} is not writable"]
        return []
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return [f"workdir {path!r} cannot be created: {parent!r} is not a writable directory"]
    return []


def check(config, workdir_path: Optional[str] = None) -> None:
    """Raise one ValueError listing every problem with the run's local paths (hub ids are
    resolved through the cache first)."""
    try:
        config = resolved(config)
    except ValueError as e:
        raise ValueError(f"bad path:\n  {e}") from None
    out = []
    model_ok = True
    if config.model.hf_path:
        out += model_dir("model.hf_path", config.model.hf_path)
        model_ok = not out
    aux = config.get("aux_model")
    if aux is not None and aux.get("hf_path"):
        out += model_dir("aux_model.hf_path", aux.hf_path)
    task = config.task
    if task.name == "math":
        if task.path:
            out += dataset("task.path", task.path)
        if task.tokenizer:
            out += tokenizer_dir("task.tokenizer", task.tokenizer)
        elif config.model.hf_path and model_ok:  # the tokenizer saved beside the weights
            out += tokenizer_dir("model.hf_path (tokenizer)", config.model.hf_path)
    if workdir_path is not None:
        out += workdir(workdir_path)
    if out:
        raise ValueError("bad path" + ("s" if len(out) > 1 else "") + ":\n  " + "\n  ".join(out))
