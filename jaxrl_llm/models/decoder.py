"""Flax decoder for Qwen2 / Qwen3 / Llama and their mixtures of experts (`moe.py`): GQA, RoPE
(linear / Llama-3 / YaRN scaling), RMSNorm, SwiGLU, optional attention and MLP biases.

Parameters carry logical axis names (embed, heads, kv_heads, kv, mlp, vocab) for sharding rules.
The model returns final hidden states; logits are formed by the chunked log-prob heads
(`heads.py`) so the full [B, L, V] tensor is never built for a batch.

KV cache: a list (one per layer) of {"k": [B, KVH, hd, S], "v": [B, KVH, S, hd]} (head-major,
keys pre-transposed). A call with a cache
writes its T new keys/values at buffer index `cache_index` (the same for every row: prompts
are left-padded to a bucket; or, for one new token, an i32[B] of per-row indices: decode
slots at different depths) and attends over the whole buffer through `mask_BxTxS`.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import lora
from jaxrl_llm.models.attention import Segments, attention, self_mask
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.moe import MoE

_init = nn.initializers.normal(stddev=0.02)


def _part(init, axes):
    return nn.with_logical_partitioning(init, axes)


def rope_inv_freq(cfg: ModelConfig):
    """(inverse frequencies [hd/2], attention factor on sin/cos) for `cfg.rope_type`, as
    transformers' modeling_rope_utils computes them: `linear` divides every frequency by the
    factor; `llama3` rescales low frequencies and smooths the band between; `yarn` (YaRN,
    arXiv:2309.00071, Qwen2.5's long-context setting) ramps from extrapolated high to
    interpolated low frequencies and scales sin/cos by 0.1 ln(factor) + 1 (or its mscale form)."""
    hd, r = cfg.head_dim, cfg.rope
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    scale = 1.0
    if cfg.rope_type == "linear":
        inv = inv / r["factor"]
    elif cfg.rope_type == "llama3":
        factor, lo_f, hi_f = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        orig = r["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / lo_f, orig / hi_f
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (orig / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled)
    elif cfg.rope_type == "yarn":
        factor, orig = r["factor"], r["original_max_position_embeddings"]

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        scale = r.get("attention_factor") or (
            mscale(factor, r["mscale"]) / mscale(factor, r["mscale_all_dim"])
            if r.get("mscale") and r.get("mscale_all_dim") else mscale(factor))

        def dim_of(rotations):  # the dimension that turns `rotations` times over `orig` positions
            return hd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low, high = dim_of(r["beta_fast"]), dim_of(r["beta_slow"])
        if r["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        ramp = np.clip((np.arange(hd // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
        extrapolate = 1 - ramp
        inv = inv / factor * (1 - extrapolate) + inv * extrapolate
    return inv.astype(np.float32), float(scale)


def rope_tables(positions_BxT, cfg: ModelConfig):
    inv, scale = rope_inv_freq(cfg)
    angles = positions_BxT.astype(jnp.float32)[..., None] * inv[None, None, :]
    angles = jnp.concatenate([angles, angles], -1)  # HF rotate_half layout
    return jnp.sin(angles) * scale, jnp.cos(angles) * scale


def apply_rope(x_BxTxHxD, sin_BxTxD, cos_BxTxD):
    x = x_BxTxHxD.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    out = x * cos_BxTxD[:, :, None, :] + rotated * sin_BxTxD[:, :, None, :]
    return out.astype(x_BxTxHxD.dtype)


class RMSNorm(nn.Module):
    eps: float
    axis: str = "embed"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", _part(nn.initializers.ones, (self.axis,)), (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + self.eps)
        scale = scale.astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return (xf.astype(x.dtype) * scale).astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, sin, cos, mask_BxTxS, cache=None, cache_index=0):
        c = self.cfg
        b, t = x_BxTxD.shape[:2]
        x_NxD = x_BxTxD.reshape(b * t, -1)  # 2-D GEMMs: see MLP

        def proj(name, heads):
            axis = "heads" if name == "q" else "kv_heads"  # KV heads may be replicated (`sharding.rules`)
            y = nn.DenseGeneral(
                (heads, c.head_dim), use_bias=c.qkv_bias, name=name, dtype=c.dtype, param_dtype=c.param_dtype,
                kernel_init=_part(_init, ("embed", axis, "kv")),
                bias_init=_part(nn.initializers.zeros, (axis, "kv")),
            )(x_NxD)
            return (y + lora.side(self, name, x_NxD, (heads, c.head_dim))).reshape(b, t, heads, c.head_dim)

        q, k, v = proj("q", c.num_heads), proj("k", c.num_kv_heads), proj("v", c.num_kv_heads)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, "kv", c.param_dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, "kv", c.param_dtype, name="k_norm")(k)
        q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
        # Keys stored transposed [B, KVH, hd, S] and values [B, KVH, S, hd] (see `attention`).
        k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
        new_cache = None
        if cache is not None and jnp.ndim(cache_index):  # one write position per row (slots; T = 1)
            rows = jnp.arange(b)
            k = cache["k"].at[rows, :, :, cache_index].set(k[..., 0].astype(cache["k"].dtype))
            v = cache["v"].at[rows, :, cache_index, :].set(v[:, :, 0].astype(cache["v"].dtype))
            new_cache = {"k": k, "v": v}
        elif cache is not None:
            k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, 0, 0, cache_index))
            v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, 0, cache_index, 0))
            new_cache = {"k": k, "v": v}
        out = attention(q, k, v, mask_BxTxS, c).reshape(b * t, c.num_heads, c.head_dim)
        o = nn.DenseGeneral(
            c.hidden_size, axis=(-2, -1), use_bias=c.o_bias, name="o", dtype=c.dtype, param_dtype=c.param_dtype,
            kernel_init=_part(_init, ("heads", "kv", "embed")), bias_init=_part(nn.initializers.zeros, ("embed",)),
        )(out)
        o = o + lora.side(self, "o", out, (c.hidden_size,), in_axes=2)
        return o.reshape(b, t, -1), new_cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        c = self.cfg
        # Flatten tokens: with [B, T, D] operands XLA:CPU materialises the weight-gradient
        # operand transposed (column-order writes), ~3x slower MLP backward than 2-D GEMMs.
        x = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])

        def dense(name, feats, axes, x):
            y = nn.Dense(feats, use_bias=c.mlp_bias, name=name, dtype=c.dtype, param_dtype=c.param_dtype,
                         kernel_init=_part(_init, axes), bias_init=_part(nn.initializers.zeros, axes[1:]))(x)
            # a mixture of experts' dense layers stay frozen, as in PEFT (`lora.py`)
            return y + (0 if c.num_experts else lora.side(self, name, x, (feats,)))

        h = nn.silu(dense("gate", c.intermediate_size, ("embed", "mlp"), x)) * dense(
            "up", c.intermediate_size, ("embed", "mlp"), x)
        return dense("down", c.hidden_size, ("mlp", "embed"), h).reshape(x_BxTxD.shape)


class Block(nn.Module):
    cfg: ModelConfig
    sparse: bool = False  # a mixture-of-experts layer (`moe.py`)

    @nn.compact
    def __call__(self, x, sin, cos, mask, cache=None, cache_index=0, routing=None):
        """-> (x, the updated cache, a sparse layer's router logits [B T, E] or None)."""
        c = self.cfg
        h, new_cache = Attention(c, name="attn")(
            RMSNorm(c.rms_norm_eps, param_dtype=c.param_dtype, name="input_norm")(x), sin, cos, mask, cache, cache_index)
        x = x + h
        normed = RMSNorm(c.rms_norm_eps, param_dtype=c.param_dtype, name="post_norm")(x)
        y, logits = MoE(c, name="moe")(normed, routing) if self.sparse else (MLP(c, name="mlp")(normed), None)
        return x + y, new_cache, logits


def _block_out(mdl, x, sin, cos, mask, routing=None):
    return mdl(x, sin, cos, mask, routing=routing)[0]


def _block_with_logits(mdl, x, sin, cos, mask, routing=None):
    out, _, logits = mdl(x, sin, cos, mask, routing=routing)
    return out, logits


def _saving_inputs(out):
    """The forward of `recomputed_block`'s custom VJP: `out`'s result, and the layer's inputs."""
    def fwd(mdl, x, sin, cos, mask, routing=None):
        return out(mdl, x, sin, cos, mask, routing), (mdl.variables["params"], x, sin, cos, mask, routing)
    return fwd


@functools.lru_cache(maxsize=None)
def recomputed_block(cfg: ModelConfig, sparse: bool = False, logits: bool = False):
    """`remat=full`: a decoder layer that keeps only its inputs and recomputes itself in the
    backward pass once that layer's turn has come. Under `jax.checkpoint` the recomputation
    depends only on the saved inputs, and when the update needs every gradient first (global-norm
    clipping, the non-finite check) XLA:CPU's scheduler hoists every layer's recomputation and
    defers its weight-gradient matmuls: all layers' MLP and attention intermediates were live at
    once, well past the memory plan (the figures: CHANGELOG, "remat"). `logits`: a sparse layer
    also returns its router logits (the load-balancing loss), their cotangent taken too."""

    def bwd(res, g):
        params, x, sin, cos, mask, routing = res
        # XLA:CPU drops optimization barriers before it schedules; a data dependence stays
        # (0 * g is not folded for floats: it would be NaN for a non-finite g).
        late = 0 * (g[0] if logits else g).reshape(-1)[0]
        x = x + late.astype(x.dtype)

        def apply(p, x, sin, cos):
            out, _, router = Block(cfg, sparse).apply({"params": p}, x, sin, cos, mask, routing=routing)
            return (out, router) if logits else out

        if cfg.lora_rank:  # the frozen base gets no weight gradient (zeros, dropped by XLA)
            base, adapters = lora.split(params)
            apply_adapters = lambda a, x, sin, cos: apply(lora.combine(base, a), x, sin, cos)
            trained, dx, dsin, dcos = jax.vjp(apply_adapters, adapters, x, sin, cos)[1](g)
            dparams = lora.combine(jax.tree_util.tree_map(jnp.zeros_like, base), trained)
        else:
            trained, dx, dsin, dcos = jax.vjp(apply, params, x, sin, cos)[1](g)
            dparams = trained
        # The layer below starts from dx, so its recomputation also waits for this layer's
        # weight gradients: XLA otherwise defers them (nothing else needs them) and keeps
        # every layer's intermediates alive until then.
        done = sum(jnp.sum(d) for d in jax.tree_util.tree_leaves(trained))
        return {"params": dparams}, dx + 0 * done.astype(dx.dtype), dsin, dcos, None, None

    out = _block_with_logits if logits else _block_out
    return nn.custom_vjp(out, forward_fn=_saving_inputs(out), backward_fn=bwd)


class Decoder(nn.Module):
    """tokens [B, T] -> final hidden states [B, T, D] (and the updated cache)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=0, routing_BxTxMxK=None,
                 router_logits: bool = False):
        """`routing_BxTxMxK`: the experts each position uses in each sparse layer (replay); None:
        the routers choose. `router_logits`: sow each sparse layer's router logits
        (`intermediates/router_logits`, differentiable: the load-balancing loss)."""
        c = self.cfg
        embed = self.param("embed", _part(_init, ("vocab", "embed")), (c.vocab_size, c.hidden_size), c.param_dtype)
        if not c.tie_word_embeddings:
            self.param("lm_head", _part(_init, ("embed", "vocab")), (c.hidden_size, c.vocab_size), c.param_dtype)
        x = jnp.take(embed, tokens_BxT, axis=0).astype(c.dtype)
        sin, cos = rope_tables(positions_BxT, c)
        new_cache = []
        training = c.remat != "none" and cache is None  # decoding keeps nothing for grad
        block = nn.remat(Block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable) \
            if training and c.remat == "dots" else Block
        sparse = [i for i in range(c.num_layers) if c.sparse(i)]
        for i in range(c.num_layers):
            layer = block(c, c.sparse(i), name=f"layers_{i}")
            r = None if routing_BxTxMxK is None or i not in sparse else routing_BxTxMxK[:, :, sparse.index(i)]
            keep = router_logits and c.sparse(i)
            if training and c.remat == "full":
                x = recomputed_block(c, c.sparse(i), keep)(layer, x, sin, cos, mask_BxTxS, r)
                x, logits = x if keep else (x, None)
            else:
                x, layer_cache, logits = layer(x, sin, cos, mask_BxTxS, None if cache is None else cache[i],
                                               cache_index, routing=r)
                new_cache.append(layer_cache)
            if keep:
                self.sow("intermediates", "router_logits", logits)
        x = RMSNorm(c.rms_norm_eps, param_dtype=c.param_dtype, name="final_norm")(x)
        return x, (new_cache if cache is not None else None)


def unembed_matrix(params, cfg: ModelConfig):
    """[D, V] output projection (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def init_params(cfg: ModelConfig, key):
    """Random parameters (plain arrays) for `cfg`, the tree `Decoder(cfg).init` makes. Each kind
    of layer (dense, sparse) is drawn by one layer's init mapped over its layers' keys: drawn
    layer by layer, the program held every layer's random draws inlined (XLA:GPU took 60-74 s to
    compile a 24-layer 0.5B model's init on an H200), and its size grew with depth."""
    shell_key, layers_key = jax.random.split(key)
    tokens = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2, 2), bool)
    params = dict(nn.meta.unbox(Decoder(cfg.replace(num_layers=0)).init(shell_key, tokens, tokens, mask))["params"])
    keys = jax.random.split(layers_key, cfg.num_layers)
    x = jnp.zeros((1, 2, cfg.hidden_size), cfg.dtype)
    sin, cos = rope_tables(tokens, cfg)
    # The init's forward runs under vmap: kernels with a batching rule (the parameters are the same)
    plain = cfg.replace(attention="einsum", moe_dispatch="dense")
    for sparse in (False, True):
        index = [i for i in range(cfg.num_layers) if cfg.sparse(i) == sparse]
        if not index:
            continue
        one = lambda k, s=sparse: nn.meta.unbox(Block(plain, s).init(k, x, sin, cos, mask))["params"]  # noqa: E731
        stacked = jax.vmap(one)(keys[np.asarray(index)])
        params.update({f"layers_{i}": jax.tree_util.tree_map(lambda a, j=j: a[j], stacked)
                       for j, i in enumerate(index)})
    return params


def logical_axes(cfg: ModelConfig):
    """PartitionSpec tree of logical axis names matching `init_params`."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    shapes = jax.eval_shape(
        lambda: Decoder(cfg).init(jax.random.key(0), tokens, tokens, jnp.ones((1, 2, 2), bool)))
    return nn.get_partition_spec(shapes)["params"]


def padding_positions(input_mask_BxL):
    """RoPE positions that skip left padding: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(input_mask_BxL.astype(jnp.int32), -1) - 1, 0)


