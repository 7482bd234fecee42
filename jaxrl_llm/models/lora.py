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
A mixture of experts' stacked experts (`expert_side`) are adapted as PEFT's `target_parameters`
adapts transformers' fused `experts.gate_up_proj` [E, 2F, D] and `experts.down_proj` [E, D, F]:
one rank-r adapter per expert, gate and up sharing their A (one weight there, so `gate` and `up`
are targeted together):
  gate_up_lora_a [E, D, r], gate_lora_b / up_lora_b [E, r, F]     down_lora_a [E, F, r], down_lora_b [E, r, D]
(PEFT: lora_A [r E, in], lora_B [out, r E], `models/adapters.py` converts). On a mixture of
experts these targets adapt the stacked experts only, as in PEFT, which maps `gate_proj` /
`up_proj` / `down_proj` module targets of an MoE model type to the experts' parameters: a
Qwen2-MoE shared expert and the dense MLP layers (`mlp_only_layers`) stay frozen.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import validation as V

# target name -> (the decoder module that owns it, its HF module name)
TARGETS = {"q": ("attn", "self_attn.q_proj"), "k": ("attn", "self_attn.k_proj"), "v": ("attn", "self_attn.v_proj"),
           "o": ("attn", "self_attn.o_proj"), "gate": ("mlp", "mlp.gate_proj"), "up": ("mlp", "mlp.up_proj"),
           "down": ("mlp", "mlp.down_proj")}
MARK = "_lora_"  # in every adapter leaf's name, and in no base leaf's
SHARED_A = {"gate": "gate_up", "up": "gate_up"}  # stacked experts: the A each projection's B follows
EXPERT_MLP = ("gate", "up", "down")


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


def uniform_stacked_a(key, shape, dtype=jnp.float32):
    """`uniform_a` for stacked experts' A [E, in, r]: PEFT's bound over `in` (its lora_A [r E, in])."""
    return jax.random.uniform(key, shape, dtype, -1.0, 1.0) / np.sqrt(int(np.prod(shape[1:-1])))


def side(mdl: nn.Module, name: str, x_NxI, out_shape, in_axes: int = 1):
    """LoRA's side path of projection `name` (a param of module `mdl`): scale * (x A) B, shaped
    like the projection's output; 0 (nothing traced) when `name` is not adapted. `in_axes`: how
    many of A's leading dims `x` contracts (2 for o's [H, hd])."""
    c = mdl.cfg
    if not c.adapts(name):
        return 0
    a = mdl.param(f"{name}{MARK}a", uniform_a, (*x_NxI.shape[-in_axes:], c.lora_rank), jnp.float32)
    b = mdl.param(f"{name}{MARK}b", nn.initializers.zeros, (c.lora_rank, *out_shape), jnp.float32)
    low = jnp.tensordot(x_NxI.astype(c.dtype), a.astype(c.dtype), axes=in_axes)
    return (jnp.tensordot(low, b.astype(c.dtype), axes=1) * jnp.asarray(c.lora_scale, c.dtype)).astype(c.dtype)


def expert_side(mdl: nn.Module, gate, up, down):
    """A mixture of experts' stacked projections with their adapters where `gate` / `down` are
    targeted: (W, A, alpha / r * B) per projection (`experts.py` runs them), else W. E times a
    projection's adapters, they are split as the experts they adapt (logical axes: expert, and
    the W's embed / mlp dims), not replicated as the others are."""
    c = mdl.cfg
    e, d, f, r = gate.shape[0], gate.shape[1], gate.shape[2], c.lora_rank
    a_init = lambda axis: nn.with_logical_partitioning(uniform_stacked_a, ("expert", axis, None))  # noqa: E731

    def scaled(name, shape, axis):
        b_init = nn.with_logical_partitioning(nn.initializers.zeros, ("expert", None, axis))
        return mdl.param(f"{name}{MARK}b", b_init, shape, jnp.float32) * c.lora_scale

    if c.adapts("gate"):  # and up (`ModelConfig` refuses one without the other)
        a = mdl.param(f"gate_up{MARK}a", a_init("embed"), (e, d, r), jnp.float32)
        gate, up = (gate, a, scaled("gate", (e, r, f), "mlp")), (up, a, scaled("up", (e, r, f), "mlp"))
    if c.adapts("down"):
        a = mdl.param(f"down{MARK}a", a_init("mlp"), (e, f, r), jnp.float32)
        down = (down, a, scaled("down", (e, r, d), "embed"))
    return gate, up, down


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


def _pair(ad, name):
    """The (A, B) adapting a module's raw (not `kernel`) weight `name`, such as stacked experts'
    [E, in, out], or None."""
    b = ad.get(f"{name}{MARK}b")
    a = ad.get(f"{name}{MARK}a", ad.get(f"{SHARED_A.get(name, name)}{MARK}a"))
    return None if a is None or b is None else (a, b)


def _added(w, a, b, scale):
    d = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32)) * scale
    return (w.astype(jnp.float32) + d).astype(w.dtype)


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
            elif _pair(ad, name) is not None:
                sub = _added(sub, *_pair(ad, name), scale)
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
    return sum(n for layer in range(cfg.num_layers) for n in _layer_params(cfg, layer))


def expert_params(cfg) -> int:
    """Those of `num_params` on stacked experts (split as the experts are, `expert_side`)."""
    return sum(_layer_params(cfg, layer)[1] for layer in range(cfg.num_layers))


def _layer_params(cfg, layer: int) -> tuple:
    """(adapters on per-token projections, adapters on stacked experts) of one layer."""
    d, r, e = cfg.hidden_size, cfg.lora_rank, cfg.num_experts
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d)}
    if not cfg.num_experts:  # a mixture of experts' gate / up / down: its experts only
        f = cfg.intermediate_size
        dims.update(gate=(d, f), up=(d, f), down=(f, d))
    flat = sum(r * (i + o) for t, (i, o) in dims.items() if t in cfg.lora_targets)
    if not cfg.sparse(layer):
        return flat, 0
    fe = cfg.moe_intermediate_size
    stacked = e * r * (d + 2 * fe) * ("gate" in cfg.lora_targets) + e * r * (fe + d) * ("down" in cfg.lora_targets)
    return flat, stacked
