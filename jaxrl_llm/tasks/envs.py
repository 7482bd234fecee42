"""Multi-turn environments: the other side of an episode, registered by name like objectives.

An episode is one row of token ids: the prompt, then model turns and the environment's
observations, exactly as sampled and as appended (`rollout.turns`). A model turn ends when the
sampler draws one of the environment's `stop_ids` (a tool call's closing tag, an end-of-turn
token); the environment then `reply`s with the observation's token ids and this turn's reward,
or ends the episode. EOS ends the episode from the model's side: `final` gives that turn's reward.
Per-turn rewards combine into the episode's by `task.turn_reward` ("sum" or "last").

`Episodes` is the sampler-facing bookkeeping of one generation: it maps rows to prompts, counts
turns against `max_turns`, cuts observations to `max_obs_tokens`, and keeps the rewards and the
tool counters the report plots.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

TURN_REWARDS = ("sum", "last")
_REGISTRY: dict[str, Callable] = {}


@dataclasses.dataclass(frozen=True)
class Reply:
    obs_ids: tuple = ()  # token ids appended to the row after the model's turn
    reward: float = 0.0  # this turn's reward
    done: bool = False  # the episode ends with this turn
    tool_calls: int = 0  # calls attempted (a malformed one included)
    tool_errors: int = 0  # of those, calls that failed (malformed, raised, or the sandbox failed)
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    max_tokens: Optional[int] = None  # tokens the next turn may draw (None: up to the row's budget)


class Environment(Protocol):
    stop_ids: tuple  # drawn tokens that end a model turn

    def reply(self, prompt: Sequence[int], episode: Sequence[int], obs: Sequence[bool]) -> Future:
        """Future[Reply] to the turn that ends `episode` (the row after its prompt; `obs` marks
        earlier observations)."""

    def final(self, prompt: Sequence[int], episode: Sequence[int], obs: Sequence[bool]) -> float:
        """The reward of the turn that ended the episode with EOS (or at the budget)."""


def register(name: str):
    """`@register("calculator")` on a factory `(task, config) -> Environment`."""
    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory
    return deco


def names() -> tuple:
    return tuple(sorted(_REGISTRY))


def make(name: str, *args, **kwargs) -> Environment:
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; valid: {', '.join(names()) or 'none'}")
    return _REGISTRY[name](*args, **kwargs)


def combine(rewards: Sequence[float], how: str) -> float:
    """An episode's reward from its turns' rewards: their sum, or the last one."""
    if how not in TURN_REWARDS:
        raise ValueError(f"unknown turn_reward {how!r}; valid: {', '.join(TURN_REWARDS)}")
    if not len(rewards):
        return 0.0
    return float(sum(rewards)) if how == "sum" else float(rewards[-1])


def turn_start(obs: Sequence[bool]) -> int:
    """Where the episode's last model turn starts: after its last observation (0: none yet)."""
    return max((i + 1 for i, o in enumerate(obs) if o), default=0)


def tool_reply(job: Future, observe: Callable) -> Future:
    """Future[Reply] to a turn whose one tool call runs in the sandbox (`job`: a
    `ToolRunner.submit` of it). `observe(result) -> (observation ids, failed)`: `failed` marks
    a result the environment cannot use though the tool ran (counted as an error). A sandbox
    that cannot run the call at all answers as a failing call does."""
    from jaxrl_llm.tasks.sandbox import ToolResult

    out: Future = Future()

    def done(f):
        try:
            r = f.result()[0]
        except Exception as e:
            r = ToolResult(f"tool error: {type(e).__name__}: {e}", "error", 0.0)
        ids, failed = observe(r)
        out.set_result(Reply(obs_ids=tuple(ids), tool_calls=1, tool_errors=int(r.status == "error" or failed),
                             tool_timeouts=int(r.status == "timeout"), tool_seconds=r.seconds))

    job.add_done_callback(done)
    return out


def done(reward: float = 0.0) -> Future:
    f: Future = Future()
    f.set_result(Reply(reward=reward, done=True))
    return f


COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "obs_tokens", "obs_cut")
TOTALS = ("episodes", "turns", "truncated") + COUNTERS  # `Episodes.take`'s sums, in this order


@dataclasses.dataclass
class _Row:
    turns: int = 0  # turns the environment answered
    rewards: list = dataclasses.field(default_factory=list)
    truncated: bool = False
    limit: bool = False  # its last turn hit the turn limit
    ended: bool = False  # the environment ended it (a done reply carries the last turn's reward)
    counts: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))


