"""The decode loop shared by static and slot batching: its state, prefill, one decode step,
segments of steps, and the outputs.

Prompts are left-padded to a fixed bucket length P, so every row writes its t-th new token at
buffer index P + t and RoPE positions skip the pad. The cache lives inside the jitted function
and is carried through the loop, so XLA updates it in place. Each generated token records its
log-prob under the distribution it was actually drawn from (temperature, then top-k / top-p
truncation, renormalised), that distribution's top-K, and the version of the params that
produced it. Every function here is pure; `sampler.Sampler` and `continuous.SlotEngine` jit them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from jaxrl_llm.models import decoder, experts
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
    # Multi-turn: a token id to write at a column instead of sampling (an environment's
    # observation, appended to the row's cache as it stands: never re-tokenised), -1 for none;
    # and which columns hold such tokens (loss 0, version -1, log-prob 0).
    forced_BxN: jax.Array  # i32
    obs_BxN: jax.Array  # bool
    # A mixture of experts with `scfg.record_routing`: the experts each position (prompt, then new
    # tokens and observations) was routed to, per sparse layer: i16[B, P + N, M, R]. None: not recorded.
    routing: Any = None

    @classmethod
    def specs(cls, rows, per_row: bool = False, routing: bool = False) -> "DecodeState":
        """PartitionSpecs with the rows split over the mesh axes `rows` (`per_row`: decode slots,
        whose `step` and `logits_version` are per row too; `routing`: the state records it)."""
        r = PartitionSpec(rows)
        fields = {f: r for f in cls.__dataclass_fields__}
        scalar = r if per_row else PartitionSpec()
        return cls(**{**fields, "step": scalar, "logits_version": scalar, "uniforms_NxB": PartitionSpec(None, rows),
                      "routing": r if routing else None})


def per_device(mesh, rows, f, in_specs, out_specs):
    """`f` run by each device of `mesh` on its own block of rows (`shard_map` manual over the
    axes `rows`; no collective of its own, a tensor axis left to XLA: `devices.py`), or `f`
    itself without a mesh."""
    if mesh is None:
        return f
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(rows), check_vma=False)


def row_keys(key, row_ids_B):
    """Each row's own key: `key` folded with the row's id (its index in the batch)."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(row_ids_B)


def row_uniforms(keys_B, n: int):
    """f32[N, B]: the uniform behind each new token of each row, from the row's key alone
    (uniform t drives the row's t-th new token). Draws depend neither on segment boundaries,
    nor on rows padded for a mesh, nor on which decode slot a row runs in, and no PRNG rounds
    run in the decode loop."""
    return jax.vmap(lambda k: jax.random.uniform(k, (n,)), out_axes=1)(keys_B)


def prefill(params, prompt_BxP, prompt_mask_BxP, limit_B, key, version, mcfg: ModelConfig, scfg: SamplerConfig,
             rows=None, width=None, keys_B=None):
    """Run the prompt through the model -> the DecodeState for `decode_segment`. `rows`: the
    mesh axes the batch is split over (inside `shard_map`), so draws follow global row ids;
    or `keys_B`, the rows' own keys (`row_keys`; `key` is then unused). `width`: cache
    positions to allocate (default: the prompt and every new token, P + N)."""
    b, p = prompt_BxP.shape
    n = scfg.max_new_tokens
    width = width or p + n
    cache = [{"k": jnp.zeros((b, mcfg.num_kv_heads, mcfg.head_dim, width), scfg.cache_dtype),
              "v": jnp.zeros((b, mcfg.num_kv_heads, width, mcfg.head_dim), scfg.cache_dtype)}
             for _ in range(mcfg.num_layers)]
    key_valid = jnp.concatenate([prompt_mask_BxP > 0, jnp.zeros((b, width - p), bool)], 1)
    positions = decoder.padding_positions(prompt_mask_BxP)
    causal = jnp.arange(width)[None, :] <= jnp.arange(p)[:, None]
    (hidden, cache), routing = _apply(params, mcfg, scfg, prompt_BxP, positions, causal[None] & key_valid[:, None, :],
                                      cache, 0)
    if routing is not None:  # the prompt's, then room for every new token's
        routing = jnp.concatenate([routing, jnp.zeros((b, width - p) + routing.shape[2:], routing.dtype)], 1)
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
        topk_logp_BxNxK=jnp.zeros((b, n, k), jnp.float32), forced_BxN=jnp.full((b, n), -1, jnp.int32),
        obs_BxN=jnp.zeros((b, n), bool), routing=routing,
    )


def _apply(params, mcfg: ModelConfig, scfg: SamplerConfig, tokens_BxT, positions_BxT, mask, cache, index):
    """The decoder's (hidden, cache) and, with `scfg.record_routing`, the experts each position
    was routed to ([B, T, M, R], `decoder.routing_of`)."""
    model = decoder.Decoder(mcfg)
    if not scfg.record_routing:
        return model.apply({"params": params}, tokens_BxT, positions_BxT, mask, cache, index), None
    out, variables = model.apply({"params": params}, tokens_BxT, positions_BxT, mask, cache, index,
                                 mutable=["intermediates"])
    return out, decoder.routing_of(variables, mcfg, *tokens_BxT.shape)


