"""Multi-turn rows in the decode slots: a row whose turn ends (it drew one of
`SamplerConfig.turn_stop_ids`) waits for its environment's reply, then goes on in the same
sequence: the reply's observation tokens are written into the row as forced tokens
(`DecodeState.forced_BxN`), so the decode step runs them through the model into the row's KV
cache exactly as sampled tokens are, never re-tokenised from text. They carry loss mask 0,
version -1 and log-prob 0 (`obs_BxN`).

While a row waits, its slot either stays its own (`hold`: static batching's behaviour, the slot
idles) or is freed for other rows (`release`): the row's state, its KV cache included, is parked
in a pool and copied back into whichever slot frees up when the reply arrives. A row draws its
t-th token from uniform t of its own key, so hold and release give the same episodes.

With `SamplerConfig.turn_cache="recompute"` a parked row keeps no cache: when it resumes, one
forward pass over its prompt and every token so far rebuilds it (`reprefill`, with the newest
weights, as a recompute after a weight update does). That forward also gives the drawn tokens'
log-probs, so the engine logs how far they are from the recorded behaviour log-probs: the same
tokens through a batched pass instead of step by step (and, after an update, other weights).

The environment side is duck-typed: `respond(row_id, tokens, obs_mask) -> Future` of a reply
with `obs_ids` (token ids to append), `done` (the episode ends here) and optionally `max_tokens`
(the next turn stops after drawing that many). An environment that wants more of the row (the
agent gateway: the turn's log-probs for a client asking for them) names the outputs in
`Turns.detail`; each comes as a keyword, the row's values so far. It may also end a turn where
the turn's text first holds a stop string (`Turns.stops`): after each segment such a row is cut
back to the token that completed it (`rewind`), as if it had stopped there.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import decoder
from jaxrl_llm.rollout.decode import DecodeState, unembed_matrix
from jaxrl_llm.rollout.sampling import sampling_logprobs


def park(st: DecodeState, slot_I) -> DecodeState:
    """Rows `slot_I` of the slots' state, the whole cache width: a pool `_insert` can copy back."""
    rows = jax.tree.map(lambda x: x[slot_I], st.replace(uniforms_NxB=st.uniforms_NxB.T))
    return rows.replace(uniforms_NxB=rows.uniforms_NxB.T)


def resume(st: DecodeState, row_I, obs_IxM, len_I, limit_I) -> DecodeState:
    """Rows `row_I` go on: `obs_IxM[i, :len_I[i]]` are forced at the row's next columns, and the
    row stops at column `limit_I[i]` (its budget, or sooner: the next turn's `max_tokens`); an
    index past the state's rows is padding, dropped."""
    m = obs_IxM.shape[1]
    step = jnp.broadcast_to(st.step, st.done_B.shape)[jnp.minimum(row_I, st.done_B.shape[0] - 1)]
    cols = step[:, None] + jnp.arange(m)[None, :]
    rows = jnp.where(jnp.arange(m)[None, :] < len_I[:, None], row_I[:, None], st.done_B.shape[0])
    forced = st.forced_BxN.at[rows, cols].set(obs_IxM, mode="drop")
    return st.replace(forced_BxN=forced, done_B=st.done_B.at[row_I].set(False, mode="drop"),
                      limit_B=st.limit_B.at[row_I].set(limit_I, mode="drop"))


def rewind(st: DecodeState, slot_I, col_I, pad: int = 0) -> DecodeState:
    """The rows in slots `slot_I` end their turn at column `col_I[i]`: what they decoded past it
    is undone (tokens back to `pad`, records and cache positions cleared, the RoPE position moved
    back by as many), so each stands as if its turn had stopped there, waiting for a reply (an
    index past the state's rows is padding, dropped). Its draws stay its own: column t still
    takes uniform t when it decodes again."""
    n = st.tokens_BxN.shape[1]
    keep_IxN = jnp.arange(n)[None, :] < col_I[:, None]
    rows = jnp.minimum(slot_I, st.done_B.shape[0] - 1)

    def cut(x, offset=0, fill=0):  # [B, offset + N, ...]: the row's columns past col_I set to `fill`
        keep = jnp.concatenate([jnp.ones((len(col_I), offset), bool), keep_IxN], 1)
        keep = keep.reshape(keep.shape + (1,) * (x.ndim - 2))
        return x.at[slot_I].set(jnp.where(keep, x[rows], jnp.asarray(fill, x.dtype)), mode="drop")

    undone = jnp.sum(st.valid_BxN[rows] & ~keep_IxN, 1)
    p = st.key_valid_BxW.shape[1] - n
    fields = {f: cut(getattr(st, f)) for f in ("valid_BxN", "logp_BxN", "kept_BxN", "topk_ids_BxNxK",
                                                 "topk_logp_BxNxK", "obs_BxN")}
    return st.replace(
        **fields, tokens_BxN=cut(st.tokens_BxN, fill=pad), versions_BxN=cut(st.versions_BxN, fill=-1),
        key_valid_BxW=cut(st.key_valid_BxW, p), routing=None if st.routing is None else cut(st.routing, p),
        step=st.step.at[slot_I].set(col_I, mode="drop"),
        positions_B=st.positions_B.at[slot_I].add(-undone, mode="drop"),
        done_B=st.done_B.at[slot_I].set(True, mode="drop"),
        eos_B=st.eos_B.at[slot_I].set(st.eos_B[rows] & (undone == 0), mode="drop"))


