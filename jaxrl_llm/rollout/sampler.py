"""Jitted sampler: one prefill, then a `lax.while_loop` decode over a KV cache.

Prompts are left-padded to a fixed bucket length P, so every row writes its t-th new token at
buffer index P + t (one `dynamic_update_slice` for the batch) and RoPE positions skip the pad.
The cache lives inside the jitted function and is carried through the loop, so XLA updates it
in place. Each generated token records its log-prob under the distribution it was actually
drawn from (temperature, then top-k / top-p truncation, renormalised), that distribution's
top-K, and the version of the params that produced it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import sharding
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout.sampling import SamplerConfig, sample


@struct.dataclass
class DecodeState:
    """The decode loop's carry. B rows, N = max_new_tokens, W = prompt bucket + decoded width
    of the cache, K = capture_topk. Row-wise fields split over the sampler mesh. In a static
    batch every row is at the same step (`step`, `logits_version` scalars); in decode slots
    (`continuous.py`) each row is at its own (both i32[B])."""

    step: jax.Array  # i32[] or i32[B]: decode steps taken (= the next token's column)
    uniforms_NxB: jax.Array  # f32[N, B]: the draw of each (step, row), fixed at prefill
    cache: Any  # per layer {"k": [B, KV, Dh, W], "v": [B, KV, W, Dh]}
    logits_BxV: jax.Array  # f32: the next token's logits
    logits_version: jax.Array  # i32[] or i32[B]: the params version that computed `logits_BxV`
    key_valid_BxW: jax.Array  # bool: cache positions a query may attend to
    positions_B: jax.Array  # i32: RoPE position of the next token (skips left padding)
    limit_B: jax.Array  # i32: the row's budget of new tokens (<= N)
    done_B: jax.Array  # bool: row has emitted EOS or used its budget
    eos_B: jax.Array  # bool: row has emitted EOS (otherwise it is truncated)
    tokens_BxN: jax.Array  # i32: generated tokens (pad after EOS)
    valid_BxN: jax.Array  # bool: a generated (not padded) token
    logp_BxN: jax.Array  # f32: log-prob under the distribution sampled from
    kept_BxN: jax.Array  # i32: size of that distribution's support (top-k / top-p; 0 on padding)
    versions_BxN: jax.Array  # i32: params version of each token (-1 on padding)
    topk_ids_BxNxK: jax.Array  # i32: top-K of that distribution
    topk_logp_BxNxK: jax.Array  # f32

    @classmethod
    def specs(cls, rows, per_row: bool = False) -> "DecodeState":
        """PartitionSpecs with the rows split over the mesh axes `rows` (`per_row`: decode slots,
        whose `step` and `logits_version` are per row too)."""
        r = PartitionSpec(rows)
        fields = {f: r for f in cls.__dataclass_fields__}
        scalar = r if per_row else PartitionSpec()
        return cls(**{**fields, "step": scalar, "logits_version": scalar, "uniforms_NxB": PartitionSpec(None, rows)})


def _pad_cache(cache, key_valid, width):
    """Grow the cache and key mask to `width` positions (a copy once per segment)."""
    extra = width - key_valid.shape[1]
    grown = [{"k": jnp.pad(c["k"], [(0, 0)] * 3 + [(0, extra)]),
              "v": jnp.pad(c["v"], [(0, 0), (0, 0), (0, extra), (0, 0)])} for c in cache]
    return grown, jnp.pad(key_valid, [(0, 0), (0, extra)])


def row_keys(key, row_ids_B):
    """Each row's own key: `key` folded with the row's id (its index in the batch)."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(row_ids_B)


def row_uniforms(keys_B, n: int):
    """f32[N, B]: the uniform behind each new token of each row, from the row's key alone
    (uniform t drives the row's t-th new token). Draws depend neither on segment boundaries,
    nor on rows padded for a mesh, nor on which decode slot a row runs in, and no PRNG rounds
    run in the decode loop."""
    return jax.vmap(lambda k: jax.random.uniform(k, (n,)), out_axes=1)(keys_B)


