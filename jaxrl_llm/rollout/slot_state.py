"""The decode slots' device state for continuous batching (`continuous.SlotEngine`): an empty
state of S slots, copying prefilled or parked rows into slots, one segment of decode steps over
a window of the cache, and the window's width. Pure functions, run under jit by the engine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import decode
from jaxrl_llm.rollout.sampling import SamplerConfig

OUTPUTS = ("tokens_BxN", "valid_BxN", "logp_BxN", "kept_BxN", "versions_BxN", "topk_ids_BxNxK", "topk_logp_BxNxK",
           "eos_B", "obs_BxN")


def handed_over(st) -> tuple:
    """The fields a finished row hands over: `OUTPUTS`, and its experts when recorded."""
    return OUTPUTS + (("routing",) if st.routing is not None else ())


def row(st, at):
    """Row `at` (traced: one program per state shape) of a slots' state or pool: its handed-over
    fields (leading dim 1)."""
    return {f: jax.lax.dynamic_slice_in_dim(getattr(st, f), at, 1) for f in handed_over(st)}


def empty(slots: int, p: int, mcfg: ModelConfig, scfg: SamplerConfig) -> decode.DecodeState:
    """S idle slots (done, budget 0) with a cache of P + N positions."""
    n, k = scfg.max_new_tokens, scfg.capture_topk
    zeros = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
    layers = sum(mcfg.sparse(i) for i in range(mcfg.num_layers))
    routing = zeros((slots, p + n, layers, mcfg.num_experts_per_tok), jnp.int16) if scfg.record_routing else None
    return decode.DecodeState(
        step=zeros((slots,), jnp.int32), uniforms_NxB=zeros((n, slots)),
        cache=[{"k": zeros((slots, mcfg.num_kv_heads, mcfg.head_dim, p + n), scfg.cache_dtype),
                "v": zeros((slots, mcfg.num_kv_heads, p + n, mcfg.head_dim), scfg.cache_dtype)}
               for _ in range(mcfg.num_layers)],
        logits_BxV=zeros((slots, mcfg.vocab_size)), logits_version=zeros((slots,), jnp.int32),
        key_valid_BxW=zeros((slots, p + n), bool), positions_B=zeros((slots,), jnp.int32),
        limit_B=zeros((slots,), jnp.int32), done_B=jnp.ones((slots,), bool), eos_B=zeros((slots,), bool),
        tokens_BxN=jnp.full((slots, n), scfg.pad_token_id, jnp.int32), valid_BxN=zeros((slots, n), bool),
        logp_BxN=zeros((slots, n)), kept_BxN=zeros((slots, n), jnp.int32),
        versions_BxN=jnp.full((slots, n), -1, jnp.int32), topk_ids_BxNxK=zeros((slots, n, k), jnp.int32),
        topk_logp_BxNxK=zeros((slots, n, k)), forced_BxN=jnp.full((slots, n), -1, jnp.int32),
        obs_BxN=zeros((slots, n), bool), routing=routing)


def insert(st, pool, pool_I, slot_I):
    """Copy prefilled rows `pool_I` of `pool` into slots `slot_I` (an index >= S is padding,
    dropped). Only the pool's cache positions are written (a prefill's: the prompt's P; the old
    occupant's later positions are masked out until the new row overwrites them); a parked
    multi-turn row (`turns.park`) brings its whole cache and its own step."""
    p = pool.key_valid_BxW.shape[1]
    put = lambda old, x: old.at[slot_I].set(x[pool_I], mode="drop")
    cache = [{"k": old["k"].at[slot_I, :, :, :p].set(c["k"][pool_I], mode="drop"),
              "v": old["v"].at[slot_I, :, :p, :].set(c["v"][pool_I], mode="drop")}
             for old, c in zip(st.cache, pool.cache)]
    rows = {f: put(getattr(st, f), getattr(pool, f)) for f in (
        "logits_BxV", "positions_B", "limit_B", "done_B", "eos_B", "tokens_BxN", "valid_BxN", "logp_BxN", "kept_BxN",
        "versions_BxN", "topk_ids_BxNxK", "topk_logp_BxNxK", "forced_BxN", "obs_BxN")}
    per_row = lambda x: jnp.broadcast_to(x, pool.done_B.shape)[pool_I]  # noqa: E731  (a parked row's own)
    if st.routing is not None:  # a prefill's prompt columns, or a parked row's every column
        wide = jnp.pad(pool.routing, [(0, 0), (0, st.routing.shape[1] - pool.routing.shape[1]), (0, 0), (0, 0)])
        rows["routing"] = put(st.routing, wide)
    return st.replace(
        **rows, cache=cache, step=st.step.at[slot_I].set(per_row(pool.step), mode="drop"),
        logits_version=st.logits_version.at[slot_I].set(per_row(pool.logits_version), mode="drop"),
        uniforms_NxB=st.uniforms_NxB.at[:, slot_I].set(pool.uniforms_NxB[:, pool_I], mode="drop"),
        key_valid_BxW=put(st.key_valid_BxW, jnp.pad(pool.key_valid_BxW, [(0, 0), (0, st.key_valid_BxW.shape[1] - p)])))


def segment(params, st, version, p: int, width: int, steps: int, mcfg, scfg):
    """Up to `steps` decode steps of every slot over cache positions [0, width), stopping early
    once every slot is done."""
    full = st.cache, st.key_valid_BxW
    if width < st.key_valid_BxW.shape[1]:  # one copy in and out per segment, not per step
        st = st.replace(cache=[{"k": c["k"][..., :width], "v": c["v"][:, :, :width]} for c in st.cache],
                        key_valid_BxW=st.key_valid_BxW[:, :width])
    body = functools.partial(decode.decode_step, params, decode.unembed_matrix(params, mcfg), version=version, p=p,
                             mcfg=mcfg, scfg=scfg)
    _, st = decode.until_done(lambda c: c[0] < steps, lambda c: (c[0] + 1, body(c[1])), (jnp.int32(0), st),
                              lambda c: c[1].done_B, params, mcfg)
    if width < full[1].shape[1]:
        put = jax.lax.dynamic_update_slice
        st = st.replace(cache=[{"k": put(f["k"], c["k"], (0, 0, 0, 0)), "v": put(f["v"], c["v"], (0, 0, 0, 0))}
                               for f, c in zip(full[0], st.cache)],
                        key_valid_BxW=put(full[1], st.key_valid_BxW, (0, 0)))
    return st


def attention_width(reach: int, seg: int, n: int) -> int:
    """New-token positions a segment attends over when the deepest slot will reach `reach`: a
    power-of-two number of segments (at most twice what it reads), capped at N, so one decode
    program serves each of ~log2(N / seg) + 1 widths instead of one per segment (32 programs at
    N = 1,024 and 32-step segments; 6 here)."""
    return min(n, pow2(-(-reach // seg)) * seg)


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
