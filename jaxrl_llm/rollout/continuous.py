"""Continuous batching: a fixed number of decode slots, refilled at segment boundaries.

Static batching decodes a batch until its longest row ends, so with heavy-tailed lengths most
rows sit finished. Here S slots decode together; every `decode_segment` steps the host takes
out finished rows and prefills waiting ones into the freed slots (KV-cache rows overwritten in
place), as JetStream's prefill / insert / generate engine and the vLLM / SGLang schedulers
behind verl, TRL and AReaL do.

Layout: slot s holds one row as [prompt, left-padded to the run's bucket P | N new tokens], its
t-th new token at cache position P + t. Slots sit at different depths, so the decode step
(`decode.decode_step`, shared with static batching) writes per-slot columns. A segment attends
over the first w cache positions only, w = P + the deepest slot's reach rounded up to a
power-of-two number of segments (memory-bound decode reads at most twice the cache it must).
Programs: one insert per power-of-two count of new rows and one segment per w, about
log2(N / decode_segment) + 1 of them, whatever the mix of lengths.

A row's draws come from (key, its global row id) alone (`decode.row_uniforms`), so it yields
the same tokens, log-probs and top-K in any slot, at any slot count, as in a static batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import types
from concurrent import futures
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.rollout import decode
from jaxrl_llm.rollout import turns as turns_lib
from jaxrl_llm.rollout import slot_state
from jaxrl_llm.rollout.slot_state import attention_width, pow2

class SlotEngine:
    """The continuous-batching generator behind `Sampler.generate` when
    `SamplerConfig.batching == "continuous"`, and behind streaming samplers (`stream`). On a
    sampler mesh of D devices each device runs its own group of S / D slots on its own rows
    (as static batching splits rows): prefill, insert and decode never move a row between
    devices. The slot count is rounded up to a multiple of D.

    Waiting rows are prefilled together into a pool (one sharded prefill, as a static batch's)
    and copied into slots as these free up; new weights (`refresh`) re-prefill the rows still
    waiting, so a row's first token always comes from the newest params at its insertion."""

    def __init__(self, sampler, slots: int):
        self.sampler = sampler
        mcfg, scfg, mesh = sampler.model_cfg, sampler.cfg, sampler.mesh
        self.groups = sampler.row_devices
        self.slots = -(-slots // self.groups) * self.groups
        self.seg = min(scfg.decode_segment or scfg.max_new_tokens, scfg.max_new_tokens)
        self.occupancy = []  # per stream: generated tokens / (slots x decode steps run)
        self.live: Optional[_Slots] = None  # the running (or last) stream's slots: its counters as it runs
        rows = sampler.rows
        specs, pool_specs = (decode.DecodeState.specs(rows, per_row=True, routing=scfg.record_routing),
                             decode.DecodeState.specs(rows, routing=scfg.record_routing))
        r, rep = PartitionSpec(rows), PartitionSpec()
        local, ps = functools.partial(decode.per_device, mesh, rows), sampler.manual_specs
        self._rows = None if mesh is None else NamedSharding(mesh, r)
        shard = None if mesh is None else jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

        def prefill(params, prompt, mask, limit, keys, version):
            f = lambda params, prompt, mask, limit, keys, version: decode.prefill(
                params, prompt, mask, limit, None, version, mcfg, scfg, width=prompt.shape[1],
                keys_B=jax.random.wrap_key_data(keys))
            return local(f, (ps(params), r, r, r, r, rep), pool_specs)(params, prompt, mask, limit, keys, version)

        def insert(st, pool, pool_i, slot_i):
            return local(slot_state.insert, (specs, pool_specs, r, r), specs)(st, pool, pool_i, slot_i)

        def segment(params, st, version, p, width):
            f = functools.partial(slot_state.segment, p=p, width=width, steps=self.seg, mcfg=mcfg, scfg=scfg)
            return local(f, (ps(params), specs, rep), specs)(params, st, version)

        self._empty = jax.jit(lambda p: slot_state.empty(self.slots, p, mcfg, scfg), static_argnums=0,
                              out_shardings=shard)
        self._prefill = jax.jit(prefill)
        self._insert = jax.jit(insert, donate_argnums=0, out_shardings=shard)
        self._segment = jax.jit(segment, static_argnames=("p", "width"), donate_argnums=1, out_shardings=shard)
        self._keys = jax.jit(lambda key, ids: jax.random.key_data(decode.row_keys(key, ids)))
        self._park = jax.jit(turns_lib.park)  # multi-turn (one sampler device): a waiting row's state
        self._park_bare = jax.jit(lambda st, slots: turns_lib.park(st.replace(cache=None), slots))
        self._resume = jax.jit(turns_lib.resume)
        self._rewind = jax.jit(functools.partial(turns_lib.rewind, pad=scfg.pad_token_id))
        self._row = jax.jit(slot_state.row)
        self._reprefill = jax.jit(functools.partial(turns_lib.reprefill, mcfg=mcfg, scfg=scfg))

    def row_keys(self, key, ids) -> np.ndarray:
        """u32 key data of each row's own key (`decode.row_keys`), for `stream` feeds; ids padded
        to a power of two (one program per size class, not per count)."""
        ids = np.asarray(ids, np.int32)
        return np.asarray(self._keys(key, np.resize(ids, pow2(len(ids))) if len(ids) else ids))[:len(ids)]

    def generate(self, params, prompt_RxP, mask_RxP, limit_R, key, version: int, refresh=None, turns=None) -> dict:
        """Every row of `prompt_RxP` through the slots -> the static sampler's output dict
        (row order kept; row r's draws from `key` and r, as in a static batch). `turns`:
        multi-turn rows (`stream`)."""
        r = len(prompt_RxP)
        chunks = [(np.arange(r), prompt_RxP, mask_RxP, limit_R, self.row_keys(key, np.arange(r)))]
        out = {}
        for ids, got in self.stream(params, prompt_RxP.shape[1], version, lambda: chunks.pop() if chunks else None,
                                    refresh, turns=turns):
            for f, x in got.items():
                out.setdefault(f, np.zeros((r,) + x.shape[1:], x.dtype))[ids] = x
        return self.outputs(out)

    def outputs(self, got: dict) -> dict:
        """`stream` outputs (DecodeState fields) -> the static sampler's output dict."""
        return decode.outputs(types.SimpleNamespace(**got), self.sampler.cfg)

    def stream(self, params, p: int, version: int, feed, refresh=None, stop=None, turns=None, progress=None,
               max_rows: Optional[int] = None):
        """Decode rows through the slots, yielding `(ids, outputs)` for the rows that finished at
        each segment boundary (outputs: `slot_state.OUTPUTS` fields, one entry per id).

        `feed()` -> `(ids, prompt_RxP, mask_RxP, limit_R, keys_Rx2)` of new rows (prompts
        left-padded to `p`, keys from `row_keys`; with `turns`, a sixth array may stop each
        row's first turn before its budget `limit_R`), `()` for none now (asked again later), or
        None for none ever; it is asked at a boundary whenever fewer rows wait than there are
        slots; while it holds rows back and no slot decodes, `(no ids, {})` is yielded every
        10 ms. `refresh` as in `Sampler.generate`, asked before every segment but the first. `stop()`: end at the
        next boundary (rows still decoding are dropped). `turns` (`turns.Turns`): multi-turn
        rows; a row then finishes when its episode does. `progress`: after every segment,
        `progress({id: (tokens so far, observation flags)})` of the rows in the slots, whenever
        `progress.wanted()` (token streaming; one more device read per segment then).
        `max_rows`: `feed` is not asked while this many rows are in flight (decoding, waiting
        for a slot, or parked for a reply): a parked row frees its slot, so without a bound an
        environment slower than the slots would have ever more rows waiting on it. Ends when
        nothing waits or decodes."""
        params = self.sampler.place_params(params)
        st, s = self._empty(p), _Slots.idle(self.slots, self.groups)
        self.live, fed_all, first = s, False, True
        while True:
            if stop is not None and stop():
                return
            if refresh is not None and not first:
                params, version = self._refreshed(refresh, params, version, s)
            if turns is not None:  # replies that came: rows go on, or their episodes end
                st, ended = self._replies(params, st, turns, s)
                for ids, got in ended:
                    s.useful += int(got["valid_BxN"].sum())
                    yield ids, got
            fed_all = fed_all or self._take_new(feed, params, version, s, max_rows)
            if not any(s.waiting) and not ((s.row_of >= 0) & ~s.holding).any():
                if turns is not None and turns.waiting:  # every row in flight waits for a reply
                    futures.wait([w.reply for w in turns.waiting.values()], timeout=0.05,
                                 return_when=futures.FIRST_COMPLETED)
                    continue
                if fed_all:
                    break
                time.sleep(0.01)  # the feed holds rows back for now (e.g. staleness at admission)
                first = False
                yield np.empty(0, np.int64), {}  # idle: the caller may act meanwhile (hand over scored groups)
                continue
            first = False
            st, ids, got = self._decode_segment(params, st, version, p, turns, s)
            if progress is not None and progress.wanted():
                progress(self._so_far(st, s))
            if ids.size:
                yield ids, got
        self.occupancy.append(s.useful / max(1, self.slots * s.decoded))

    def _so_far(self, st, s: "_Slots") -> dict:
        """{id: (its tokens so far, their observation flags)} of the rows decoding in the slots."""
        slots = np.flatnonzero((s.row_of >= 0) & ~s.holding)
        toks, valid, obs = (np.asarray(x)[slots] for x in jax.device_get((st.tokens_BxN, st.valid_BxN, st.obs_BxN)))
        return {int(s.row_of[j]): (t[v], o[v]) for j, t, v, o in zip(slots, toks, valid, obs)}

    def _refreshed(self, refresh, params, version: int, s: "_Slots"):
        """(params, version), newer if `refresh` has newer weights: the rows still waiting are
        prefilled again with them (parked rows keep their cache)."""
        newer = refresh()
        if newer is not None and newer[0] > version:
            version, params = newer[0], self.sampler.place_params(newer[1])
            fresh = [collections.deque(i for i in q if i not in s.start) for q in s.waiting]
            s.pools = [pl for pl in s.pools if s.start.keys() & pl[1].keys()]
            if any(fresh):
                s.pools.append(self._pool(params, fresh, s.rows, version))
        return params, version

    def _take_new(self, feed, params, version: int, s: "_Slots", max_rows: Optional[int] = None) -> bool:
        """Ask `feed` for rows while fewer wait than there are slots (and fewer than `max_rows`
        are in flight), spread over the devices and prefilled into a pool; True once it has none
        ever."""
        g = self.groups
        while sum(map(len, s.waiting)) < self.slots and (max_rows is None or len(s.rows) < max_rows):
            new = feed()
            if not new:
                return new is None
            fresh = [collections.deque() for _ in range(g)]
            new = new if len(new) > 5 else (*new, new[3])  # each row's first turn stops at its budget
            for row in zip(*new):
                d = min(range(g), key=lambda d: len(s.waiting[d]) + len(fresh[d]))  # balance the devices
                s.rows[int(row[0])] = row[1:]
                fresh[d].append(int(row[0]))
            s.pools.append(self._pool(params, fresh, s.rows, version))
            for d in range(g):
                s.waiting[d].extend(fresh[d])
        return False

    def _decode_segment(self, params, st, version: int, p: int, turns, s: "_Slots"):
        """Fill free slots, decode one segment, and take out the rows that finished (a multi-turn
        row that ended a turn waits for its reply instead): (state, their ids, their outputs)."""
        n = self.sampler.cfg.max_new_tokens
        st = self._fill(st, s)
        width = p + attention_width(int(s.steps[s.row_of >= 0].max()) + self.seg, self.seg, n)  # one static key
        st = self._segment(params, st, version, p=p, width=width)
        wanted = turns.stops.wanted() if turns is not None and turns.stops is not None else ()
        if wanted:
            st = self._stopped(st, turns, s, wanted)
        before = s.steps.copy()
        done, s.steps = (np.array(x) for x in jax.device_get((st.done_B, st.step)))
        s.decoded += int((s.steps - before)[s.row_of >= 0].max(initial=0))
        finished = np.flatnonzero((s.row_of >= 0) & done & ~s.holding)
        if not finished.size:
            return st, np.empty(0, np.int64), {}
        fields = jax.device_get({f: getattr(st, f) for f in slot_state.handed_over(st)})
        got = {f: x[finished] for f, x in fields.items()}
        ids = s.row_of[finished].copy()
        if turns is not None:  # a turn's end is not the row's: it waits for its reply
            paused = turns.ended_turns(ids, got, lambda i: s.rows[i][2])
            st = self._wait(st, turns, ids[paused], finished[paused], got, paused, s)
            ids, finished, got = ids[~paused], finished[~paused], {f: x[~paused] for f, x in got.items()}
        s.row_of[finished] = -1
        for i in ids:
            del s.rows[int(i)]
        s.useful += int(got["valid_BxN"].sum())
        return st, ids, got

    def _stopped(self, st, turns, s: "_Slots", wanted):
        """Rows whose turn so far holds a stop string (`turns.stops`) cut back to where it ends."""
        slots = np.flatnonzero((s.row_of >= 0) & ~s.holding)
        toks, valid, obs = (np.asarray(x)[slots] for x in jax.device_get((st.tokens_BxN, st.valid_BxN, st.obs_BxN)))
        cuts = turns.cuts(s.row_of[slots].tolist(), toks, valid, obs, wanted)
        if not cuts:
            return st
        k = pow2(len(cuts))
        at, col = np.full(k, self.slots, np.int32), np.zeros(k, np.int32)
        at[:len(cuts)], col[:len(cuts)] = zip(*[(slots[j], c) for j, c in cuts])
        return self._rewind(st, self._put(at), self._put(col))

    def _wait(self, st, turns, ids, slots, got, paused, s: "_Slots"):
        """Rows `ids` (in `slots`) ended a turn: ask their environment, and hold their slots or
        park them and free the slots."""
        where = np.flatnonzero(paused)
        for j, i, slot in zip(where, ids.tolist(), slots.tolist()):
            k = int(got["valid_BxN"][j].sum())
            more = {f: got[f][j][:k].copy() for f in turns.detail}
            reply = turns.respond(i, got["tokens_BxN"][j][:k].copy(), got["obs_BxN"][j][:k].copy(), **more)
            turns.waiting[i] = turns_lib.Waiting(reply, slot=slot)
        if not turns.release:
            s.holding[slots] = True
            return st
        park = self._park_bare if self.sampler.cfg.turn_cache == "recompute" else self._park
        # a power-of-two pool (copies of the last row pad it): every later program on the pool
        # (insert, resume, row) compiles once per size class, not once per count of rows parked
        padded = np.pad(slots.astype(np.int32), (0, pow2(len(slots)) - len(slots) if len(slots) else 0), mode="edge")
        pool = [park(st, self._put(padded)), {i: j for j, i in enumerate(ids.tolist())}]
        for i in ids.tolist():
            turns.waiting[i].pool, turns.waiting[i].slot = pool, -1
        s.row_of[slots] = -1
        return st

    def _replies(self, params, st, turns, s: "_Slots"):
        """Apply the replies that came: a row goes on with its observation forced at its next
        columns (in its held slot, or queued first to re-enter one with its parked state, its
        cache rebuilt first under turn_cache="recompute"), or its episode ends (returned as
        [(ids, outputs)]). One read of the steps and one resume per state the replies' rows are
        in (the slots, or a parked pool), not one per reply."""
        ended, going, steps = [], {}, {}
        for i, reply in turns.ready():
            w = turns.waiting.pop(i)
            state, at = (st, w.slot) if w.pool is None else (w.pool[0], w.pool[1][i])
            holder = id(w.pool)  # the slots' state (None), or the parked pool it is in
            if holder not in steps:
                steps[holder] = np.broadcast_to(jax.device_get(state.step), state.done_B.shape)
            step = int(steps[holder][at])
            room = int(s.rows[i][2]) - step
            if reply.done or room <= 0 or not len(reply.obs_ids):
                ended.append((np.asarray([i]), jax.device_get(self._row(state, np.int32(at)))))  # this row only
                if w.pool is None:
                    s.row_of[w.slot], s.holding[w.slot] = -1, False
                del s.rows[i]
                continue
            going.setdefault(holder, (w, []))[1].append((i, at, reply, room, step))
        for w, rows in going.values():
            state = self._resumed(st if w.pool is None else w.pool[0], turns, rows)
            if w.pool is None:
                st = state
                s.holding[[at for _, at, *_ in rows]] = False
                continue
            w.pool[0] = state
            for i, at, _, _, step in rows:
                if state.cache is None:  # turn_cache="recompute"
                    s.pools.append([self._rebuilt(params, state, at, s.rows[i]), {i: 0}])
                else:
                    s.pools.append([state, {i: at}])
                s.waiting[0].appendleft(i)
                s.start[i] = step
        return st, ended

    def _resumed(self, state, turns, rows):
        """`state` with `rows` [(id, index, reply, room, step)] going on: one resume, its rows
        padded to a power of two with an index past the state's rows (dropped)."""
        obs, lens = turns.obs_arrays([r[2] for r in rows], [r[3] for r in rows])
        # each row stops at its budget (step + room), or after the next turn's max_tokens
        caps = [getattr(r[2], "max_tokens", None) for r in rows]  # a reply may have none (duck-typed)
        limit = [step + (room if cap is None else min(room, n + cap))
                 for (_, _, _, room, step), n, cap in zip(rows, lens.tolist(), caps)]
        k = pow2(len(rows))
        at = np.full(k, state.done_B.shape[0], np.int32)
        at[:len(rows)] = [r[1] for r in rows]
        obs, lens = np.pad(obs, ((0, k - len(rows)), (0, 0))), np.pad(lens, (0, k - len(rows)))
        limit = np.pad(np.asarray(limit, np.int32), (0, k - len(rows)))
        return self._resume(state, self._put(at), self._put(obs), self._put(lens), self._put(limit))

    def _rebuilt(self, params, pool, at: int, row):
        """Row `at` of a cache-less parked pool with its cache rebuilt (`turns.reprefill`), its
        drawn tokens' log-prob gap to the recorded ones counted in `Sampler.reprefill`: a one-row pool."""
        one = self._park(pool, self._put(np.asarray([at], np.int32)))
        one, logp = self._reprefill(params, one, self._put(row[0][None]), self._put(row[1][None]))
        drawn, gap = jax.device_get((one.valid_BxN & ~one.obs_BxN, jnp.abs(logp - one.logp_BxN)))
        gap = gap[drawn]
        r = self.sampler.reprefill
        r["rows"], r["tokens"], r["abs_sum"] = r["rows"] + 1, r["tokens"] + gap.size, r["abs_sum"] + float(gap.sum())
        r["abs_max"] = max(r["abs_max"], float(gap.max(initial=0.0)))
        return one

    def _put(self, x):
        x = np.asarray(x)
        return jnp.asarray(x) if self._rows is None else jax.device_put(x, self._rows)

    def _pool(self, params, per_device, rows, version):
        """Prefill the rows `per_device[d]` (ids) into device d's block of a pool, each block
        padded to a power of two with copies (bounded programs) -> [pool, {id: index}]."""
        n = pow2(max(len(q) for q in per_device))
        order = [np.resize(np.asarray(q or [next(iter(rows))]), n) for q in per_device]
        # the first turn's limit (the budget, or sooner: `stream`) in place of the budget
        prompt, mask, limit, keys = (np.stack([rows[int(i)][k] for q in order for i in q]) for k in (0, 1, 4, 3))
        pool = self._prefill(params, self._put(prompt), self._put(mask), self._put(limit.astype(np.int32)),
                             self._put(keys), version)
        return [pool, {int(i): j for q in per_device for j, i in enumerate(q)}]

    def _fill(self, st, s: "_Slots"):
        """Move waiting rows into free slots (device d's rows into device d's slots): one
        insert per pool that holds some of them, of a power-of-two count per device."""
        g, local = self.groups, self.slots // self.groups
        free = [np.flatnonzero(s.row_of[d * local:(d + 1) * local] < 0)[:len(s.waiting[d])] for d in range(g)]
        take = [[s.waiting[d].popleft() for _ in free[d]] for d in range(g)]
        for d in range(g):
            s.row_of[d * local + free[d]] = take[d]
            s.steps[d * local + free[d]] = [s.start.pop(i, 0) for i in take[d]]
        for pool, where in s.pools:
            mine = [[(where[i], f) for i, f in zip(t, fr) if i in where] for t, fr in zip(take, free)]
            if not any(mine):
                continue
            k = pow2(max(map(len, mine)))
            pad = lambda pairs, col, fill: [x[col] for x in pairs] + [fill] * (k - len(pairs))
            st = self._insert(st, pool, self._put(np.concatenate([pad(m, 0, 0) for m in mine]).astype(np.int32)),
                              self._put(np.concatenate([pad(m, 1, local) for m in mine]).astype(np.int32)))
        still = {i for q in s.waiting for i in q}
        s.pools[:] = [[pool, where] for pool, where in s.pools if still & where.keys()]
        return st


@dataclasses.dataclass
class _Slots:
    """One stream's host-side bookkeeping: which row each slot holds, what waits for a slot, and
    what a (re-)prefill of a row needs."""

    waiting: list  # per device: ids in arrival order
    row_of: np.ndarray  # the id each slot holds (-1: idle); slot j is on device j // (slots / devices)
    holding: np.ndarray  # multi-turn, hold: the slot's row waits for its reply
    steps: np.ndarray  # each slot's decode step
    rows: dict = dataclasses.field(default_factory=dict)  # id -> (prompt, mask, limit, key data, first turn's limit)
    pools: list = dataclasses.field(default_factory=list)  # [prefilled pool, {id: index in the pool}]
    start: dict = dataclasses.field(default_factory=dict)  # id -> the step a resumed row re-enters its slot at
    decoded: int = 0  # decode steps run (summed over segments)
    useful: int = 0  # tokens generated

    @classmethod
    def idle(cls, slots: int, devices: int) -> "_Slots":
        return cls([collections.deque() for _ in range(devices)], np.full(slots, -1), np.zeros(slots, bool),
                   np.zeros(slots, np.int64))
