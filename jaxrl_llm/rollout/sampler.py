"""Jitted sampler: one prefill, then a `lax.while_loop` decode over a KV cache.

Prompts are left-padded to a fixed bucket length P, so every row writes its t-th new token at
buffer index P + t (one `dynamic_update_slice` for the batch) and RoPE positions skip the pad.
The cache lives inside the jitted function and is carried through the loop, so XLA updates it
in place. Each generated token records its log-prob under the distribution it was actually
drawn from (temperature, then top-k / top-p truncation, renormalised), that distribution's
top-K, and the version of the params that produced it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import sharding
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    max_new_tokens: int = 96
    temperature: float = 1.0  # 0 -> greedy (recorded log-prob 0: a point mass)
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0  # 1: no nucleus truncation
    capture_topk: int = 0  # K of the recorded behaviour top-K (0 allowed)
    num_samples: int = 1  # G completions per prompt
    prompt_buckets: tuple = (16, 32, 64, 128, 256, 512, 1024, 2048)
    eos_token_id: Optional[int] = None
    pad_token_id: int = 0
    cache_dtype: str = "float32"
    decode_segment: int = 32  # decode steps per attention-window growth (0: one window)

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.capture_topk < 0:
            raise ValueError(f"invalid sampling options: {self}")
        if self.max_new_tokens < 1 or self.num_samples < 1:
            raise ValueError("max_new_tokens and num_samples must be >= 1")


def sampling_logprobs(logits_BxV, cfg: SamplerConfig):
    """log-probs of the distribution actually sampled from: softmax(logits / T) restricted to
    the top-k and then to the smallest nucleus with mass >= top_p, renormalised."""
    scaled = logits_BxV.astype(jnp.float32) / (cfg.temperature if cfg.temperature > 0 else 1.0)
    if cfg.top_k:
        kth = top_k(scaled, cfg.top_k)[0][..., -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    if cfg.top_p < 1.0:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, -1)
        mass_before = jnp.cumsum(probs, -1) - probs  # keep a token if the mass before it < top_p
        keep = mass_before < cfg.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), -1, keepdims=True)
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return jax.nn.log_softmax(scaled, -1)


def _vocab_block(v: int):
    """Block size for top-k screening (and two-level sampling) at large vocabularies: a power of
    two dividing V (so no padded entries exist), or None (small or awkward V: one-level top-k)."""
    if v < 4096:
        return None
    return next((c for c in (256, 128, 64) if v % c == 0), None)


def _cdf_block(v: int):
    """Block size of the two-level inverse CDF. Even at small V a cumsum over V lowers to a
    chain of reduce-windows on CPU (53 us at [32, 512] against 11 us in two levels of 32)."""
    return _vocab_block(v) or next((c for c in (32, 16) if v % c == 0 and v >= 4 * c), None)


def _inverse_cdf(logp_BxV, u_B):
    """Exact categorical draw from one uniform per row (the Gumbel trick needs V of them, which
    dominates decode time at large vocabularies on CPU). Where V splits into blocks, the inverse
    CDF is taken in two levels, blocks then tokens within the chosen block: a cumsum over V
    lowers to a slow log-depth scan on CPU, while block sums are one fused reduction."""
    p = jnp.exp(logp_BxV)
    b, v = p.shape
    c = _cdf_block(v)
    if c is None:
        cdf = jnp.cumsum(p, -1)
        # u strictly below the total mass, so the first index with cdf > u exists and has p > 0.
        u = u_B[:, None] * cdf[:, -1:] * (1.0 - 1e-6)
        return jnp.sum(cdf <= u, -1).astype(jnp.int32)
    p_BxNxC = p.reshape(b, v // c, c)
    cdf_blocks = jnp.cumsum(p_BxNxC.sum(-1), -1)
    u = u_B * cdf_blocks[:, -1] * (1.0 - 1e-6)
    blk = jnp.sum(cdf_blocks <= u[:, None], -1)  # first block whose cdf exceeds u: mass > 0
    before = jnp.where(blk > 0, jnp.take_along_axis(cdf_blocks, jnp.maximum(blk - 1, 0)[:, None], 1)[:, 0], 0.0)
    within = jnp.take_along_axis(p_BxNxC, blk[:, None, None], 1)[:, 0]  # [B, C]
    idx = jnp.sum(before[:, None] + jnp.cumsum(within, -1) <= u[:, None], -1)
    # Rounding between the block sum and the in-block cumsum may leave idx one past the end:
    # fall back to the block's last token of positive probability.
    last = c - 1 - jnp.argmax((within > 0)[:, ::-1], -1)
    return (blk * c + jnp.minimum(idx, last)).astype(jnp.int32)


def top_k(x_BxV, k: int):
    """`lax.top_k` over the last axis (values, ids). At large V it first keeps the k blocks with
    the largest maxima (every top-k entry lies in one of them) and ranks only their entries:
    XLA:CPU's TopK scans the whole row serially, a fused block max is far cheaper."""
    b, v = x_BxV.shape
    c = _vocab_block(v)
    if c is None or k > c or k * c >= v:
        return jax.lax.top_k(x_BxV, k)
    blocks = x_BxV.reshape(b, v // c, c)
    # Ascending block order: ties among candidates then go to the lower vocabulary id.
    chosen = jnp.sort(jax.lax.top_k(blocks.max(-1), k)[1], -1)  # [B, k]
    cand = jnp.take_along_axis(blocks, chosen[:, :, None], 1).reshape(b, k * c)
    vals, j = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(chosen, j // c, 1) * c + j % c


def _sample(logits_BxV, u_B, cfg: SamplerConfig):
    if cfg.temperature == 0:
        tok = jnp.argmax(logits_BxV, -1).astype(jnp.int32)
        logp_all = jnp.where(jnp.arange(logits_BxV.shape[-1]) == tok[:, None], 0.0, -jnp.inf)
    else:
        logp_all = sampling_logprobs(logits_BxV, cfg)
        tok = _inverse_cdf(logp_all, u_B)
    logp = jnp.take_along_axis(logp_all, tok[:, None], -1)[:, 0]
    if cfg.capture_topk:
        top_logp, top_ids = top_k(logp_all, cfg.capture_topk)
    else:
        b = logits_BxV.shape[0]
        top_logp, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    return tok, logp, top_ids.astype(jnp.int32), top_logp


def _pad_cache(cache, key_valid, width):
    """Grow the cache and key mask to `width` positions (a copy once per segment)."""
    extra = width - key_valid.shape[1]
    grown = [{"k": jnp.pad(c["k"], [(0, 0)] * 3 + [(0, extra)]),
              "v": jnp.pad(c["v"], [(0, 0), (0, 0), (0, extra), (0, 0)])} for c in cache]
    return grown, jnp.pad(key_valid, [(0, 0), (0, extra)])


def _prefill(params, prompt_BxP, prompt_mask_BxP, key, version, mcfg: ModelConfig, scfg: SamplerConfig, rows=None):
    """Run the prompt through the model; the decode state for `_decode_segment`. `rows`: the
    mesh axes the batch is split over (inside `shard_map`), so draws follow global row ids."""
    b, p = prompt_BxP.shape
    n = scfg.max_new_tokens
    width = p + _segment_ends(n, scfg)[0]
    cache = [{"k": jnp.zeros((b, mcfg.num_kv_heads, mcfg.head_dim, width), scfg.cache_dtype),
              "v": jnp.zeros((b, mcfg.num_kv_heads, width, mcfg.head_dim), scfg.cache_dtype)}
             for _ in range(mcfg.num_layers)]
    key_valid = jnp.concatenate([prompt_mask_BxP > 0, jnp.zeros((b, width - p), bool)], 1)
    positions = decoder.padding_positions(prompt_mask_BxP)
    causal = jnp.arange(width)[None, :] <= jnp.arange(p)[:, None]
    hidden, cache = decoder.Decoder(mcfg).apply({"params": params}, prompt_BxP, positions,
                                                causal[None] & key_valid[:, None, :], cache, 0)
    k = scfg.capture_topk
    unembed = decoder.unembed_matrix(params, mcfg).astype(jnp.float32)
    # One uniform per (step, row), drawn once from (key, row) alone: draws depend neither on
    # segment boundaries nor on rows padded for a mesh, and no PRNG rounds run in the loop.
    row0 = jax.lax.axis_index(rows) * b if rows else 0
    u_NxB = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(key, r), (n,)), out_axes=1)(row0 + jnp.arange(b))
    return dict(
        i=jnp.int32(0), u=u_NxB, cache=cache, logits=hidden[:, -1].astype(jnp.float32) @ unembed,
        key_valid=key_valid,
        pos=positions[:, -1] + 1, done=jnp.zeros((b,), bool),
        logits_version=jnp.asarray(version, jnp.int32),  # the params version that computed `logits`
        tokens=jnp.full((b, n), scfg.pad_token_id, jnp.int32), valid=jnp.zeros((b, n), bool),
        logp=jnp.zeros((b, n), jnp.float32), versions=jnp.full((b, n), -1, jnp.int32),
        topk_ids=jnp.zeros((b, n, k), jnp.int32), topk_logp=jnp.zeros((b, n, k), jnp.float32),
    )


