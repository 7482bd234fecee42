"""PEFT LoRA adapter directories in and out (`adapter_config.json` + `adapter_model.safetensors`),
the format `peft.PeftModel.from_pretrained(base, dir)` loads onto a transformers model.

PEFT stores each adapted `nn.Linear` as `lora_A.weight [r, in]` and `lora_B.weight [out, r]`
under `base_model.model.<module path>`; ours are A [..in, r] and B [r, ..out] (`lora.py`), in
the same input / output orderings as the HF weights (`hf._hf_names`): a reshape and a transpose.
A mixture of experts' stacked experts are PEFT `target_parameters` on transformers' fused
`mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F]: `lora_A [r E, in]`
(row e r + j: expert e's j-th) and `lora_B [out, r E]` (column j E + e), PEFT's
`ParamWrapper.get_delta_weight`; with both targeted PEFT nests the wrappers, gate_up_proj's
under `experts.base_layer` and down_proj's under `experts`.
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
    """(layer, module, our adapter name, PEFT tensor prefix, layout) for every adapted weight;
    layout `plain` (one projection), `stacked` (experts) or `fused` (experts' gate and up)."""
    both = cfg.adapts("gate") and cfg.adapts("down")
    for i in range(cfg.num_layers):
        lay, pre = f"layers_{i}", f"base_model.model.model.layers.{i}."
        for t in cfg.lora_targets:
            module, hf = lora.TARGETS[t]
            if module == "attn" or not cfg.num_experts:  # a mixture of experts: its experts only
                yield lay, module, t, pre + hf, "plain"
        if cfg.sparse(i) and cfg.adapts("gate"):
            yield lay, "moe", "gate_up", pre + "mlp.experts" + (".base_layer" if both else ""), "fused"
        if cfg.sparse(i) and cfg.adapts("down"):
            yield lay, "moe", "down", pre + "mlp.experts", "stacked"


def _to_peft(mod, name: str, layout: str, r: int):
    """Our adapters of `name` in module dict `mod` -> PEFT's (lora_A, lora_B)."""
    if layout == "plain":
        a, b = mod[f"{name}{lora.MARK}a"], mod[f"{name}{lora.MARK}b"]
        return a.reshape(-1, r).T, b.reshape(r, -1).T
    if layout == "fused":
        a = mod[f"gate_up{lora.MARK}a"]
        b = np.concatenate([mod[f"gate{lora.MARK}b"], mod[f"up{lora.MARK}b"]], -1)
    else:
        a, b = mod[f"{name}{lora.MARK}a"], mod[f"{name}{lora.MARK}b"]
    e, _, r = a.shape
    return a.transpose(0, 2, 1).reshape(e * r, -1), b.transpose(2, 1, 0).reshape(-1, r * e)


def _from_peft(a_peft, b_peft, name: str, layout: str, like) -> dict:
    """`_to_peft`'s inverse: {our leaf name: array}, shaped as `like` (our leaves' shapes)."""
    if layout == "plain":
        a, b = f"{name}{lora.MARK}a", f"{name}{lora.MARK}b"
        return {a: a_peft.T.reshape(like[a].shape), b: b_peft.T.reshape(like[b].shape)}
    a_name = f"{name}{lora.MARK}a"
    e, _, r = like[a_name].shape
    a = a_peft.reshape(e, r, -1).transpose(0, 2, 1)
    b = b_peft.reshape(b_peft.shape[0], r, e).transpose(2, 1, 0)
    if layout == "stacked":
        return {a_name: a, f"{name}{lora.MARK}b": b}
    gate, up = np.split(b, 2, axis=-1)
    return {a_name: a, f"gate{lora.MARK}b": gate, f"up{lora.MARK}b": up}


def _targets(cfg: ModelConfig) -> tuple:
    """PEFT's (target_modules, target_parameters) for `cfg`: modules present in the model only."""
    plain = {hf.split(".")[-1] for _, _, _, hf, layout in _names(cfg) if layout == "plain"}
    stacked = (["gate_up_proj"] if cfg.adapts("gate") else []) + (["down_proj"] if cfg.adapts("down") else [])
    return sorted(plain), sorted(stacked) if any(cfg.sparse(i) for i in range(cfg.num_layers)) else []


def save(path: str, adapters, cfg: ModelConfig, base_model: str = "") -> None:
    """Write `adapters` (ours) as a PEFT LoRA directory."""
    os.makedirs(path, exist_ok=True)
    host = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), jax.device_get(adapters))
    tensors = {}
    for layer, module, name, prefix, layout in _names(cfg):
        a, b = _to_peft(host[layer][module], name, layout, cfg.lora_rank)
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    modules, parameters = _targets(cfg)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "target_modules": modules, "target_parameters": parameters or None,
              "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True}
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def _listed(x) -> list:
    return sorted(x) if isinstance(x, list) else [] if x is None else [x]


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
    modules, parameters = _targets(cfg)
    problems = [f"{k}: {path} has {got!r}, this run {want!r}" for k, got, want in (
        ("peft_type", pc.get("peft_type"), "LORA"), ("r (model.lora.rank)", pc.get("r"), cfg.lora_rank),
        ("lora_alpha (model.lora.alpha)", _number(pc.get("lora_alpha", 0)), float(cfg.lora_alpha)),
        ("target_modules (model.lora.targets)", _listed(pc.get("target_modules")), modules),
        ("target_parameters (model.lora.targets)", _listed(pc.get("target_parameters")), parameters),
        ("use_rslora", bool(pc.get("use_rslora")), False), ("use_dora", bool(pc.get("use_dora")), False),
        ("bias", pc.get("bias", "none"), "none")) if got != want]
    if problems:
        raise ValueError("PEFT adapter directory does not match model.lora: " + "; ".join(problems))
    file = os.path.join(path, WEIGHTS)
    tensors = load_file(file)
    like = jax.eval_shape(lambda: lora.split(decoder.init_params(cfg, jax.random.key(0)))[1])
    out: dict = {}
    for layer, module, name, prefix, layout in _names(cfg):
        mine = like[layer][module]
        want = _to_peft(jax.tree_util.tree_map(lambda s: np.zeros(s.shape, np.float32), mine), name, layout,
                        cfg.lora_rank)
        got = []
        for key, shape in zip(("lora_A", "lora_B"), (w.shape for w in want)):
            t = f"{prefix}.{key}.weight"
            if t not in tensors:
                raise ValueError(f"{file} lacks {t}")
            if tensors[t].shape != shape:
                raise ValueError(f"{t} in {file} has shape {tuple(tensors[t].shape)}; this model needs {shape}")
            got.append(np.asarray(tensors[t], np.float32))
        out.setdefault(layer, {}).setdefault(module, {}).update(_from_peft(*got, name, layout, mine))
    return out


def _number(x):
    """A config number as a float, or the value itself (reported as a mismatch) when it is not one."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return x
