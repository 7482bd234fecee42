"""Sessions: the protocol between agents' chat requests and the decode slots' rows. No I/O, no
threads of its own; an injectable clock (`runtime/leases.py` style).

A session is one episode: one row of the sampler (`Row`), opened by its first request (the
prompt), extended by each next request whose messages continue the conversation exactly (the
assistant turns this gateway returned, then new messages: their ids are forced into the row as
an observation), and closed by a reward. Per row the states are

    generating --(the model's turn ends: its message answers the request)--> waiting
    waiting    --(a request that extends it)------------------------------> generating
    waiting    --(reward, or session_timeout_s idle)-----------------------> closed

and the row may end from the model's side (EOS, its token budget, the turn limit). A request
that does not extend the row (history edited or dropped, or a row that has ended) opens a new
row of the same session, flagged `branched` and counted: the new row's prompt is the whole
conversation as sent, and nothing is spliced into the old row, which closes.

With `named=True` only the sessions the run handed out (`expect`) open, each once: a name
anyone else makes up, or one whose session was already handed over, opens nothing (no slot, no
row that no draw would ever take).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional

from jaxrl_llm.gateway import chat
from jaxrl_llm.tasks.envs import Reply, turn_start


class Answer(NamedTuple):
    """What a request waits for: the model's turn as OpenAI's response gives it."""

    message: object  # the assistant message (chat), or the text (completions)
    finish: str  # finish reason: stop | tool_calls | length
    usage: dict  # prompt / completion / total tokens, in the row's ids
    logprobs: Optional[dict] = None  # choices[].logprobs when the request asked for them
    ids: Optional[tuple] = None  # (the ids the turn read, the ids it drew) when asked (`Ask.token_ids`)


@dataclasses.dataclass(frozen=True)
class Ask:
    """What a request asks of its turn beyond the messages."""

    logprobs: Optional[int] = None  # the answer carries the turn's log-probs, with this many top ids (None: not)
    max_tokens: Optional[int] = None  # the turn stops after drawing this many (None: the session's budget)
    stop: tuple = ()  # the turn stops at the id that completes one of these strings
    one_call: bool = False  # `parallel_tool_calls=false`: the turn stops at the id that completes its first call
    calls: bool = True  # False (`tool_choice="none"`): the turn's text is its answer, no call parsed from it
    token_ids: bool = False  # the answer carries the ids the turn read and drew (vLLM's `return_token_ids`)

    @property
    def cuts(self) -> bool:
        """Whether the slots may end the turn early (`rollout.turns.Turns.stops`)."""
        return bool(self.stop) or self.one_call


COUNTERS = ("opened", "closed", "timed_out", "abandoned", "branched", "refused", "failed", "turns", "tool_calls")


@dataclasses.dataclass
class Row:
    """One row of a session in the decode slots."""

    id: int
    session: str
    prompt: list  # the first request rendered (ids)
    messages: object  # the conversation so far: `chat.normal` messages (assistant turns included), or text
    tools: Optional[list]
    branched: bool = False
    state: str = "generating"  # generating | waiting | closed
    answer: Optional[Future] = None  # the request waiting for the model's turn: `Answer`
    ask: Ask = Ask()  # the waiting request's
    cut: bool = False  # its last turn stopped before its closing token (`max_tokens`, or a stop string)
    reply: Optional[Future] = None  # the slots' wait for this row's next observation (`tasks.envs.Reply`)
    turns: int = 0
    tool_calls: int = 0
    seen: float = 0.0  # clock of the last request or answer
    ended: bool = False  # the model's side ended the row (EOS, budget, turn limit)


class Sessions:
    """Every session's rows; `format` renders and parses messages (`chat.ChatFormat`)."""

    def __init__(self, format: chat.ChatFormat, max_turns: int, timeout_s: float, max_prompt: int = 1 << 30,
                 clock: Callable[[], float] = time.monotonic, named: bool = False):
        self.format, self.max_turns, self.timeout_s, self.clock = format, max_turns, timeout_s, clock
        self.max_prompt = max_prompt  # ids a row's prompt may have (the sampler's largest bucket)
        self.rows: dict[int, Row] = {}
        self.latest: dict[str, int] = {}  # session -> its newest row
        self.rewards: dict[str, Optional[float]] = {}  # None: the task scores it; nan: dropped
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.expected: Optional[set] = set() if named else None  # named: handed out, not yet opened
        self._next = 0

    def expect(self, names) -> None:
        """Sessions the run hands out (`named`): each may open once."""
        self.expected.update(names)

    def forget(self, names) -> None:
        """Sessions the run no longer waits for: those not opened yet never will be."""
        self.expected.difference_update(names)

    def request(self, session: str, messages, tools=None, ask: Ask = Ask()) -> tuple[Future, Optional[Row]]:
        """A chat request of `session` -> (the future of its answer, the new row to start or None
        when the request extends a waiting row, which goes on by itself)."""
        if not isinstance(messages, list) or not messages:
            raise chat.ChatError("messages: a list of at least one message")
        msgs = [chat.normal(m, f"messages[{i}]") for i, m in enumerate(messages)]
        return self._request(session, msgs, tools, ask)

    def complete(self, session: str, prompt, ask: Ask = Ask()) -> tuple[Future, Optional[Row]]:
        """A text completion request (`/v1/completions`): it goes on in the session's row when
        `prompt` starts with the row's text so far (its prompt, then each completion returned);
        the rest is tokenised on its own. Anything else branches, as for chat."""
        if not isinstance(prompt, str) or not prompt:
            raise chat.ChatError("prompt: a non-empty string")
        return self._request(session, prompt, None, ask)

    def _request(self, session: str, msgs, tools, ask: Ask) -> tuple[Future, Optional[Row]]:
        text = isinstance(msgs, str)
        if session in self.rewards:
            raise chat.ChatError(f"session {session!r} is closed (its reward was given)")
        answer: Future = Future()
        row = self.rows.get(self.latest.get(session, -1))
        if row is None and self.expected is not None and session not in self.expected:
            raise chat.UnknownSession(f"session {session!r}: not one this run handed out, or already over")
        if row is not None and row.state == "generating":
            raise chat.ChatError(f"session {session!r} has a request in flight; send the next one after its answer")
        if row is not None and row.state == "waiting" and not row.ended and tools == row.tools and \
                isinstance(row.messages, str) == text and _extends(row.messages, msgs):
            if text:
                ids = self.format.encode(msgs[len(row.messages):])
            else:  # a turn cut at max_tokens is closed first, as the template closes it
                ids = [self.format.stop_id] * row.cut + self.format.extension(row.messages, msgs[len(row.messages):],
                                                                               tools)
            row.messages, row.state, row.answer, row.seen, row.ask = msgs, "generating", answer, self.clock(), ask
            row.reply.set_result(Reply(obs_ids=tuple(ids), max_tokens=ask.max_tokens))
            return answer, None
        prompt = self.format.encode(msgs) if text else self.format.prompt(msgs, tools)
        if len(prompt) > self.max_prompt:  # refused before any row exists: nothing to close or hand over
            raise chat.ChatError(f"{'prompt' if text else 'messages'}: {len(prompt)} prompt tokens exceed the largest "
                                 f"sampler.prompt_buckets ({self.max_prompt})")
        new = Row(self._next, session, prompt, msgs, tools, branched=row is not None, answer=answer, seen=self.clock(),
                  ask=ask)
        self._next += 1
        if row is not None:  # a branch: the old row closes as it is, counted
            self.counts["branched"] += 1
            self._close(row)
        else:
            self.counts["opened"] += 1
        self.rows[new.id], self.latest[session] = new, new.id
        if self.expected is not None:
            self.expected.discard(session)  # open now: it goes on by its row, or not at all once handed over
        return answer, new

    def respond(self, row_id: int, tokens, obs, scores=None) -> Future:
        """The slots' side (`rollout.turns.Turns.respond`): the row's turn ended; its message
        answers the waiting request; the returned future is the row's next observation.
        `scores`: the row's (log-probs, top-K ids, top-K log-probs) so far, for `logprobs`."""
        row, reply = self.rows[row_id], Future()
        row.reply = reply
        if row.state == "closed":  # the session moved on (branch, timeout) while this turn decoded
            reply.set_result(Reply(done=True))
            return reply
        row.turns += 1
        said = self._turn(row, tokens, obs)
        # a turn that stops before its closing token stopped at a stop string, or at max_tokens
        row.cut = not len(tokens) or int(tokens[-1]) != self.format.stop_id
        calls = isinstance(said, dict) and said.get("tool_calls")
        finish = "length" if row.cut and not self._stopped(row, tokens, obs) else "tool_calls" if calls else "stop"
        self._answer(row, said, finish, tokens, obs, scores)
        if row.turns >= self.max_turns:
            row.ended = True
            reply.set_result(Reply(done=True))
        return reply

    def finished(self, row_id: int, tokens, obs, eos: bool, scores=None) -> None:
        """The row left the slots (EOS, budget, turn limit, or closed): a request still waiting
        gets the last turn (finish reason `stop` at EOS, else `length`)."""
        row = self.rows[row_id]
        row.ended = True
        if row.state == "generating" and row.answer is not None and not row.answer.done():
            row.turns += 1
            cut = len(tokens) - 1 if eos else len(tokens)  # EOS is no text of the turn
            self._answer(row, self._turn(row, tokens[:cut], obs[:cut]), "stop" if eos else "length", tokens, obs,
                         scores)

    def fail(self, row_id: int, error: Exception) -> Future:
        """The row's turn could not be answered (`respond` or `finished` raised: this gateway's
        fault, not its agent's): the row ends, its waiting request gets the error, and the
        session goes on only as a branch, or is dropped. Returns the row's (final) reply."""
        row, reply = self.rows[row_id], Future()
        row.reply, row.ended = reply, True
        self.counts["failed"] += 1
        reply.set_result(Reply(done=True))
        if row.state == "generating":
            row.state, row.seen = "waiting", self.clock()
        if row.answer is not None and not row.answer.done():
            row.answer.set_exception(chat.TurnFailed(f"session {row.session!r}: its turn could not be answered "
                                                     f"({type(error).__name__}: {str(error)[:200]}); the session "
                                                     "can only branch or end"))
        return reply

    def reward(self, session: str, value: Optional[float]) -> list:
        """The session's reward (None: the task scores its transcript): its rows close. Returns
        the ids of its rows."""
        if session not in self.latest:
            raise KeyError(session)
        if session in self.rewards:
            raise chat.ChatError(f"session {session!r} already has a reward")
        self.rewards[session] = None if value is None else float(value)
        ids = [r.id for r in self.rows.values() if r.session == session]
        for i in ids:
            self._close(self.rows[i])
        self.counts["closed"] += 1
        return ids

    def abandon(self, session: str) -> bool:
        """The session ends without a reward (its agent failed): closed and dropped, counted.
        False when there is nothing to drop (it never asked anything, or it has its reward)."""
        if session not in self.latest or session in self.rewards:
            return False
        for row in [r for r in self.rows.values() if r.session == session]:
            self._close(row)
        self.rewards[session] = float("nan")
        self.counts["abandoned"] += 1
        return True

    def expire(self) -> list:
        """Sessions idle past `timeout_s` with no reward: closed and dropped. Returns their names."""
        now, gone = self.clock(), []
        for s, i in list(self.latest.items()):
            row = self.rows[i]
            if s not in self.rewards and row.state != "generating" and now - row.seen > self.timeout_s:
                gone.append(s)
        for s in gone:
            for row in [r for r in self.rows.values() if r.session == s]:
                self._close(row)
            self.rewards[s] = float("nan")
            self.counts["timed_out"] += 1
        return gone

    def _stopped(self, row: Row, tokens, obs) -> bool:
        """Whether the row's turn holds one of its request's stop strings, or the one tool call it
        allowed (`Ask.one_call`)."""
        ids = [t for t in tokens[turn_start(obs):] if t != self.format.stop_id]
        return chat.ends_turn(self.format.decode(ids), row.ask.stop, row.ask.one_call)

    def _turn(self, row: Row, tokens, obs):
        """The turn that ended the row's tokens: its message (chat) or its text (completions),
        up to the first of its request's stop strings, and with `one_call` up to the end of its
        first tool call (the row keeps what follows: it was drawn); with `calls` off its text as
        it is, no call parsed."""
        start = turn_start(obs)
        if (row.ask.cuts or not row.ask.calls) and not isinstance(row.messages, str):
            text = self.format.decode([t for t in tokens[start:] if t != self.format.stop_id])
            text = text[:chat.first_stop(text, row.ask.stop)] if row.ask.stop else text
            text = text[:chat.first_call_end(text)] if row.ask.one_call else text
            if not row.ask.calls:
                return self._said(row, {"role": "assistant", "content": text}, [])
            return self._said(row, *chat.parse_turn(text, f"{row.id}_{row.turns}"))
        if isinstance(row.messages, str):
            ids = [t for t in tokens[start:] if t != self.format.stop_id]
            said = self.format.decode(ids)
            said = said[:chat.first_stop(said, row.ask.stop)] if row.ask.stop else said
            row.messages += said
            self.counts["turns"] += 1
            return said
        return self._said(row, *self.format.reply(list(tokens[start:]), f"{row.id}_{row.turns}"))

    def _said(self, row: Row, msg: dict, calls: list) -> dict:
        row.messages = row.messages + [chat.normal(msg)]
        row.tool_calls += len(calls)
        self.counts["turns"] += 1
        self.counts["tool_calls"] += len(calls)
        return msg

    def _answer(self, row: Row, msg, finish: str, tokens, obs, scores) -> None:
        row.state, row.seen = "waiting", self.clock()
        if row.answer is not None and not row.answer.done():
            start, lp = turn_start(obs), None
            if row.ask.logprobs is not None and scores is not None:
                lp = chat.logprobs(self.format, tokens[start:], *(x[start:] for x in scores), row.ask.logprobs)
            ids = [int(t) for t in tokens]
            read = (list(row.prompt) + ids[:start], ids[start:]) if row.ask.token_ids else None
            row.answer.set_result(Answer(msg, finish, _usage(row, tokens, obs), lp, read))

    def _close(self, row: Row) -> None:
        if row.state == "closed":
            return
        row.state = "closed"
        if row.reply is not None and not row.reply.done():
            row.reply.set_result(Reply(done=True))
        if row.answer is not None and not row.answer.done():
            row.answer.set_exception(chat.ChatError(f"session {row.session!r} closed before its answer"))


def _usage(row: Row, tokens, obs) -> dict:
    """OpenAI's `usage` of the turn that ended `tokens`: the ids the row held before it (its
    prompt, earlier turns, observations: what the model read) and the ids drawn in it (its
    closing token included, as the model drew it)."""
    start = turn_start(obs)
    before, drawn = len(row.prompt) + start, len(tokens) - start
    return {"prompt_tokens": before, "completion_tokens": drawn, "total_tokens": before + drawn}


def _extends(before, now) -> bool:
    """Whether the conversation `now` goes on from `before` (text, or messages) with something new."""
    if isinstance(before, str):
        return now.startswith(before) and len(now) > len(before)
    return chat.first_difference(before, now) is None and len(now) > len(before)