def _segment_ends(n: int, scfg: SamplerConfig) -> list:
    # Decode runs in segments of `decode_segment` steps; segment j attends over a cache of
    # p + (j+1) * seg positions, not the full p + n: decode is memory-bound on the cache reads.
    seg = min(scfg.decode_segment or n, n)
    return list(range(seg, n, seg)) + [n]


def _decode_segment(params, st, version, p: int, end: int, mcfg: ModelConfig, scfg: SamplerConfig):
    """Decode steps up to `end` with `params` (p = prompt bucket; both static), growing the
    cache to p + end first. A token is tagged with the version of the params whose logits it
    was sampled from, so a mid-generation weight swap tags tokens exactly."""
    if st["key_valid"].shape[1] < p + end:
        st = dict(st)
        st["cache"], st["key_valid"] = _pad_cache(st["cache"], st["key_valid"], p + end)
    model = decoder.Decoder(mcfg)
    unembed = decoder.unembed_matrix(params, mcfg).astype(jnp.float32)
    version = jnp.asarray(version, jnp.int32)

    def body(st):
        i = st["i"]
        tok, logp, top_ids, top_logp = _sample(st["logits"], st["u"][i], scfg)
        live = ~st["done"]
        tok = jnp.where(live, tok, scfg.pad_token_id)
        done = st["done"] | ((tok == scfg.eos_token_id) if scfg.eos_token_id is not None else False)
        key_valid = st["key_valid"].at[:, p + i].set(live)
        # Cache slots past p + i are not yet valid, so the key mask alone is causal.
        h, cache = model.apply({"params": params}, tok[:, None], st["pos"][:, None], key_valid[:, None, :],
                               st["cache"], p + i)
        col = (slice(None), i)
        return dict(
            i=i + 1, u=st["u"], cache=cache, logits=h[:, 0].astype(jnp.float32) @ unembed, key_valid=key_valid,
            pos=st["pos"] + 1, done=done, logits_version=version,
            tokens=st["tokens"].at[col].set(tok), valid=st["valid"].at[col].set(live),
            logp=st["logp"].at[col].set(jnp.where(live, logp, 0.0)),
            versions=st["versions"].at[col].set(jnp.where(live, st["logits_version"], -1)),
            topk_ids=st["topk_ids"].at[col].set(top_ids), topk_logp=st["topk_logp"].at[col].set(top_logp),
        )

    return jax.lax.while_loop(lambda st: (st["i"] < end) & ~jnp.all(st["done"]), body, st)


