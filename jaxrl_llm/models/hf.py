"""Hugging Face checkpoints in and out: config.json + safetensors (single or sharded index).

Safetensors only, never pickle. Local directories only: nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm import validation as V
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def load_config(path: str, **overrides) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r} (expected a local Hugging Face model directory)")
    try:
        with open(cfg_file) as f:
            return ModelConfig.from_hf(json.load(f), **overrides)
    except ValueError as e:  # (bad JSON too) one line naming the file
        raise ValueError(f"{cfg_file}: {e}") from None


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in files if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise FileNotFoundError(f"{_INDEX} in {path!r} names missing shard(s): {', '.join(missing)}")
        return [os.path.join(path, n) for n in files]
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        return [single]
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(path)):
        raise FileNotFoundError(
            f"{path!r} holds only pickle weights (.bin/.pt); jaxrl_llm loads safetensors only. Convert "
            "with transformers: AutoModelForCausalLM.from_pretrained(p).save_pretrained(p, safe_serialization=True)"
        )
    raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in {path!r}")


def _hf_names(cfg: ModelConfig):
    """(our param path, HF tensor name, HF->ours, ours->HF) for every parameter. A path ending
    in an int is one expert's slice of a stacked [E, ...] weight (`moe.py`)."""
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = (lambda w: w, lambda w: w)
    transpose = (lambda w: w.T, lambda w: w.T)
    out = [(("embed",), "model.embed_tokens.weight", *same),
           (("final_norm", "scale"), "model.norm.weight", *same)]
    if not cfg.tie_word_embeddings:
        out.append((("lm_head",), "lm_head.weight", *transpose))
    for i in range(cfg.num_layers):
        pre, lay = f"model.layers.{i}.", f"layers_{i}"
        for ours, n in (("q", h), ("k", kvh), ("v", kvh)):
            # HF Linear stores [out, in]; ours is [in, heads, head_dim].
            out.append(((lay, "attn", ours, "kernel"), f"{pre}self_attn.{ours}_proj.weight",
                        lambda w, n=n: w.T.reshape(d, n, hd), lambda w: w.reshape(d, -1).T))
            if cfg.qkv_bias:
                out.append(((lay, "attn", ours, "bias"), f"{pre}self_attn.{ours}_proj.bias",
                            lambda w, n=n: w.reshape(n, hd), lambda w: w.reshape(-1)))
        out.append(((lay, "attn", "o", "kernel"), f"{pre}self_attn.o_proj.weight",
                    lambda w: w.T.reshape(h, hd, d), lambda w: w.reshape(h * hd, d).T))
        if cfg.o_bias:
            out.append(((lay, "attn", "o", "bias"), f"{pre}self_attn.o_proj.bias", *same))
        if cfg.qk_norm:
            out.append(((lay, "attn", "q_norm", "scale"), f"{pre}self_attn.q_norm.weight", *same))
            out.append(((lay, "attn", "k_norm", "scale"), f"{pre}self_attn.k_norm.weight", *same))
        if cfg.sparse(i):
            out += _moe_names(cfg, lay, pre)
        for ours in () if cfg.sparse(i) else ("gate", "up", "down"):
            out.append(((lay, "mlp", ours, "kernel"), f"{pre}mlp.{ours}_proj.weight", *transpose))
            if cfg.mlp_bias:
                out.append(((lay, "mlp", ours, "bias"), f"{pre}mlp.{ours}_proj.bias", *same))
        out.append(((lay, "input_norm", "scale"), f"{pre}input_layernorm.weight", *same))
        out.append(((lay, "post_norm", "scale"), f"{pre}post_attention_layernorm.weight", *same))
    return out


def _moe_names(cfg: ModelConfig, lay: str, pre: str) -> list:
    """A sparse layer's tensors: the router, each expert's projections (one slice each of our
    stacked weights), Qwen2-MoE's shared expert and its gate; HF Linear weights are [out, in]."""
    transpose = (lambda w: w.T, lambda w: w.T)
    out = [((lay, "moe", "router"), f"{pre}mlp.gate.weight", *transpose)]
    for e in range(cfg.num_experts):
        out += [((lay, "moe", ours, e), f"{pre}mlp.experts.{e}.{ours}_proj.weight", *transpose)
                for ours in ("gate", "up", "down")]
    if cfg.shared_expert_intermediate_size:
        out += [((lay, "moe", f"shared_{ours}"), f"{pre}mlp.shared_expert.{ours}_proj.weight", *transpose)
                for ours in ("gate", "up", "down")]
        out.append(((lay, "moe", "shared_scale"), f"{pre}mlp.shared_expert_gate.weight", *transpose))
    return out