def causal_mask(input_mask_BxL):
    """[B, L, L] attention mask: causal and only onto real (non-pad) keys."""
    length = input_mask_BxL.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    return causal[None] & (input_mask_BxL[:, None, :] > 0)


def forward(params, cfg: ModelConfig, tokens_BxL, input_mask_BxL, routing=None, router_logits: bool = False):
    """Full-sequence forward (learner / teacher forcing): hidden states [B, L, D]. With `routing`
    [B, L, M, K] (the sampler's experts: replayed under `moe_routing=replay`) or `router_logits`:
    (hidden, extras), extras holding `routing_differs` (the number of sparse layers whose top k
    differs from `routing` at each position [B, L]) and / or `router_logits` (each sparse
    layer's [B L, E], differentiable)."""
    mask = self_mask(cfg, input_mask_BxL, lambda: causal_mask(input_mask_BxL))
    return _apply(params, cfg, tokens_BxL, padding_positions(input_mask_BxL), mask, routing, router_logits)


def _apply(params, cfg: ModelConfig, tokens_BxL, positions_BxL, mask, routing, router_logits=False):
    if routing is None and not router_logits:
        return Decoder(cfg).apply({"params": params}, tokens_BxL, positions_BxL, mask)[0]
    (hidden, _), variables = Decoder(cfg).apply({"params": params}, tokens_BxL, positions_BxL, mask,
                                                routing_BxTxMxK=routing, router_logits=router_logits,
                                                mutable=["intermediates"])
    inter, extras = variables["intermediates"], {}
    if routing is not None:
        extras["routing_differs"] = sum(inter[f"layers_{i}"]["moe"]["routing_differs"][0]
                                        for i in range(cfg.num_layers) if cfg.sparse(i)).reshape(tokens_BxL.shape)
    if router_logits:
        extras["router_logits"] = list(inter["router_logits"])
    return hidden, extras


def routing_of(variables, cfg: ModelConfig, b: int, t: int):
    """The experts each position used, [B, T, M, K] int16, from an apply's `intermediates`."""
    inter = variables["intermediates"]
    ids = [inter[f"layers_{i}"]["moe"]["routing"][0] for i in range(cfg.num_layers) if cfg.sparse(i)]
    return jnp.stack(ids, 1).reshape(b, t, len(ids), -1).astype(jnp.int16)


def segment_mask(segment_BxL):
    """[B, L, L] attention mask of packed rows: causal, within one segment, never onto padding
    (segment 0). A padding query attends nothing (its output is finite and unused)."""
    return Segments(segment_BxL).dense()


def forward_packed(params, cfg: ModelConfig, tokens_BxL, segment_BxL, position_BxL, routing=None,
                   router_logits: bool = False):
    """Full-sequence forward over packed rows (several sequences per row, `packing.py`)."""
    mask = self_mask(cfg, segment_BxL, lambda: segment_mask(segment_BxL))
    return _apply(params, cfg, tokens_BxL, position_BxL, mask, routing, router_logits)