class Episodes:
    """Episodes in flight: `respond(row, tokens, obs)` for the sampler (`rollout.turns`);
    `finish(row, tokens, obs)` once a row's episode is over; then `take(rows)` hands over their
    rewards and counters and forgets them (a stream's rows come and go). `prompt_of(row)` gives
    a row's prompt ids. Thread-safe (replies complete in tool threads)."""

    def __init__(self, env: Environment, prompt_of: Callable, max_turns: int, turn_reward: str = "last",
                 max_obs_tokens: int = 64):
        if turn_reward not in TURN_REWARDS:
            raise ValueError(f"unknown turn_reward {turn_reward!r}; valid: {', '.join(TURN_REWARDS)}")
        self.env, self.prompt_of, self.max_turns = env, prompt_of, max_turns
        self.turn_reward, self.max_obs = turn_reward, max_obs_tokens
        self._lock = threading.Lock()
        self._rows: dict[int, _Row] = {}

    def _row(self, row: int) -> _Row:
        return self._rows.setdefault(row, _Row())

    def respond(self, row: int, tokens, obs) -> Future:
        with self._lock:
            r = self._row(row)
            r.turns += 1
            r.truncated |= r.turns >= self.max_turns
            r.limit = r.truncated
            if r.limit:  # the turn limit: the episode ends here, flagged
                return done()
        out: Future = Future()
        self.env.reply(self.prompt_of(row), list(tokens), list(obs)).add_done_callback(
            lambda f: self._record(row, f, out))
        return out

    def _record(self, row: int, reply_future: Future, out: Future) -> None:
        try:
            reply = reply_future.result()
        except Exception:  # an environment that breaks ends its episode, counted; the run goes on
            with self._lock:
                self._row(row).counts["tool_errors"] += 1
                self._row(row).truncated = self._row(row).ended = True
            out.set_result(Reply(done=True))
            return
        ids = tuple(reply.obs_ids)
        with self._lock:
            r = self._row(row)
            r.rewards.append(float(reply.reward))
            r.ended = bool(reply.done)
            for k in ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds"):
                r.counts[k] += getattr(reply, k)
            r.counts["obs_tokens"] += min(len(ids), self.max_obs)
            r.counts["obs_cut"] += len(ids) > self.max_obs
        out.set_result(dataclasses.replace(reply, obs_ids=ids[:self.max_obs]))

    def finish(self, row: int, tokens, obs) -> None:
        """The row's episode is over (EOS, the budget, the turn limit or the environment): the
        reward of its last turn, unless the environment's reply ending it carried one."""
        with self._lock:
            if self._row(row).ended:
                return
        reward = float(self.env.final(self.prompt_of(row), list(tokens), list(obs)))
        with self._lock:
            self._row(row).rewards.append(reward)

    @property
    def truncated(self) -> set:
        with self._lock:
            return {i for i, r in self._rows.items() if r.truncated}

    @property
    def stats(self) -> dict:
        """The counters summed over the rows held."""
        with self._lock:
            return {k: sum(r.counts[k] for r in self._rows.values()) for k in COUNTERS}

    def rewards(self, rows: Sequence[int]) -> np.ndarray:
        with self._lock:
            return np.asarray([combine(self._row(r).rewards, self.turn_reward) for r in rows], np.float32)

    def take(self, rows: Sequence[int]):
        """The finished episodes of `rows`, forgotten here: (rewards, truncated by the turn limit or
        a broken environment, their `TOTALS` as an array: sums over the rows)."""
        rewards = self.rewards(rows)
        with self._lock:
            got = [self._rows.pop(r, _Row()) for r in rows]
        totals = [len(got), sum(r.turns + (not (r.limit or r.ended)) for r in got), sum(r.truncated for r in got)]
        totals += [sum(r.counts[k] for r in got) for k in COUNTERS]
        return rewards, np.asarray([r.truncated for r in got], bool), np.asarray(totals, np.float64)


def summary(totals) -> dict:
    """Per-episode and per-call means of `TOTALS` sums (one generation's, or a run's so far)."""
    t = dict(zip(TOTALS, np.asarray(totals, np.float64)))
    n, calls = max(t["episodes"], 1.0), max(t["tool_calls"], 1.0)
    return {"episode/turns": t["turns"] / n, "episode/truncated": t["truncated"] / n,
            "episode/obs_tokens": t["obs_tokens"] / n, "episode/obs_cut": t["obs_cut"] / n,
            "tools/calls_per_episode": t["tool_calls"] / n, "tools/error_frac": t["tool_errors"] / calls,
            "tools/timeout_frac": t["tool_timeouts"] / calls, "tools/seconds_per_call": t["tool_seconds"] / calls,
            "tools/calls": t["tool_calls"], "tools/errors": t["tool_errors"], "tools/timeouts": t["tool_timeouts"],
            "episode/count": t["episodes"]}