def _prefill(params, prompt_BxP, prompt_mask_BxP, limit_B, key, version, mcfg: ModelConfig, scfg: SamplerConfig,
             rows=None, width=None, keys_B=None):
    """Run the prompt through the model -> the DecodeState for `_decode_segment`. `rows`: the
    mesh axes the batch is split over (inside `shard_map`), so draws follow global row ids;
    or `keys_B`, the rows' own keys (`row_keys`; `key` is then unused). `width`: cache
    positions to allocate (default: the prompt and the first segment)."""
    b, p = prompt_BxP.shape
    n = scfg.max_new_tokens
    width = width or p + _segment_ends(n, scfg)[0]
    cache = [{"k": jnp.zeros((b, mcfg.num_kv_heads, mcfg.head_dim, width), scfg.cache_dtype),
              "v": jnp.zeros((b, mcfg.num_kv_heads, width, mcfg.head_dim), scfg.cache_dtype)}
             for _ in range(mcfg.num_layers)]
    key_valid = jnp.concatenate([prompt_mask_BxP > 0, jnp.zeros((b, width - p), bool)], 1)
    positions = decoder.padding_positions(prompt_mask_BxP)
    causal = jnp.arange(width)[None, :] <= jnp.arange(p)[:, None]
    hidden, cache = decoder.Decoder(mcfg).apply({"params": params}, prompt_BxP, positions,
                                                causal[None] & key_valid[:, None, :], cache, 0)
    k = scfg.capture_topk
    unembed = unembed_matrix(params, mcfg)
    if keys_B is None:
        keys_B = row_keys(key, (jax.lax.axis_index(rows) * b if rows else 0) + jnp.arange(b))
    u_NxB = row_uniforms(keys_B, n)
    return DecodeState(
        step=jnp.int32(0), uniforms_NxB=u_NxB, cache=cache, logits_BxV=hidden[:, -1].astype(jnp.float32) @ unembed,
        logits_version=jnp.asarray(version, jnp.int32), key_valid_BxW=key_valid, positions_B=positions[:, -1] + 1,
        limit_B=limit_B, done_B=jnp.zeros((b,), bool), eos_B=jnp.zeros((b,), bool),
        tokens_BxN=jnp.full((b, n), scfg.pad_token_id, jnp.int32), valid_BxN=jnp.zeros((b, n), bool), logp_BxN=jnp.zeros((b, n), jnp.float32), kept_BxN=jnp.zeros((b, n), jnp.int32),
        versions_BxN=jnp.full((b, n), -1, jnp.int32), topk_ids_BxNxK=jnp.zeros((b, n, k), jnp.int32),
        topk_logp_BxNxK=jnp.zeros((b, n, k), jnp.float32),
    )


def _segment_ends(n: int, scfg: SamplerConfig) -> list:
    # Decode runs in segments of `decode_segment` steps; segment j attends over a cache of
    # p + (j+1) * seg positions, not the full p + n: decode is memory-bound on the cache reads.
    seg = min(scfg.decode_segment or n, n)
    return list(range(seg, n, seg)) + [n]


def _decode_segment(params, st: DecodeState, version, p: int, end: int, mcfg: ModelConfig, scfg: SamplerConfig):
    """Decode steps up to `end` with `params` (p = prompt bucket; both static), growing the
    cache to p + end first. A token is tagged with the version of the params whose logits it
    was sampled from, so a mid-generation weight swap tags tokens exactly."""
    if st.key_valid_BxW.shape[1] < p + end:
        cache, key_valid = _pad_cache(st.cache, st.key_valid_BxW, p + end)
        st = st.replace(cache=cache, key_valid_BxW=key_valid)
    body = functools.partial(decode_step, params, unembed_matrix(params, mcfg), version=version, p=p, mcfg=mcfg,
                             scfg=scfg)
    return jax.lax.while_loop(lambda st: (st.step < end) & ~jnp.all(st.done_B), body, st)


def unembed_matrix(params, mcfg: ModelConfig):
    """The f32 [D, V] output projection, formed once outside the decode loop (tied: a transpose)."""
    return decoder.unembed_matrix(params, mcfg).astype(jnp.float32)


