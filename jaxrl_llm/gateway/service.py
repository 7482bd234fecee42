"""The gateway's engine side: sessions' rows decoded in the sampler's continuous-batching slots
on a thread of their own, and each closed session handed over as rows of the batch contract.

Requests from every agent share the slots: a session's first request feeds a new row
(`continuous.SlotEngine.stream`'s `feed`), a turn's end parks the row (its slot goes to another
row) until the session's next request forces its observation in (`rollout.turns`), and a
session whose reward came (or that timed out) leaves. A row's draws follow its key and id alone.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from concurrent.futures import Future
from typing import Optional

import jax
import numpy as np

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.gateway import chat, fields, sessions as sessions_lib
from jaxrl_llm.rollout.sampler import left_pad, to_batch
from jaxrl_llm.rollout.turns import Turns
from jaxrl_llm.tasks.envs import turn_start

SCORES = ("logp_BxN", "topk_ids_BxNxK", "topk_logp_BxNxK")  # a row's outputs a turn's `logprobs` come from
MAX_RESPONSES = 64  # a session's Responses conversations kept for `previous_response_id` (the newest)


@dataclasses.dataclass
class Closed:
    """A session that ended: its rows (one, or more when it branched) and its reward."""

    session: str
    reward: Optional[float]  # None: the agent left it to the task
    batch: TrajectoryBatch  # one row per branch, in order; `rewards` filled when given
    branched: np.ndarray  # bool per row
    turns: np.ndarray
    tool_calls: np.ndarray


class _Stops:
    """The slots' `Turns.stops`: the rows whose waiting request gave stop strings or allowed one
    tool call, and where each one's turn so far first holds one (`chat.turn_cut`)."""

    def __init__(self, gateway: "Gateway"):
        self.gateway = gateway

    def wanted(self) -> set:
        g = self.gateway
        with g._lock:
            return {r.id for r in g.sessions.rows.values()
                    if r.state == "generating" and r.ask.cuts}

    def __call__(self, row: int, ids):
        g = self.gateway
        with g._lock:
            r = g.sessions.rows.get(row)
            ask = r.ask if r is not None and r.state == "generating" else sessions_lib.Ask()
        return chat.turn_cut(g.format, ids, ask.stop, ask.one_call) if ask.cuts else None