def _fused_shape(name: str, cfg: ModelConfig):
    """The shape of a mixture's fused experts tensor named `name` (`_parts`), or None: no such name."""
    pre, _, proj = name.rpartition(".")
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return {"gate_up_proj": [e, 2 * f, d], "down_proj": [e, d, f]}.get(proj) \
        if e and pre.endswith(".mlp.experts") else None


def _parts(name: str, shape, cfg: ModelConfig) -> list:
    """A tensor as the per-expert tensors it holds: [(name, take)], `take` its slice of the tensor
    read (None: the whole). transformers v5 keeps a mixture's experts fused in memory
    (`experts.gate_up_proj` [E, 2F, D], gate rows first; `experts.down_proj` [E, D, F]) and writes
    them so with `save_pretrained(save_original_format=False)` and from offloaded models; expert
    e's `gate_proj`, `up_proj` and `down_proj` as the hub names them are [out, in] slices of those.
    A fused tensor of another shape stays whole (`check_weights` names it)."""
    want = _fused_shape(name, cfg)
    if want is None or list(shape) != want:
        return [(name, None)]
    pre, f = name.rpartition(".")[0], cfg.moe_intermediate_size
    if name.endswith("down_proj"):
        return [(f"{pre}.{i}.down_proj.weight", lambda a, i=i: a[i]) for i in range(cfg.num_experts)]
    return [(f"{pre}.{i}.{p}_proj.weight", lambda a, i=i, rows=rows: a[i, rows]) for i in range(cfg.num_experts)
            for p, rows in (("gate", slice(0, f)), ("up", slice(f, 2 * f)))]


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _entry_ok(t) -> bool:
    """A safetensors header entry: a dtype, a shape of integers >= 0, and byte offsets [begin,
    end] that hold the shape (exactly for the dtypes a model's weights use; another dtype, at
    least a bit an element, is left to safetensors, which refuses a wrong size when read)."""
    nat = V.integer(0).ok
    if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2):
        return False
    (begin, end), shape = t["data_offsets"], t["shape"]
    if not (all(map(nat, shape)) and nat(begin) and nat(end) and begin <= end):
        return False
    elements = int(np.prod(shape, dtype=object))
    return end - begin == elements * _ITEMSIZE[t["dtype"]] if t["dtype"] in _ITEMSIZE else elements <= 8 * (end - begin)


