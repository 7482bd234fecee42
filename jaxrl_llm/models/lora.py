"""LoRA (Hu et al., arXiv:2106.09685): W x + (alpha / r) B A x on chosen projections, the base
W frozen, only A [in, r] and B [r, out] trained.

The adapters live in the decoder's own parameter tree, beside the kernel they adapt
(`layers_i/attn/q_lora_a`, `q_lora_b`, ...; `decoder.Attention` / `decoder.MLP` add the low-rank
side path when the config has a rank), so one tree describes a LoRA model and `split` /
`combine` move between it and (frozen base, trainable adapters). Initialisation as in the paper
and PEFT: A random (PEFT's kaiming-uniform, bound 1/sqrt(in)), B zero, so a fresh adapter
leaves the base's function unchanged; no dropout (a dropped side path would make the ratio at
equal parameters differ from 1).

Adapter layouts (ours -> PEFT's torch `lora_A.weight [r, in]`, `lora_B.weight [out, r]`):
  q, k, v: A [D, r], B [r, H, hd]      o: A [H, hd, r], B [r, D]      gate, up, down: A [in, r], B [r, out]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import validation as V

# target name -> (the decoder module that owns it, its HF module name)
TARGETS = {"q": ("attn", "self_attn.q_proj"), "k": ("attn", "self_attn.k_proj"), "v": ("attn", "self_attn.v_proj"),
           "o": ("attn", "self_attn.o_proj"), "gate": ("mlp", "mlp.gate_proj"), "up": ("mlp", "mlp.up_proj"),
           "down": ("mlp", "mlp.down_proj")}
MARK = "_lora_"  # in every adapter leaf's name, and in no base leaf's


def _targets_rule() -> V.Rule:
    def ok(x):
        names = parse_targets(x)
        return bool(names) and all(n in TARGETS for n in names)
    return V.Rule(f"a comma-separated subset of {', '.join(TARGETS)}", ok, ("q,nope", ""))


# model.lora: rank 0 trains every weight; rank r > 0 trains adapters only (the base is frozen and
# held in model.dtype, with no optimizer state). init_from: a PEFT adapter directory to start from.
SECTION = V.Section(rank=(0, V.integer(0)), alpha=(32.0, V.positive()),
                    targets=("q,k,v,o,gate,up,down", _targets_rule()), init_from=("", V.anything()))


def parse_targets(text) -> tuple:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def uniform_a(key, shape, dtype=jnp.float32):
    """PEFT's default for A (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), `in` the
    leading dims (all but the rank)."""
    fan_in = int(np.prod(shape[:-1]))
    return jax.random.uniform(key, shape, dtype, -1.0, 1.0) / np.sqrt(fan_in)


def is_adapter(path) -> bool:
    return MARK in str(path[-1].key if hasattr(path[-1], "key") else path[-1])


def split(params):
    """A LoRA model's params -> (base, adapters): two nested dicts with the same layout."""
    base, adapters = {}, {}
    for k, v in params.items():
        if isinstance(v, dict):
            b, a = split(v)
            if b:
                base[k] = b
            if a:
                adapters[k] = a
        elif MARK in k:
            adapters[k] = v
        else:
            base[k] = v
    return base, adapters


def combine(base, adapters):
    """`split`'s inverse: one tree (no leaf copied)."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = combine(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def disabled(adapters):
    """A copy of the adapters with B = 0: the base model's exact function, at adapter size."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if str(p[-1].key).endswith("_b") else jnp.copy(x), adapters)


def _delta(a, b):
    """B A as a kernel-shaped update: A [..in, r] @ B [r, ..out] -> [..in, ..out]."""
    return jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)


def merge(base, adapters, scale: float, dtype=None):
    """W + scale * B A for every adapted kernel -> plain params (the sampler's per-version copy,
    a merged export); `dtype`: of the floating leaves (default: the base's)."""
    def layer(mod, ad):
        out = {}
        for name, sub in mod.items():
            if isinstance(sub, dict) and "kernel" in sub and f"{name}{MARK}a" in ad:
                k = sub["kernel"]
                d = _delta(ad[f"{name}{MARK}a"], ad[f"{name}{MARK}b"]) * scale
                sub = dict(sub, kernel=(k.astype(jnp.float32) + d).astype(k.dtype))
            elif isinstance(sub, dict):
                sub = layer(sub, ad.get(name, {}))
            out[name] = sub
        return out

    merged = layer(base, adapters)
    if dtype is not None:
        merged = jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                        merged)
    return merged


def size_bytes(tree) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def num_params(cfg) -> int:
    """Adapter parameters of a LoRA `ModelConfig` (every layer, every target)."""
    d, f, r = cfg.hidden_size, cfg.intermediate_size, cfg.lora_rank
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    return cfg.num_layers * sum(r * (i + o) for t, (i, o) in dims.items() if t in cfg.lora_targets)
