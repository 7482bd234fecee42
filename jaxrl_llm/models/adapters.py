"""PEFT LoRA adapter directories in and out (`adapter_config.json` + `adapter_model.safetensors`),
the format `peft.PeftModel.from_pretrained(base, dir)` loads onto a transformers model.

PEFT stores each adapted `nn.Linear` as `lora_A.weight [r, in]` and `lora_B.weight [out, r]`
under `base_model.model.<module path>`; ours are A [..in, r] and B [r, ..out] (`lora.py`), in
the same input / output orderings as the HF weights (`hf._hf_names`): a reshape and a transpose.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import decoder, lora
from jaxrl_llm.models.config import ModelConfig

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _names(cfg: ModelConfig):
    """(layer, module, target, PEFT tensor prefix) for every adapted projection."""
    for i in range(cfg.num_layers):
        for t in cfg.lora_targets:
            module, hf = lora.TARGETS[t]
            yield f"layers_{i}", module, t, f"base_model.model.model.layers.{i}.{hf}"


def save(path: str, adapters, cfg: ModelConfig, base_model: str = "") -> None:
    """Write `adapters` (ours) as a PEFT LoRA directory."""
    os.makedirs(path, exist_ok=True)
    host = jax.device_get(adapters)
    tensors = {}
    for layer, module, t, prefix in _names(cfg):
        a = np.asarray(host[layer][module][f"{t}{lora.MARK}a"], np.float32)
        b = np.asarray(host[layer][module][f"{t}{lora.MARK}b"], np.float32)
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, cfg.lora_rank).T)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(cfg.lora_rank, -1).T)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "target_modules": sorted(lora.TARGETS[t][1].split(".")[-1] for t in cfg.lora_targets),
              "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True}
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def load(path: str, cfg: ModelConfig):
    """A PEFT LoRA directory -> our adapters for `cfg` (float32 host arrays). Its rank, alpha and
    targets must be `cfg`'s: a mismatch is refused naming both, not silently rescaled."""
    where = os.path.join(path, CONFIG)
    try:
        with open(where) as f:
            pc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.lora.init_from: cannot read {where}: {type(e).__name__}: {e}") from None
    if not isinstance(pc, dict):
        raise ValueError(f"model.lora.init_from: {where} is not a JSON object")
    targets = sorted(lora.TARGETS[t][1].split(".")[-1] for t in cfg.lora_targets)
    theirs = pc.get("target_modules") or []
    theirs = sorted(theirs) if isinstance(theirs, list) else [theirs]
    problems = [f"{k}: {path} has {got!r}, this run {want!r}" for k, got, want in (
        ("peft_type", pc.get("peft_type"), "LORA"), ("r (model.lora.rank)", pc.get("r"), cfg.lora_rank),
        ("lora_alpha (model.lora.alpha)", _number(pc.get("lora_alpha", 0)), float(cfg.lora_alpha)),
        ("target_modules (model.lora.targets)", theirs, targets),
        ("use_rslora", bool(pc.get("use_rslora")), False), ("use_dora", bool(pc.get("use_dora")), False),
        ("bias", pc.get("bias", "none"), "none")) if got != want]
    if problems:
        raise ValueError("PEFT adapter directory does not match model.lora: " + "; ".join(problems))
    tensors = load_file(os.path.join(path, WEIGHTS))
    like = jax.eval_shape(lambda: lora.split(decoder.init_params(cfg, jax.random.key(0)))[1])
    out: dict = {}
    for layer, module, t, prefix in _names(cfg):
        dst = out.setdefault(layer, {}).setdefault(module, {})
        for part, key, to_ours in (("a", "lora_A", lambda w: w.T), ("b", "lora_B", lambda w: w.T)):
            name = f"{prefix}.{key}.weight"
            shape = like[layer][module][f"{t}{lora.MARK}{part}"].shape
            if name not in tensors:
                raise ValueError(f"{os.path.join(path, WEIGHTS)} lacks {name}")
            w = to_ours(np.asarray(tensors[name], np.float32))
            if w.size != int(np.prod(shape)):
                raise ValueError(f"{name} in {path} has shape {tensors[name].shape}; this model needs "
                                 f"{int(np.prod(shape))} values (ours {shape})")
            dst[f"{t}{lora.MARK}{part}"] = w.reshape(shape)
    return out


def _number(x):
    """A config number as a float, or the value itself (reported as a mismatch) when it is not one."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return x