def _header(file: str) -> dict:
    """A safetensors file's header, checked against the file's size (nothing else is read)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{file} is not a complete safetensors file ({size} bytes; its header is cut short)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object)")
    for name, t in header.items():
        if name != "__metadata__" and not _entry_ok(t):
            raise ValueError(f"{file}: tensor {name!r} has a malformed header entry {str(t)[:200]} (a dtype, a "
                             "shape of integers >= 0 and data_offsets [begin, end] of its bytes are needed)")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{file} is truncated: its header declares {8 + n + end} bytes, the file holds {size}")
    return header


def check_weights(path: str, cfg: ModelConfig) -> None:
    """Before anything is loaded: every weight file complete, and each tensor `cfg` needs present
    with the size `cfg` gives it (a checkpoint of another model is refused by tensor name)."""
    found = {}
    for file in _weight_files(path):
        for name, t in _header(file).items():
            if name != "__metadata__":
                whole = np.broadcast_to(np.int8(0), t["shape"])  # a view of the shape: no bytes read
                for part, take in _parts(name, t["shape"], cfg):
                    found[part] = ((take(whole) if take else whole).shape, file)
    _check_counts(path, found, cfg)
    like = jax.eval_shape(lambda: decoder.init_params(cfg.without_lora(), jax.random.key(0)))
    problems = []
    for name, (shape, file) in found.items():
        want = _fused_shape(name, cfg)
        if want and list(shape) != want:
            problems.append(f"{name} in {file} has shape {list(shape)}, this model needs {want}")
    for ours, name, _, _ in _hf_names(cfg.without_lora()):
        if name not in found:
            continue  # load_params names every missing tensor
        leaf = _get(like, ours[:-1] if isinstance(ours[-1], int) else ours)
        want = int(np.prod(leaf.shape[1:] if isinstance(ours[-1], int) else leaf.shape))
        shape, file = found[name]
        if int(np.prod(shape)) != want:
            problems.append(f"{name} in {file} has shape {list(shape)}, this model needs {want} values")
    if problems:
        raise ValueError(f"the weights in {path} are not those of its config.json's model: "
                         + "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))


def _check_counts(path: str, names, cfg: ModelConfig) -> None:
    """config.json's layer and expert counts against the indices the weights' names hold, before
    anything walks them (the model's shapes, its tensor names): a count no checkpoint backs (a
    config.json claiming 10^9 layers) is refused here rather than traced."""
    def held(pattern):
        return {int(m[1]) for m in map(re.compile(pattern).search, names) if m}

    for key, count, indices in (("num_hidden_layers", cfg.num_layers, held(r"^model\.layers\.(\d+)\.")),
                                ("num_experts", cfg.num_experts, held(r"\.mlp\.experts\.(\d+)\."))):
        if len(indices) != count or (indices and (min(indices), max(indices)) != (0, count - 1)):  # range(count)
            span = f"indices {min(indices)}..{max(indices)}" if indices else "none"
            raise ValueError(f"the weights in {path} are not those of its config.json's model: it gives "
                             f"{key}={count}, they hold {len(indices)} ({span})")


def _get(tree: dict, path: tuple):
    for key in path:
        if isinstance(key, int):  # an expert's slice of a stacked weight
            return tree[key]
        if key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_params(path: str, cfg: Optional[ModelConfig] = None, place: Optional[Callable] = None):
    """Read a local HF directory into (params, cfg).

    `place(our_path, array) -> jax.Array` puts each tensor where it belongs (e.g. straight into
    its NamedSharding with `jax.device_put`); default: default device, cast to param_dtype.
    Tensors are read one at a time, so no full host copy of the model is built first.
    """
    cfg = cfg or load_config(path)
    dtype = jnp.dtype(cfg.param_dtype)
    place = place or (lambda _, a: jnp.asarray(a, dtype))
    wanted = {name: (ours, conv) for ours, name, conv, _ in _hf_names(cfg)}
    params: dict = {}
    unused, experts = [], {}  # stacked path -> {expert: its slice}, stacked once all are read
    for file in _weight_files(path):
        shapes = {n: t["shape"] for n, t in _header(file).items() if n != "__metadata__"}
        with safe_open(file, framework="flax") as f:
            for whole in f.keys():
                tensor = None  # read once, whole or fused (`_parts`)
                for name, take in _parts(whole, shapes[whole], cfg):
                    if name not in wanted:
                        if not _derived(name, cfg):
                            unused.append(name)
                        continue
                    tensor = np.asarray(f.get_tensor(whole), np.float32) if tensor is None else tensor
                    ours, conv = wanted.pop(name)
                    value = conv(tensor if take is None else take(tensor))
                    if isinstance(ours[-1], int):
                        got = experts.setdefault(ours[:-1], {})
                        got[ours[-1]] = value
                        if len(got) == cfg.num_experts:
                            stacked = np.stack([got.pop(e) for e in range(cfg.num_experts)])
                            _set(params, ours[:-1], place(ours[:-1], stacked))
                    else:
                        _set(params, ours, place(ours, value))
    if cfg.tie_word_embeddings:
        wanted.pop("lm_head.weight", None)
    if wanted:
        missing = sorted(wanted)
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")
    if unused:  # a tensor the model would not use means math the loader does not implement
        unused.sort()
        raise ValueError(f"checkpoint {path!r} has {len(unused)} tensor(s) this {cfg.model_type} model does not use, "
                         f"e.g. {', '.join(unused[:5])}: an option the loader does not implement (check config.json)")
    return params, cfg


def _derived(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that hold nothing of their own: RoPE frequency buffers
    (older Llama exports) and a tied output head saved beside the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def save_params(path: str, params, cfg: ModelConfig, tokenizer=None) -> None:
    """Write config.json + model.safetensors that `transformers` loads."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    # Qwen2's q/k/v projections always carry a bias: a model without one is written with zero
    # biases, the same function, so that transformers and this loader read every tensor.
    for ours, name, _, to_hf in _hf_names(cfg.replace(qkv_bias=cfg.qkv_bias or cfg.model_type == "qwen2")):
        value = _get(params, ours)
        if value is None:
            value = np.zeros(_get(params, ours[:-1] + ("kernel",)).shape[1:], np.float32)
        tensors[name] = np.ascontiguousarray(to_hf(np.asarray(jax.device_get(value), np.float32)))
    if cfg.param_dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, _SINGLE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_tokenizer(path: str):
    """The tokenizer saved beside the weights (transformers.AutoTokenizer, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