def _generate(params, prompt_BxP, prompt_mask_BxP, key, version, mcfg: ModelConfig, scfg: SamplerConfig, rows=None):
    st = _prefill(params, prompt_BxP, prompt_mask_BxP, key, version, mcfg, scfg, rows)
    for end in _segment_ends(scfg.max_new_tokens, scfg):
        st = _decode_segment(params, st, version, prompt_BxP.shape[1], end, mcfg, scfg)
    return _outputs(st)


def _outputs(st):
    return {k: st[k] for k in ("tokens", "valid", "logp", "versions", "topk_ids", "topk_logp", "done")}


def _state_specs(rows):
    """PartitionSpecs of the decode state with its rows split over the mesh axes `rows`."""
    r = PartitionSpec(rows)
    return dict(i=PartitionSpec(), u=PartitionSpec(None, rows), cache=r, logits=r, key_valid=r, pos=r, done=r,
                logits_version=PartitionSpec(), tokens=r, valid=r, logp=r, versions=r, topk_ids=r, topk_logp=r)


class Sampler:
    """`Sampler(model_cfg, sampler_cfg).generate(params, prompts, key, version)` -> TrajectoryBatch.

    One compiled program per (prompt bucket, batch size); batches of the same bucket and size
    never retrace. With a `mesh`, rows are split over all its devices (data parallel; params
    replicated onto the mesh unless they already live there), padded to a multiple of its size.
    Each device then runs the whole generation on its own rows (`shard_map`): no collective in
    the decode loop, and a device stops as soon as its own rows are done.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Optional[Mesh] = None):
        self.model_cfg, self.cfg, self.mesh = model_cfg, cfg, mesh
        self.traces = 0  # how often the program was traced (tests assert no retrace per bucket)
        rows = mesh and tuple(mesh.axis_names)
        local = lambda f, in_specs, out_specs: f if mesh is None else jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        r, rep = PartitionSpec(rows), PartitionSpec()

        def generate(params, prompt, mask, key, version, mcfg, scfg):
            self.traces += 1
            f = functools.partial(_generate, mcfg=mcfg, scfg=scfg, rows=rows)
            return local(f, (rep, r, r, rep, rep), r)(params, prompt, mask, key, version)

        def prefill(params, prompt, mask, key, version, mcfg, scfg):
            f = functools.partial(_prefill, mcfg=mcfg, scfg=scfg, rows=rows)
            return local(f, (rep, r, r, rep, rep), _state_specs(rows))(params, prompt, mask, key, version)

        def segment(params, st, version, p, end, mcfg, scfg):
            f = functools.partial(_decode_segment, p=p, end=end, mcfg=mcfg, scfg=scfg)
            return local(f, (rep, _state_specs(rows), rep), _state_specs(rows))(params, st, version)

        self._fn = jax.jit(generate, static_argnames=("mcfg", "scfg"))
        # Host-driven pieces for mid-generation weight refresh (same code, one jit per segment).
        self._prefill = jax.jit(prefill, static_argnames=("mcfg", "scfg"))
        self._segment = jax.jit(segment, static_argnames=("p", "end", "mcfg", "scfg"))

    def bucket(self, length: int) -> int:
        for b in self.cfg.prompt_buckets:
            if length <= b:
                return b
        raise ValueError(f"prompt of {length} tokens exceeds the largest bucket {self.cfg.prompt_buckets[-1]}; "
                         "add a bucket to SamplerConfig.prompt_buckets")

    def pad_prompts(self, prompts: Sequence[Sequence[int]]):
        """Left-pad to the bucket and repeat each prompt G times -> (tokens, mask, group_ids)."""
        if not len(prompts) or min(len(x) for x in prompts) == 0:
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        p = self.bucket(max(len(x) for x in prompts))
        g = self.cfg.num_samples
        toks = np.full((len(prompts), p), self.cfg.pad_token_id, np.int32)
        mask = np.zeros((len(prompts), p), np.int32)
        for i, x in enumerate(prompts):
            toks[i, p - len(x):] = x
            mask[i, p - len(x):] = 1
        return np.repeat(toks, g, 0), np.repeat(mask, g, 0), np.repeat(np.arange(len(prompts), dtype=np.int32), g)

    def generate(self, params, prompts, key, version: int = 0, refresh=None) -> TrajectoryBatch:
        """`refresh`: optional `() -> (version, params) | None`, asked between decode segments
        (every `decode_segment` tokens); when it returns newer weights, the rest of the batch is
        decoded with them (the KV cache of earlier tokens is kept, as in-flight weight updates
        do) and each token's `versions` entry names the params it was sampled from."""
        toks, mask, group_ids = self.pad_prompts(prompts)
        toks_j, mask_j, params = self._place(toks, mask, params)
        if refresh is None:
            out = self._fn(params, toks_j, mask_j, key, version, mcfg=self.model_cfg, scfg=self.cfg)
            return to_batch(toks, mask, group_ids, out)
        st = self._prefill(params, toks_j, mask_j, key, version, mcfg=self.model_cfg, scfg=self.cfg)
        for j, end in enumerate(_segment_ends(self.cfg.max_new_tokens, self.cfg)):
            newer = refresh() if j else None
            if newer is not None and newer[0] > version:
                version, params = newer[0], self._place(toks, mask, newer[1])[2]
            st = self._segment(params, st, version, p=toks.shape[1], end=end, mcfg=self.model_cfg, scfg=self.cfg)
        return to_batch(toks, mask, group_ids, _outputs(st))

    def _place(self, toks, mask, params):
        """Device arrays for the program: on the mesh, rows split (padded with copies of the
        last row, dropped again by `to_batch`) and params replicated unless already there
        (`sharding.put`: CPU devices share one host copy)."""
        if self.mesh is None:
            return jnp.asarray(toks), jnp.asarray(mask), params
        extra = -len(toks) % self.mesh.size
        rows = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        pad = lambda x: np.concatenate([x, np.repeat(x[-1:], extra, 0)])
        leaf = jax.tree_util.tree_leaves(params)[0]
        if getattr(leaf, "sharding", None) is None or leaf.sharding.device_set != set(self.mesh.devices.flat):
            params = sharding.put(params, NamedSharding(self.mesh, PartitionSpec()))  # one copy on CPU
        return jax.device_put(pad(toks), rows), jax.device_put(pad(mask), rows), params