def _upcast_in_loop(params, loop_variant):
    """XLA:CPU computes bfloat16 matmuls in float32: it converts each weight, and since the
    weights are loop-invariant, while-loop code motion hoists every convert out of the decode
    loop, so a bf16 sampler held a full float32 copy of its weights for the whole call (above a
    float32 sampler's peak). Tying the weights to a loop-variant value keeps each convert inside
    the step, where only one layer's float32 copy lives at a time. Measured at 0.5B shapes (16
    rows, 64 + 128 tokens): compiled temp 2.88 -> 1.04 GiB, the call 6% slower (16.0-16.8 s
    against 15.0-15.3 s, interleaved). Other platforms multiply bfloat16 natively: nothing to
    do there."""
    low = any(jnp.dtype(x.dtype).itemsize < 4 for x in jax.tree.leaves(params))
    if not low or jax.default_backend() != "cpu":
        return params
    return jax.lax.optimization_barrier((params, loop_variant))[0]


def decode_step(params, unembed_DxV, st: DecodeState, version, p: int, mcfg: ModelConfig,
                scfg: SamplerConfig) -> DecodeState:
    """One decode step of every row: sample from the carried logits, record the token, run it
    through the model (`unembed_DxV`: `unembed_matrix(params)`). Token t of a row lives at column t of the outputs and at cache position
    p + t; with per-row steps (decode slots) these are scatters, and finished rows stand still."""
    params = _upcast_in_loop(params, st.step)
    i = st.step
    b = st.done_B.shape[0]
    per_row = jnp.ndim(i) > 0
    rows = jnp.arange(b)
    if per_row:
        put, u_B = (lambda x, col, v: x.at[rows, col].set(v, mode="drop")), st.uniforms_NxB[i, rows]
    else:
        put, u_B = (lambda x, col, v: x.at[:, col].set(v)), st.uniforms_NxB[i]
    tok, logp, kept, top_ids, top_logp = sample(st.logits_BxV, u_B, scfg)
    live = ~st.done_B
    tok = jnp.where(live, tok, scfg.pad_token_id)
    eos = live & (tok == scfg.eos_token_id) if scfg.eos_token_id is not None else jnp.zeros_like(live)
    key_valid = put(st.key_valid_BxW, p + i, live)
    # Cache slots past p + i are not yet valid, so the key mask alone is causal.
    h, cache = decoder.Decoder(mcfg).apply({"params": params}, tok[:, None], st.positions_B[:, None],
                                           key_valid[:, None, :], st.cache, p + i)
    taken = i + live if per_row else i + 1  # a finished slot keeps its column
    return st.replace(
        step=taken, cache=cache, logits_BxV=h[:, 0].astype(jnp.float32) @ unembed_DxV,
        logits_version=jnp.full_like(st.logits_version, version), key_valid_BxW=key_valid,
        positions_B=st.positions_B + 1, done_B=st.done_B | eos | (taken >= st.limit_B), eos_B=st.eos_B | eos,
        tokens_BxN=put(st.tokens_BxN, i, tok), valid_BxN=put(st.valid_BxN, i, live),
        logp_BxN=put(st.logp_BxN, i, jnp.where(live, logp, 0.0)),
        kept_BxN=put(st.kept_BxN, i, jnp.where(live, kept, 0)),
        versions_BxN=put(st.versions_BxN, i, jnp.where(live, st.logits_version, -1)),
        topk_ids_BxNxK=put(st.topk_ids_BxNxK, i, jnp.where(live[:, None], top_ids, 0)),
        topk_logp_BxNxK=put(st.topk_logp_BxNxK, i, jnp.where(live[:, None], top_logp, 0.0)),
    )


def _generate(params, prompt_BxP, prompt_mask_BxP, limit_B, key, version, mcfg: ModelConfig, scfg: SamplerConfig,
              rows=None):
    st = _prefill(params, prompt_BxP, prompt_mask_BxP, limit_B, key, version, mcfg, scfg, rows)
    for end in _segment_ends(scfg.max_new_tokens, scfg):
        st = _decode_segment(params, st, version, prompt_BxP.shape[1], end, mcfg, scfg)
    return _outputs(st, scfg)


