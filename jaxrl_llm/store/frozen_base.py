"""The frozen base of a LoRA run: referenced by the workdir, never copied into a checkpoint.

Checkpoints of a LoRA run hold the adapters and their optimizer state only (`TrainState.params`
are the adapters). The base they complete is named once, in `<workdir>/lora_base.json`: the
checkpoint directory of `model.hf_path`, or, for a run without one (a random model warm-started
on the embedded task), a copy written once to `<workdir>/lora_base/` in HF format (so an
exported PEFT adapter names a base that `transformers` loads). A fingerprint of the base's
weights is kept beside the reference: resuming onto different weights is refused, naming both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import crc32c
import jax
import numpy as np

from jaxrl_llm import models
from jaxrl_llm.parallel import distributed
from jaxrl_llm.models.config import ModelConfig

RECORD, COPY = "lora_base.json", "lora_base"


def fingerprint(params) -> str:
    """CRC-32C over every leaf's path, dtype, shape and float32 bytes (in tree order)."""
    crc = 0
    for path, x in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
        x = np.ascontiguousarray(np.asarray(x, np.float32))
        head = f"{jax.tree_util.keystr(path)}:{x.shape}".encode()
        crc = crc32c.crc32c(x.tobytes(), crc32c.crc32c(head, crc))
    return f"{crc:08x}"


def _record_path(workdir: str) -> str:
    return os.path.join(workdir, RECORD)


def read(workdir: str) -> Optional[dict]:
    """The record, its `path` absolute (the workdir's own copy is recorded relative to it, so a
    moved or copied workdir keeps its base)."""
    try:
        with open(_record_path(workdir)) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    rec["path"] = os.path.join(os.path.abspath(workdir), rec["path"])  # an absolute path stays as it is
    return rec


def check_resumable(workdir: str, cfg: ModelConfig, has_checkpoints: bool) -> None:
    """Before any restore: a workdir trained with full weights cannot resume as LoRA or back,
    nor LoRA with other adapters (the saved tree or its meaning differs; orbax would call the
    checkpoint damaged). Another model is refused for every run (`workdir.check_resume`)."""
    if not has_checkpoints:
        return
    rec, lora = read(workdir), bool(cfg.lora_rank)
    if lora and rec is None:
        raise ValueError(f"{workdir} holds checkpoints of a full-weight run; model.lora.rank > 0 cannot resume it "
                         "(use a new --workdir, or --config.train.resume=fresh)")
    if not lora and rec is not None:
        raise ValueError(f"{workdir} holds checkpoints of a LoRA run (rank {rec['lora']['rank']}, {RECORD}); "
                         f"resume it with --config.model.lora.rank={rec['lora']['rank']}, or use a new --workdir")
    if rec is None:
        return
    diff = [f"model.lora.{k}: saved {rec['lora'][k]!r}, now {v!r}" for k, v in (
        ("rank", cfg.lora_rank), ("alpha", cfg.lora_alpha), ("targets", list(cfg.lora_targets))) if rec["lora"][k] != v]
    if diff:
        raise ValueError(f"{workdir} was trained with other adapters; cannot resume: " + "; ".join(diff))


def record(workdir: str, hf_path: str, params, cfg: ModelConfig) -> str:
    """Name the base of a fresh LoRA run (process 0 writes); returns the base's HF directory."""
    path = os.path.abspath(hf_path) if hf_path else os.path.join(os.path.abspath(workdir), COPY)
    if distributed.is_main():
        if not hf_path:
            models.save_params(path, params, cfg.without_lora())
        rec = {"path": path if hf_path else COPY, "hf_path": hf_path, "fingerprint": fingerprint(params),
               "lora": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets)},
               "model": dataclasses.asdict(cfg.without_lora())}  # `ModelConfig.from_dict` reads it back
        tmp = _record_path(workdir) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f, indent=2)
        os.replace(tmp, _record_path(workdir))
    distributed.agree(0)
    return path


def _load_copy(path: str, cfg: ModelConfig):
    """The workdir's HF copy in `cfg`'s tree: `save_params` writes a qwen2 model without q/k/v
    biases with zero biases (the same function), which are dropped again here."""
    params = models.load_params(path)[0]
    like = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))

    def prune(tree, shape):
        out = {}
        for k, v in tree.items():
            if k not in shape:
                if any(np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(v)):
                    raise ValueError(f"{path}: tensor {k!r} is not zero and this model has no such parameter")
            else:
                out[k] = prune(v, shape[k]) if isinstance(v, dict) else v
        return out

    return prune(params, like)


def restore(workdir: str, hf_path: str, loaded, cfg: ModelConfig):
    """The base a resumed LoRA run continues on: `loaded` (from `model.hf_path`) or the workdir's
    copy, checked against the recorded fingerprint; different weights are refused by name."""
    rec = read(workdir)
    if rec is None:
        raise ValueError(f"{workdir} has LoRA checkpoints but no {RECORD}: the frozen base they adapt is unknown")
    if loaded is None:
        if rec["hf_path"]:
            raise ValueError(f"{workdir} adapted the base {rec['hf_path']!r} (model.hf_path); this run has no "
                             "model.hf_path: set it to that checkpoint")
        loaded = _load_copy(rec["path"], cfg.without_lora())
    got = fingerprint(loaded)
    if got != rec["fingerprint"]:
        now = os.path.abspath(hf_path) if hf_path else "a random model"
        raise ValueError(f"resuming {workdir} with a different LoRA base: its adapters were trained on "
                         f"{rec['path']} (weights fingerprint {rec['fingerprint']}), this run's base is {now} "
                         f"(fingerprint {got}); set model.hf_path to the original base or use a new --workdir")
    return loaded