def to_batch(prompt_BxP, prompt_mask_BxP, group_ids_B, out) -> TrajectoryBatch:
    """Sampler output -> the batch contract (prompt positions: mask 0, version -1)."""
    b, p = prompt_BxP.shape
    out = {k: v[:b] for k, v in out.items()}  # rows padded for a device mesh
    valid = out["valid"]
    k = out["topk_ids"].shape[-1]
    gen_mask = valid.astype(jnp.float32)
    return TrajectoryBatch(
        tokens=jnp.concatenate([jnp.asarray(prompt_BxP), out["tokens"]], 1),
        loss_mask=jnp.concatenate([jnp.zeros((b, p)), gen_mask], 1),
        behav_logp=jnp.concatenate([jnp.zeros((b, p)), out["logp"]], 1),
        versions=jnp.concatenate([jnp.full((b, p), -1, jnp.int32), out["versions"]], 1),
        topk_ids=jnp.concatenate([jnp.zeros((b, p, k), jnp.int32), out["topk_ids"]], 1),
        topk_logp=jnp.concatenate([jnp.zeros((b, p, k)), out["topk_logp"]], 1),
        rewards=jnp.zeros((b,)),
        group_ids=jnp.asarray(group_ids_B),
        advantages=jnp.zeros((b, p + valid.shape[1])),
        input_mask=jnp.concatenate([jnp.asarray(prompt_mask_BxP, jnp.float32), gen_mask], 1),
        truncated=~out["done"],
    )