def _outputs(st: DecodeState, scfg: SamplerConfig) -> dict:
    out = dict(tokens=st.tokens_BxN, valid=st.valid_BxN, logp=st.logp_BxN, versions=st.versions_BxN,
               topk_ids=st.topk_ids_BxNxK, topk_logp=st.topk_logp_BxNxK, done=st.eos_B)
    if scfg.dist.truncated:  # the learner restricts pi_theta to supports of these sizes
        out["kept"] = st.kept_BxN
    return out


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
        self._slots = None
        rows = mesh and tuple(mesh.axis_names)
        local = lambda f, in_specs, out_specs: f if mesh is None else jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        r, rep = PartitionSpec(rows), PartitionSpec()

        def generate(params, prompt, mask, limit, key, version, mcfg, scfg):
            self.traces += 1
            f = functools.partial(_generate, mcfg=mcfg, scfg=scfg, rows=rows)
            return local(f, (rep, r, r, r, rep, rep), r)(params, prompt, mask, limit, key, version)

        def prefill(params, prompt, mask, limit, key, version, mcfg, scfg):
            f = functools.partial(_prefill, mcfg=mcfg, scfg=scfg, rows=rows)
            specs = DecodeState.specs(rows)
            return local(f, (rep, r, r, r, rep, rep), specs)(params, prompt, mask, limit, key, version)

        def segment(params, st, version, p, end, mcfg, scfg):
            f = functools.partial(_decode_segment, p=p, end=end, mcfg=mcfg, scfg=scfg)
            return local(f, (rep, DecodeState.specs(rows), rep), DecodeState.specs(rows))(params, st, version)

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

    def pad_prompts(self, prompts: Sequence[Sequence[int]], width: Optional[int] = None):
        """Left-pad to the bucket (or `width`) and repeat each prompt G times -> (tokens, mask,
        group_ids); row r = i * G + g is sample g of prompt i (its draws follow r: `row_keys`)."""
        if not len(prompts) or min(len(x) for x in prompts) == 0:
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        p = max(width or 0, self.bucket(max(len(x) for x in prompts)))
        g = self.cfg.num_samples
        toks = np.full((len(prompts), p), self.cfg.pad_token_id, np.int32)
        mask = np.zeros((len(prompts), p), np.int32)
        for i, x in enumerate(prompts):
            toks[i, p - len(x):] = x
            mask[i, p - len(x):] = 1
        return np.repeat(toks, g, 0), np.repeat(mask, g, 0), np.repeat(np.arange(len(prompts), dtype=np.int32), g)

    def generate(self, params, prompts, key, version: int = 0, refresh=None, limits=None) -> TrajectoryBatch:
        """`refresh`: optional `() -> (version, params) | None`, asked between decode segments
        (every `decode_segment` tokens); when it returns newer weights, the rest of the batch is
        decoded with them (the KV cache of earlier tokens is kept, as in-flight weight updates
        do) and each token's `versions` entry names the params it was sampled from.
        `limits`: optional per-row budgets of new tokens (<= max_new_tokens; rows as in
        `pad_prompts`); a row that uses its budget ends truncated."""
        toks, mask, group_ids = self.pad_prompts(prompts)
        limit = row_limits(limits, len(toks), self.cfg.max_new_tokens)
        if self.cfg.batching == "continuous":
            return to_batch(toks, mask, group_ids, self.slots(len(toks)).generate(
                params, toks, mask, limit, key, version, refresh))
        (toks_j, mask_j, limit_j), params = self._place((toks, mask, limit), params)
        if refresh is None:
            out = self._fn(params, toks_j, mask_j, limit_j, key, version, mcfg=self.model_cfg, scfg=self.cfg)
            return to_batch(toks, mask, group_ids, out)
        st = self._prefill(params, toks_j, mask_j, limit_j, key, version, mcfg=self.model_cfg, scfg=self.cfg)
        for j, end in enumerate(_segment_ends(self.cfg.max_new_tokens, self.cfg)):
            newer = refresh() if j else None
            if newer is not None and newer[0] > version:
                version, params = newer[0], self.place_params(newer[1])
            st = self._segment(params, st, version, p=toks.shape[1], end=end, mcfg=self.model_cfg, scfg=self.cfg)
        return to_batch(toks, mask, group_ids, _outputs(st, self.cfg))

    def lower_generate(self, params, prompts, key):
        """A static batch's `generate` program, lowered and not run (its memory analysis)."""
        toks, mask, _ = self.pad_prompts(prompts)
        (toks_j, mask_j, limit_j), params = self._place(
            (toks, mask, row_limits(None, len(toks), self.cfg.max_new_tokens)), params)
        return self._fn.lower(params, toks_j, mask_j, limit_j, key, 0, mcfg=self.model_cfg, scfg=self.cfg)

    def slots(self, rows: int):
        """The continuous-batching engine (`continuous.py`); `slots=0` sizes it to the first
        batch's rows."""
        if self._slots is None:
            from jaxrl_llm.rollout import continuous

            self._slots = continuous.SlotEngine(self, self.cfg.slots or rows)
        return self._slots

    def place_params(self, params):
        """Params on the sampler mesh, replicated unless already there (`sharding.put`: CPU
        devices share one host copy)."""
        if self.mesh is None:
            return params
        leaf = jax.tree_util.tree_leaves(params)[0]
        if getattr(leaf, "sharding", None) is None or leaf.sharding.device_set != set(self.mesh.devices.flat):
            params = sharding.put(params, NamedSharding(self.mesh, PartitionSpec()))
        return params

    def _place(self, arrays, params):
        """Device arrays for the program: on the mesh, rows split (padded with copies of the
        last row, dropped again by `to_batch`) and params replicated."""
        if self.mesh is None:
            return tuple(jnp.asarray(x) for x in arrays), params
        extra = -len(arrays[0]) % self.mesh.size
        rows = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        pad = lambda x: np.concatenate([x, np.repeat(x[-1:], extra, 0)])
        return tuple(jax.device_put(pad(x), rows) for x in arrays), self.place_params(params)