def reprefill(params, st: DecodeState, prompt_BxP, prompt_mask_BxP, mcfg, scfg):
    """Parked rows `st` (no cache) with their cache rebuilt from their tokens: the prompt, then
    every token so far (drawn and observed) at its own position, in one forward pass. Returns
    (state, log-prob of each drawn token under that pass and the sampling distribution, 0 elsewhere)."""
    b, p = prompt_BxP.shape
    n = st.tokens_BxN.shape[1]
    seq = jnp.concatenate([prompt_BxP, st.tokens_BxN], 1)
    real = jnp.concatenate([prompt_mask_BxP > 0, st.valid_BxN], 1)
    cache = [{"k": jnp.zeros((b, mcfg.num_kv_heads, mcfg.head_dim, p + n), scfg.cache_dtype),
              "v": jnp.zeros((b, mcfg.num_kv_heads, p + n, mcfg.head_dim), scfg.cache_dtype)}
             for _ in range(mcfg.num_layers)]
    causal = jnp.arange(p + n)[None, :] <= jnp.arange(p + n)[:, None]
    hidden, cache = decoder.Decoder(mcfg).apply({"params": params}, seq, decoder.padding_positions(real),
                                                causal[None] & real[:, None, :], cache, 0)
    logits = hidden[:, p - 1:p + n - 1].astype(jnp.float32) @ unembed_matrix(params, mcfg)  # token t's prefix
    logp = sampling_logprobs(logits.reshape(b * n, -1), scfg)[0].reshape(b, n, -1)
    logp = jnp.take_along_axis(logp, st.tokens_BxN[..., None], -1)[..., 0]
    return st.replace(cache=cache, key_valid_BxW=real), jnp.where(st.valid_BxN & ~st.obs_BxN, logp, 0.0)


@dataclasses.dataclass
class Waiting:
    """A row whose turn ended: its reply, and where its state is (a slot, or a parked pool)."""
    reply: Future
    slot: int = -1  # hold: the slot it keeps
    pool: Optional[list] = None  # release: [pool, {id: index}] it is parked in


class Turns:
    """The slot engine's multi-turn bookkeeping for one stream: `respond` as in the module doc,
    `release` (free a waiting row's slot), `max_obs` (forced tokens per reply, a static width),
    `detail` (outputs of `slot_state.OUTPUTS` given to `respond` too, as keywords), `stops`: rows
    that may end their turn early, `stops.wanted()` naming them and `stops(row id, its turn's ids
    so far)` the count of those ids to keep (None: go on)."""

    def __init__(self, respond: Callable, release: bool = True, max_obs: int = 64, detail: tuple = (), stops=None):
        self.respond, self.release, self.max_obs, self.detail = respond, release, max_obs, tuple(detail)
        self.stops = stops
        self.waiting: dict[int, Waiting] = {}

    def ended_turns(self, ids, got, limit_of) -> np.ndarray:
        """Which of the rows that stopped (outputs `got`) stopped at a turn's end with room to go
        on: not at EOS and short of their budget."""
        steps = got["valid_BxN"].sum(1)
        return ~got["eos_B"] & (steps < np.asarray([limit_of(int(i)) for i in ids]))

    def cuts(self, ids, tokens_BxN, valid_BxN, obs_BxN, wanted) -> list:
        """(index, column) of the rows `ids` (one per line of the arrays) among `wanted` (what
        `stops.wanted()` named) whose turn so far `stops` cuts short: its first ids up to the
        column kept, the rest to undo."""
        out = []
        for j, i in enumerate(ids):
            if i in wanted:
                cols = np.flatnonzero(valid_BxN[j])  # a row's columns fill from 0, its observations among them
                start = max((c + 1 for c in cols if obs_BxN[j][c]), default=0)
                k = self.stops(i, tokens_BxN[j][start:len(cols)])
                if k is not None and start + k < len(cols):
                    out.append((j, start + k))
        return out

    def ready(self) -> list:
        """(id, reply) of the waiting rows whose reply has come, in arrival-independent id order."""
        return [(i, w.reply.result()) for i, w in sorted(self.waiting.items()) if w.reply.done()]

    def obs_arrays(self, replies, room) -> tuple:
        """Forced tokens of `replies` as ([k, max_obs] ids, [k] lengths), each cut to the row's
        `room` (tokens left in its budget) and to `max_obs`."""
        obs = np.zeros((len(replies), self.max_obs), np.int32)
        lens = np.zeros(len(replies), np.int32)
        for j, (reply, r) in enumerate(zip(replies, room)):
            ids = list(reply.obs_ids)[:min(self.max_obs, r)]
            obs[j, :len(ids)], lens[j] = ids, len(ids)
        return obs, lens