class Gateway:
    """Sessions over one sampler's slots. `params`/`version`: the weights it decodes with until
    `publish` gives newer ones."""

    def __init__(self, sampler, format: chat.ChatFormat, params, version: int = 0, *, model: str = "policy",
                 slots: int = 8, max_turns: int = 8, timeout_s: float = 300.0, max_obs: int = 256, seed: int = 0,
                 clock=None, named: bool = False):
        cfg = sampler.cfg
        if format.stop_id not in cfg.turn_stop_ids:
            raise ValueError(f"the sampler's turn_stop_ids {cfg.turn_stop_ids} must hold the chat turn's closing "
                             f"token {format.stop_id}")
        if cfg.eos_token_id == format.stop_id:
            raise ValueError("the sampler's EOS is the chat turn's closing token: no session could go on")
        self.sampler, self.format, self.model, self.max_obs = sampler, format, model, max_obs
        kw = {} if clock is None else {"clock": clock}
        self.width = sampler.cfg.prompt_buckets[-1]
        self.sessions = sessions_lib.Sessions(format, max_turns, timeout_s, max_prompt=self.width, named=named, **kw)
        self._lock = threading.RLock()
        self._new: list = []  # rows whose first request came, not yet fed
        self._outputs: dict[int, dict] = {}  # row -> its outputs once it left the slots
        self._closed: list = []
        self._stop = threading.Event()
        self._error: list = []
        self._published = None
        self._latencies: list = []
        self._prompts: dict = {}  # row -> (its prompt ids, mask) as fed, until handed over
        self._streamed: dict = {}  # row -> [its turns before the streamed one, that turn's ids so far]
        self._responses: dict = {}  # session -> {response id: the conversation it ended}, until handed over
        self._engine = sampler.slots(slots)
        self._thread = threading.Thread(target=self._run, args=(params, version, seed), daemon=True,
                                        name="gateway-slots")
        self._thread.start()

    # -- requests (any thread) ------------------------------------------------------------------

    def chat(self, session: str, body: dict) -> Future:
        """A chat completion request -> Future[`sessions.Answer`] (its message the assistant's)."""
        return self._open(session, body, "messages")

    def complete(self, session: str, body: dict) -> Future:
        """A text completion request -> Future[`sessions.Answer`] (its message the text)."""
        return self._open(session, body, "prompt")

    def _open(self, session: str, body: dict, kind: str) -> Future:
        self.check()
        fields.check(body, kind, self.sampler.cfg, self.format)
        with self._lock:
            try:
                if kind == "prompt":
                    answer, row = self.sessions.complete(session, body.get("prompt"), fields.ask(body, self.format))
                else:
                    answer, row = self.sessions.request(session, body.get("messages"), chat.check_tools(
                        body.get("tools")), fields.ask(body, self.format))
            except chat.ChatError:
                self.sessions.counts["refused"] += 1
                raise
            if row is not None:
                self._new.append(row)
        return answer

    def expect(self, names) -> None:
        """`named`: the sessions the run hands out; each may open once (any other name is refused)."""
        with self._lock:
            self.sessions.expect(names)

    def forget(self, names) -> None:
        """`named`: sessions no longer waited for; those not opened yet are refused from now on."""
        with self._lock:
            self.sessions.forget(names)

    def remember(self, session: str, response: str, conversation: list) -> None:
        """The conversation a Responses answer of `session` ended (`responses.history`), for a
        later request's `previous_response_id`; a session keeps its newest MAX_RESPONSES."""
        with self._lock:
            if session in self.sessions.latest:  # not once handed over
                kept = self._responses.setdefault(session, {})
                kept[response] = conversation
                while len(kept) > MAX_RESPONSES:
                    del kept[next(iter(kept))]

    def recall(self, session: str, response) -> Optional[list]:
        """The conversation `response` of `session` ended (None: none, or not one of its own)."""
        with self._lock:
            return self._responses.get(session, {}).get(response) if isinstance(response, str) else None

    def watch(self, session: str) -> int:
        """A client streams the turn `session` just asked for: from the next segment on, the turn's
        ids so far are kept (`so_far`) until `unwatch`. Returns the row it decodes in."""
        with self._lock:
            row = self.sessions.latest[session]
            self._streamed[row] = [self.sessions.rows[row].turns, []]
            return row

    def unwatch(self, row: int) -> None:
        with self._lock:
            self._streamed.pop(row, None)

    def so_far(self, row: int) -> str:
        """The text of the streamed turn of `row` decoded so far (empty before it starts)."""
        with self._lock:
            ids = list(self._streamed.get(row, (0, []))[1])
        return self.format.decode([t for t in ids if t != self.format.stop_id])

    def wanted(self) -> bool:  # the slots' `progress` hook: whether any turn is streamed
        return bool(self._streamed)

    def __call__(self, parts: dict) -> None:
        """The slots' `progress`: each streamed row's tokens after its latest observation, once
        that observation is its request's (its turns before it all observed)."""
        with self._lock:
            for row, entry in self._streamed.items():
                if row in parts:
                    toks, obs = parts[row]
                    runs = int(np.sum(obs[1:] & ~obs[:-1]) + (len(obs) > 0 and obs[0]))
                    if runs == entry[0]:
                        entry[1] = toks[turn_start(obs):].tolist()

    def reward(self, session: str, value: Optional[float]) -> None:
        """Close `session` with `value` (None: the task will score its transcript)."""
        if value is not None and not math.isfinite(value):
            raise chat.ChatError("reward: a finite number")
        with self._lock:
            self.sessions.reward(session, value)
            self._settle()

    def abandon(self, session: str) -> bool:
        """Drop `session` (its agent failed): its rows leave the slots and its name is handed over
        (`closed`). False when it never asked anything: nothing will be handed over."""
        with self._lock:
            dropped = self.sessions.abandon(session)
            self._settle()
        return dropped

    def check(self) -> None:
        """Raise if the slots' thread has stopped on an error (every request would wait forever)."""
        if self._error:
            raise RuntimeError(f"the gateway's decode slots stopped: {self._error[0]!r}") from self._error[0]

    def publish(self, version: int, params) -> None:
        """Newer weights: the slots decode with them from their next segment on."""
        with self._lock:
            self._published = (version, params)

    def _refresh(self):
        with self._lock:
            newer, self._published = self._published, None
        return newer

    def closed(self) -> list:
        """Sessions handed over since the last call: `Closed`, or the name of one dropped (timed
        out, abandoned), oldest first."""
        with self._lock:
            out, self._closed = self._closed, []
        return out

    def slot_use(self) -> tuple:
        """(tokens the slots decoded for rows that left them, slots x decode steps run) so far."""
        s = self._engine.live
        return (0, 0) if s is None else (s.useful, self._engine.slots * s.decoded)

    def counts(self) -> dict:
        with self._lock:
            return dict(self.sessions.counts)

    def answered(self, ms: float) -> None:
        """A request was answered after `ms` milliseconds (the server reports each)."""
        with self._lock:
            self._latencies.append(ms)

    def latencies(self) -> np.ndarray:
        """Milliseconds of the requests answered since the last call."""
        with self._lock:
            out, self._latencies = np.asarray(self._latencies), []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    # -- the slots (one thread) -----------------------------------------------------------------

    def _feed(self, engine, key):
        with self._lock:  # asked at every pass of the slots' loop, idle or not: timeouts are checked here
            self.sessions.expire()
            rows, self._new = self._new, []
        if self._stop.is_set():
            return None
        if not rows:
            return ()
        cfg = self.sampler.cfg
        toks, mask = left_pad([r.prompt for r in rows], self.width, cfg.pad_token_id)
        ids = np.asarray([r.id for r in rows], np.int64)
        self._prompts.update({r.id: (toks[i], mask[i]) for i, r in enumerate(rows)})
        budget = np.full(len(rows), cfg.max_new_tokens)
        first = np.asarray([min(cfg.max_new_tokens, r.ask.max_tokens or cfg.max_new_tokens) for r in rows])
        return ids, toks, mask, budget, engine.row_keys(key, ids), first

    def _respond(self, row: int, tokens, obs, **scores) -> Future:
        with self._lock:
            try:
                return self.sessions.respond(row, tokens, obs, tuple(scores[f] for f in SCORES))
            except Exception as e:  # one row's turn ends that row, not every session in the slots
                return self.sessions.fail(row, e)

    def _run(self, params, version, seed) -> None:
        try:
            engine = self._engine
            key = jax.random.key(seed)
            turns = Turns(self._respond, release=True, max_obs=self.max_obs, detail=SCORES, stops=_Stops(self))
            for ids, got in engine.stream(params, self.width, version, lambda: self._feed(engine, key),
                                          refresh=self._refresh, stop=self._stop.is_set, turns=turns, progress=self):
                with self._lock:
                    for i, row in enumerate(ids.tolist()):
                        out = {f: x[i] for f, x in got.items()}
                        real = out["valid_BxN"]
                        try:
                            self.sessions.finished(row, out["tokens_BxN"][real], out["obs_BxN"][real],
                                                   bool(out["eos_B"]), tuple(out[f][real] for f in SCORES))
                        except Exception as e:  # as in `_respond`
                            self.sessions.fail(row, e)
                        self._outputs[row] = out
                    self._settle()
        except Exception as e:  # surfaced to every waiting request; the server reports it
            self._error.append(e)
            with self._lock:
                for row in self.sessions.rows.values():
                    if row.answer is not None and not row.answer.done():
                        row.answer.set_exception(e)

    def _settle(self) -> None:
        """Hand over every session whose reward came (or that timed out) once all its rows left
        the slots; timed-out sessions are dropped, counted."""
        s = self.sessions
        for name, reward in list(s.rewards.items()):
            rows = sorted((r for r in s.rows.values() if r.session == name), key=lambda r: r.id)
            if not all(r.id in self._outputs for r in rows):
                continue
            outs = [self._outputs.pop(r.id) for r in rows]
            for r in rows:
                del s.rows[r.id]
            del s.latest[name], s.rewards[name]
            self._responses.pop(name, None)
            if reward is not None and math.isnan(reward):
                self._closed.append(name)
                continue
            stacked = {f: np.stack([o[f] for o in outs]) for f in outs[0]}
            toks, mask = (np.stack(x) for x in zip(*[self._prompts.pop(r.id) for r in rows]))
            batch = to_batch(toks, mask, np.zeros(len(rows), np.int32), self._engine.outputs(stacked))
            batch = batch.replace(rewards=np.full(len(rows), np.nan if reward is None else reward, np.float32))
            self._closed.append(Closed(name, reward, batch, np.asarray([r.branched for r in rows]),
                                       np.asarray([r.turns for r in rows]), np.asarray([r.tool_calls for r in rows])))
