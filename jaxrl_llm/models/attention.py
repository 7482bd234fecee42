"""The attention kernels of the decoder and the choice between them (`model.attention`).

One call, `attention(q, k, v, mask, cfg)`, serves the learner, prefill and decode. `mask` is
either a dense boolean [B, T, S] (left padding, causality, packed segments, a cache's filled
positions, per-slot lengths: anything) or `Segments`: causal self-attention within equal
segment ids, the only form Pallas' splash kernel takes (it builds its mask from a static
causal pattern and per-token segment ids, never from a dense array).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.parallel.sharding import BATCH_AXES

_SPLASH_LANES = 128  # splash blocks are multiples of TPU's 128 lanes; lengths are padded to one


@flax.struct.dataclass
class Segments:
    """Self-attention (T == S, no cache) that is causal and stays within equal ids; id 0 is
    padding. An unpacked row's ids are its input mask; a packed row's its segment numbers."""

    ids_BxL: jax.Array

    def dense(self) -> jax.Array:
        """The same mask as a [B, L, L] boolean: never onto padding, a padding query sees nothing."""
        ids = self.ids_BxL
        causal = jnp.tril(jnp.ones((ids.shape[1],) * 2, bool))
        return causal[None] & (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0)


def kernel(cfg: ModelConfig, platform: Optional[str] = None) -> str:
    """The attention kernel `cfg.attention` names on `platform` (default: JAX's backend), `auto`
    resolved: cuDNN's flash attention on GPU when the compute dtype is 16-bit (cuDNN takes no
    float32), else XLA's there; Pallas' splash kernel on TPU; chunked einsums on CPU."""
    impl = "xla" if cfg.attention == "dot_product_attention" else cfg.attention
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        return "cudnn" if cfg.dtype in ("bfloat16", "float16") else "xla"
    return "splash" if platform == "tpu" else "chunked"


def self_mask(cfg: ModelConfig, ids_BxL, dense_BxLxL):
    """What a full-sequence forward hands the layers: `Segments(ids_BxL)` for the splash kernel,
    else the dense mask `dense_BxLxL()` builds."""
    return Segments(ids_BxL.astype(jnp.int32)) if kernel(cfg) == "splash" else dense_BxLxL()


def on_mesh(cfg: ModelConfig, mesh):
    """Context for tracing a forward whose batch is sharded over `mesh`: splash (a Pallas call)
    and a mixture of experts' dispatch (`experts.on_devices`) are what XLA cannot partition, so they
    run under `shard_map` over the mesh this makes visible."""
    if (kernel(cfg) != "splash" and not cfg.num_experts) or mesh is None or mesh.size == 1:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def attention(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask, cfg: ModelConfig):
    """softmax(q k^T / sqrt(hd)) v over the keys `mask` allows, GQA by head groups -> [B, T, N, H].
    Keys come transposed ([B, KVH, hd, S]: the decode cache's layout). A query with no allowed
    key (padding) gets a finite, unused output. The kernel is `kernel(cfg)`'s:

      xla | cudnn  `jax.nn.dot_product_attention` with that implementation (cuDNN: flash
                   attention, no [T, S] scores held);
      splash       Pallas' splash (flash) kernel, given `Segments`; attention over a cache
                   (prefill, decode: a dense mask) takes XLA's instead;
      einsum       head-major einsums, q [B, KVH, G*T, hd] @ k [B, KVH, hd, S] as plain batched
                   GEMMs (~5x faster than contracting k along its minor dim for decode on CPU);
      chunked      the einsums in blocks of `attention_chunk` queries (the last block padded),
                   each recomputed in the backward pass, so a layer never holds more than one
                   block's [chunk, S] scores (the full [T, S] grow as T^2: 235 MB per layer for
                   2 x 1,024 tokens and 14 heads in float32). Same values: softmax is per query."""
    impl = kernel(cfg)
    if isinstance(mask, Segments):
        if impl == "splash":
            return _splash(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask.ids_BxL, cfg)
        mask = mask.dense()
    if impl in ("xla", "cudnn", "splash"):
        return _fused(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask, cfg, "xla" if impl == "splash" else impl)
    b, t = q_BxTxNxH.shape[:2]
    chunk = cfg.attention_chunk
    if impl == "einsum" or not chunk or t <= chunk:
        return _einsum(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask, cfg)
    n = -(-t // chunk)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    split = lambda x: pad(x).reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
    one = jax.checkpoint(lambda qm: _einsum(qm[0], k_BxKxHxS, v_BxKxSxH, qm[1], cfg))
    out = jax.lax.map(one, (split(q_BxTxNxH), split(mask)))
    return out.swapaxes(0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t]


def _fused(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask_BxTxS, cfg: ModelConfig, implementation: str):
    k, v = k_BxKxHxS.transpose(0, 3, 1, 2), v_BxKxSxH.transpose(0, 2, 1, 3)  # [B, S, KVH, hd]
    # A padding query with no allowed key: let it see key 0 (its output is unused) so that no
    # kernel divides by an empty softmax.
    first = jnp.arange(mask_BxTxS.shape[-1])[None, None, :] == 0
    mask = mask_BxTxS | (~jnp.any(mask_BxTxS, -1, keepdims=True) & first)
    return jax.nn.dot_product_attention(q_BxTxNxH.astype(cfg.dtype), k.astype(cfg.dtype), v.astype(cfg.dtype),
                                        mask=mask[:, None], implementation=implementation).astype(cfg.dtype)


def _einsum(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, mask_BxTxS, cfg: ModelConfig):
    b, t = q_BxTxNxH.shape[:2]
    kv, groups, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q = q_BxTxNxH.reshape(b, t, kv, groups, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, groups * t, hd)
    scores = jnp.einsum("bkqd,bkds->bkqs", q, k_BxKxHxS.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, groups, t, -1) / math.sqrt(hd)
    scores = jnp.where(mask_BxTxS[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, -1).astype(cfg.dtype).reshape(b, kv, groups * t, -1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v_BxKxSxH.astype(cfg.dtype))
    return out.reshape(b, kv, groups, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads, hd)


@functools.lru_cache(maxsize=None)
def _splash_kernel(heads: int, length: int, interpret: bool):
    """One splash kernel per (heads, padded length): the causal pattern is processed into block
    tables on the host when it is built, so it is built once."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    block = next(b for b in (512, 256, _SPLASH_LANES) if length % b == 0)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(heads)])
    with jax.ensure_compile_time_eval():  # its block tables are constants, never a trace's values
        return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, ids_BxT, cfg: ModelConfig):
    b, t = q_BxTxNxH.shape[:2]
    length = -(-t // _SPLASH_LANES) * _SPLASH_LANES
    pad = lambda x, axis: jnp.pad(x, [(0, length - t if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    # Splash's layout: [heads, length, hd] per row; the softmax scale goes on the queries.
    q = pad((q_BxTxNxH / math.sqrt(cfg.head_dim)).astype(cfg.dtype).transpose(0, 2, 1, 3), 2)
    k = pad(k_BxKxHxS.astype(cfg.dtype).transpose(0, 1, 3, 2), 2)
    v = pad(v_BxKxSxH.astype(cfg.dtype), 2)
    ids = pad(ids_BxT, 1)  # the tail joins padding's id 0; causality keeps every row non-empty
    interpret = jax.default_backend() != "tpu"  # elsewhere Pallas' interpreter runs it (tests)

    def rows(q, k, v, ids):
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

        run = _splash_kernel(q.shape[1], length, interpret)
        return jax.vmap(lambda q, k, v, i: run(q, k, v, segment_ids=SegmentIds(i, i)))(q, k, v, ids)

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
        tensor = mesh.shape.get("tensor", 1)
        # Heads split over `tensor` only where KV heads do too (else replicated, as `sharding._rules`)
        heads = "tensor" if tensor > 1 and cfg.num_kv_heads % tensor == 0 else None
        spec = P(batch, heads)
        rows = jax.shard_map(rows, mesh=mesh, in_specs=(spec, spec, spec, P(batch)), out_specs=spec,
                             check_vma=False)
    out = rows(q, k, v, ids)
    return out[:, :, :t].transpose(0, 2, 1, 3)