def row_limits(limits, rows: int, n: int) -> np.ndarray:
    """Per-row budgets of new tokens as i32[rows] (default: all `n`), checked."""
    if limits is None:
        return np.full(rows, n, np.int32)
    limits = np.asarray(limits, np.int32)
    if limits.shape != (rows,) or limits.min() < 1 or limits.max() > n:
        raise ValueError(f"limits must be {rows} per-row budgets in [1, {n}]; got shape {limits.shape}")
    return limits


def to_batch(prompt_BxP, prompt_mask_BxP, group_ids_B, out) -> TrajectoryBatch:
    """Sampler output -> the batch contract (prompt positions: mask 0, version -1). Host
    (NumPy) outputs give a host batch (a streaming sampler's groups), device outputs a device one."""
    b, p = prompt_BxP.shape
    xp = np if isinstance(out["tokens"], np.ndarray) else jnp
    out = {k: v[:b] for k, v in out.items()}  # rows padded for a device mesh
    valid = out["valid"]
    k = out["topk_ids"].shape[-1]
    gen_mask = valid.astype(np.float32)
    prompt = lambda x, dtype=np.float32, *tail: xp.concatenate([xp.zeros((b, p) + tail, dtype), x], 1)
    return TrajectoryBatch(
        tokens=xp.concatenate([xp.asarray(prompt_BxP), out["tokens"]], 1),
        loss_mask=prompt(gen_mask),
        behav_logp=prompt(out["logp"]),
        versions=xp.concatenate([xp.full((b, p), -1, np.int32), out["versions"]], 1),
        topk_ids=prompt(out["topk_ids"], np.int32, k),
        topk_logp=prompt(out["topk_logp"], np.float32, k),
        rewards=xp.zeros((b,), np.float32),
        group_ids=xp.asarray(group_ids_B),
        advantages=xp.zeros((b, p + valid.shape[1]), np.float32),
        input_mask=xp.concatenate([xp.asarray(prompt_mask_BxP, np.float32), gen_mask], 1),
        truncated=~out["done"],
        behav_kept=prompt(out["kept"], np.int32) if "kept" in out else None,
    )