def segment_ends(n: int, scfg: SamplerConfig) -> list:
    """Where the host-driven path's segments of `decode_segment` steps end (weights may be
    refreshed between them)."""
    seg = min(scfg.decode_segment or n, n)
    return list(range(seg, n, seg)) + [n]


def decode_segment(params, st: DecodeState, version, p: int, end, mcfg: ModelConfig, scfg: SamplerConfig):
    """Decode steps up to `end` with `params` (p = prompt bucket, static; `end` may be traced:
    one program for every segment) over the full-width cache `prefill` allocated. A token is
    tagged with the version of the params whose logits it was sampled from, so a
    mid-generation weight swap tags tokens exactly."""
    body = functools.partial(decode_step, params, unembed_matrix(params, mcfg), version=version, p=p, mcfg=mcfg,
                             scfg=scfg)
    return until_done(lambda st: st.step < end, body, st, lambda st: st.done_B, params, mcfg)


def all_done(done_B, params, mcfg: ModelConfig):
    """Whether every row is done: this device's rows, or every device's where each decode step
    runs collectives across them, so all must run the same steps: a mixture's experts split over
    the sampler's devices (`experts.among_devices`), or a tensor axis (`devices.py`), whose
    collectives XLA:CPU rendezvouses over every device of the program."""
    done = jnp.all(done_B)
    mesh = jax.sharding.get_abstract_mesh()
    tensor = any(mesh.shape[a] > 1 for a in mesh.axis_names if a not in mesh.manual_axes)
    if not (tensor or experts.splits_experts(params, mcfg.num_experts)):
        return done
    return jax.lax.pmin(done.astype(jnp.int32), tuple(mesh.manual_axes)) > 0


def until_done(more, body, carry, done_of, params, mcfg: ModelConfig):
    """`body` on `carry` while `more(carry)` and not `all_done` (rows `done_of(carry)`). The done
    flag is computed after each body and carried, so that its collective (experts split) sits in
    the loop's body beside the MoE layers' own, not in its condition."""
    def step(c):
        carry = body(c[0])
        return carry, all_done(done_of(carry), params, mcfg)

    first = (carry, all_done(done_of(carry), params, mcfg))
    return jax.lax.while_loop(lambda c: more(c[0]) & ~c[1], step, first)[0]


def unembed_matrix(params, mcfg: ModelConfig):
    """The f32 [D, V] output projection, formed once outside the decode loop (tied: a transpose)."""
    return decoder.unembed_matrix(params, mcfg).astype(jnp.float32)


def _upcast_in_loop(params, loop_variant):
    """XLA:CPU computes bfloat16 matmuls in float32: it converts each weight, and since the
    weights are loop-invariant, while-loop code motion hoists every convert out of the decode
    loop, so a bf16 sampler would hold a full float32 copy of its weights for the whole call.
    Tying the weights to a loop-variant value keeps each convert inside the step, where only
    one layer's float32 copy lives at a time (tests/test_memory.py holds the bound; docs/memory.md
    the cost). Other platforms multiply bfloat16 natively: nothing to do there."""
    low = any(jnp.dtype(x.dtype).itemsize < 4 for x in jax.tree.leaves(params))
    if not low or jax.default_backend() != "cpu":
        return params
    return jax.lax.optimization_barrier((params, loop_variant))[0]


