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

The environment side is duck-typed: `respond(row_id, tokens, obs_mask) -> Future` of a reply
with `obs_ids` (token ids to append) and `done` (the episode ends here).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.rollout.decode import DecodeState


def park(st: DecodeState, slot_I) -> DecodeState:
    """Rows `slot_I` of the slots' state, the whole cache width: a pool `_insert` can copy back."""
    rows = jax.tree.map(lambda x: x[slot_I], st.replace(uniforms_NxB=st.uniforms_NxB.T))
    return rows.replace(uniforms_NxB=rows.uniforms_NxB.T)


def resume(st: DecodeState, row_I, obs_IxM, len_I) -> DecodeState:
    """Rows `row_I` go on: `obs_IxM[i, :len_I[i]]` are forced at the row's next columns (an index
    past the state's rows is padding, dropped)."""
    m = obs_IxM.shape[1]
    step = jnp.broadcast_to(st.step, st.done_B.shape)[jnp.minimum(row_I, st.done_B.shape[0] - 1)]
    cols = step[:, None] + jnp.arange(m)[None, :]
    rows = jnp.where(jnp.arange(m)[None, :] < len_I[:, None], row_I[:, None], st.done_B.shape[0])
    forced = st.forced_BxN.at[rows, cols].set(obs_IxM, mode="drop")
    return st.replace(forced_BxN=forced, done_B=st.done_B.at[row_I].set(False, mode="drop"))


@dataclasses.dataclass
class Waiting:
    """A row whose turn ended: its reply, and where its state is (a slot, or a parked pool)."""
    reply: Future
    slot: int = -1  # hold: the slot it keeps
    pool: Optional[list] = None  # release: [pool, {id: index}] it is parked in


class Turns:
    """The slot engine's multi-turn bookkeeping for one stream: `respond` as in the module doc,
    `release` (free a waiting row's slot), `max_obs` (forced tokens per reply, a static width)."""

    def __init__(self, respond: Callable, release: bool = True, max_obs: int = 64):
        self.respond, self.release, self.max_obs = respond, release, max_obs
        self.waiting: dict[int, Waiting] = {}

    def ended_turns(self, ids, got, limit_of) -> np.ndarray:
        """Which of the rows that stopped (outputs `got`) stopped at a turn's end with room to go
        on: not at EOS and short of their budget."""
        steps = got["valid_BxN"].sum(1)
        return ~got["eos_B"] & (steps < np.asarray([limit_of(int(i)) for i in ids]))

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