def decode_step(params, unembed_DxV, st: DecodeState, version, p: int, mcfg: ModelConfig,
                scfg: SamplerConfig) -> DecodeState:
    """One decode step of every row: sample from the carried logits, record the token, run it
    through the model (`unembed_DxV`: `unembed_matrix(params)`). Token t of a row lives at column t of the outputs and at cache position
    p + t; with per-row steps (decode slots) these are scatters, and finished rows stand still.
    A forced token (an observation) is written instead of the draw; a drawn token in
    `scfg.turn_stop_ids` ends the row's turn (done, not EOS: the host continues it)."""
    params = _upcast_in_loop(params, st.step)
    i = st.step
    b = st.done_B.shape[0]
    per_row = jnp.ndim(i) > 0
    rows = jnp.arange(b)
    if per_row:
        put, u_B = (lambda x, col, v: x.at[rows, col].set(v, mode="drop")), st.uniforms_NxB[i, rows]
        forced = st.forced_BxN.at[rows, i].get(mode="fill", fill_value=-1)
    else:
        put, u_B, forced = (lambda x, col, v: x.at[:, col].set(v)), st.uniforms_NxB[i], st.forced_BxN[:, i]
    tok, logp, kept, top_ids, top_logp = sample(st.logits_BxV, u_B, scfg)
    live = ~st.done_B
    obs = live & (forced >= 0)
    drawn = live & ~obs
    tok = jnp.where(obs, forced, jnp.where(live, tok, scfg.pad_token_id))
    logp, kept = jnp.where(obs, 0.0, logp), jnp.where(obs, 0, kept)
    top_ids, top_logp = jnp.where(obs[:, None], 0, top_ids), jnp.where(obs[:, None], 0.0, top_logp)
    eos = drawn & (tok == scfg.eos_token_id) if scfg.eos_token_id is not None else jnp.zeros_like(live)
    turn_end = drawn & jnp.isin(tok, jnp.asarray(scfg.turn_stop_ids, jnp.int32)) if scfg.turn_stop_ids else eos
    key_valid = put(st.key_valid_BxW, p + i, live)
    # Cache slots past p + i are not yet valid, so the key mask alone is causal.
    (h, cache), routing = _apply(params, mcfg, scfg, tok[:, None], st.positions_B[:, None], key_valid[:, None, :],
                                 st.cache, p + i)
    # only live rows' routing is written: a finished row's padding keeps zeros, however long the
    # other rows (on this device, or on every device when they split the experts) decode
    if routing is not None and per_row:  # decode slots: each row at its own column
        routing = st.routing.at[rows, jnp.where(live, p + i, st.routing.shape[1])].set(routing[:, 0], mode="drop")
    elif routing is not None:  # a static batch: every row at column p + i
        was = jax.lax.dynamic_slice_in_dim(st.routing, p + i, 1, axis=1)
        routing = jax.lax.dynamic_update_slice_in_dim(
            st.routing, jnp.where(live[:, None, None, None], routing, was), p + i, 1)
    taken = i + live if per_row else i + 1  # a finished slot keeps its column
    return st.replace(
        step=taken, cache=cache, logits_BxV=h[:, 0].astype(jnp.float32) @ unembed_DxV,
        logits_version=jnp.full_like(st.logits_version, version), key_valid_BxW=key_valid,
        # a row that waits (a turn's end) must resume at the next position: only live rows move
        positions_B=st.positions_B + live, done_B=st.done_B | eos | turn_end | (taken >= st.limit_B),
        eos_B=st.eos_B | eos,
        tokens_BxN=put(st.tokens_BxN, i, tok), valid_BxN=put(st.valid_BxN, i, live),
        logp_BxN=put(st.logp_BxN, i, jnp.where(live, logp, 0.0)),
        kept_BxN=put(st.kept_BxN, i, jnp.where(live, kept, 0)),
        versions_BxN=put(st.versions_BxN, i, jnp.where(drawn, st.logits_version, -1)),
        topk_ids_BxNxK=put(st.topk_ids_BxNxK, i, jnp.where(live[:, None], top_ids, 0)),
        topk_logp_BxNxK=put(st.topk_logp_BxNxK, i, jnp.where(live[:, None], top_logp, 0.0)),
        obs_BxN=put(st.obs_BxN, i, obs), routing=routing,
    )


def generate(params, prompt_BxP, prompt_mask_BxP, limit_B, key, version, mcfg: ModelConfig, scfg: SamplerConfig,
              rows=None):
    """A static batch, prefill to outputs, in one program whatever N: segments of
    `decode_segment` steps in a fixed-trip loop (a known trip count, which XLA:GPU can run
    without reading a predicate back per step; unmeasured here), the done-check once per
    segment in the outer loop. The cache is allocated at its full width P + N once; the
    segment loop is not unrolled, so the program does not grow with N. Steps past N in the last segment are inert:
    every row is done by then, their column writes fall outside the outputs (scatters drop them)
    and their cache write lands on the last position, which nothing reads afterwards."""
    n, p = scfg.max_new_tokens, prompt_BxP.shape[1]
    seg = min(scfg.decode_segment or n, n)
    st = prefill(params, prompt_BxP, prompt_mask_BxP, limit_B, key, version, mcfg, scfg, rows, width=p + n)
    body = functools.partial(decode_step, params, unembed_matrix(params, mcfg), version=version, p=p, mcfg=mcfg,
                             scfg=scfg)
    segment = lambda st: jax.lax.fori_loop(0, seg, lambda _, st: body(st), st)  # noqa: E731
    st = until_done(lambda st: st.step < n, segment, st, lambda st: st.done_B, params, mcfg)
    return outputs(st, scfg)


def outputs(st: DecodeState, scfg: SamplerConfig) -> dict:
    out = dict(tokens=st.tokens_BxN, valid=st.valid_BxN, logp=st.logp_BxN, versions=st.versions_BxN,
               topk_ids=st.topk_ids_BxNxK, topk_logp=st.topk_logp_BxNxK, done=st.eos_B, obs=st.obs_BxN)
    if scfg.dist.truncated:  # the learner restricts pi_theta to supports of these sizes
        out["kept"] = st.kept_BxN
    if getattr(st, "routing", None) is not None:  # slots hand over a namespace of their outputs
        out["routing"] = st.routing
    return out
