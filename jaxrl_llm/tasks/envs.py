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
from typing import Callable, Protocol, Sequence

import numpy as np

TURN_REWARDS = ("sum", "last")
_REGISTRY: dict[str, Callable] = {}


@dataclasses.dataclass(frozen=True)
class Reply:
    obs_ids: tuple = ()  # token ids appended to the row after the model's turn
    reward: float = 0.0  # this turn's reward
    done: bool = False  # the episode ends with this turn
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0


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


def done(reward: float = 0.0) -> Future:
    f: Future = Future()
    f.set_result(Reply(reward=reward, done=True))
    return f


class Episodes:
    """One generation's episodes: `respond(row, tokens, obs)` for the sampler (`rollout.turns`);
    `finish(row, tokens, obs)` once a row's episode is over; then `rewards(rows)` and `metrics()`.
    `prompt_of(row)` gives a row's prompt ids. Thread-safe (replies complete in tool threads)."""

    def __init__(self, env: Environment, prompt_of: Callable, max_turns: int, turn_reward: str = "last",
                 max_obs_tokens: int = 64):
        if turn_reward not in TURN_REWARDS:
            raise ValueError(f"unknown turn_reward {turn_reward!r}; valid: {', '.join(TURN_REWARDS)}")
        self.env, self.prompt_of, self.max_turns = env, prompt_of, max_turns
        self.turn_reward, self.max_obs = turn_reward, max_obs_tokens
        self._lock = threading.Lock()
        self.turn_rewards: dict[int, list] = {}
        self.turns: dict[int, int] = {}
        self.truncated: set = set()
        self.stats = dict(tool_calls=0, tool_errors=0, tool_timeouts=0, tool_seconds=0.0, obs_tokens=0,
                          obs_cut=0)

    def respond(self, row: int, tokens, obs) -> Future:
        with self._lock:
            self.turns[row] = self.turns.get(row, 0) + 1
            over = self.turns[row] >= self.max_turns
        if over:  # the turn limit: the episode ends here, flagged
            with self._lock:
                self.truncated.add(row)
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
                self.stats["tool_errors"] += 1
                self.truncated.add(row)
            out.set_result(Reply(done=True))
            return
        ids = tuple(reply.obs_ids)
        with self._lock:
            self.turn_rewards.setdefault(row, []).append(float(reply.reward))
            for k in ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds"):
                self.stats[k] += getattr(reply, k)
            self.stats["obs_tokens"] += min(len(ids), self.max_obs)
            self.stats["obs_cut"] += len(ids) > self.max_obs
        out.set_result(dataclasses.replace(reply, obs_ids=ids[:self.max_obs]))

    def finish(self, row: int, tokens, obs) -> None:
        """The turn that ended the episode (EOS, the budget, or the turn limit): its reward."""
        reward = float(self.env.final(self.prompt_of(row), list(tokens), list(obs)))
        with self._lock:
            self.turn_rewards.setdefault(row, []).append(reward)

    def rewards(self, rows: Sequence[int]) -> np.ndarray:
        with self._lock:
            return np.asarray([combine(self.turn_rewards.get(r, []), self.turn_reward) for r in rows], np.float32)

    def metrics(self, rows: Sequence[int]) -> dict:
        """Per-episode means over `rows` and the tool counters of this generation."""
        with self._lock:
            turns = [self.turns.get(r, 0) + 1 for r in rows]  # + the turn that ended it
            out = {"episode/turns": float(np.mean(turns)) if rows else 0.0,
                   "episode/truncated": float(np.mean([r in self.truncated for r in rows])) if rows else 0.0}
            out.update({f"tools/{k}": float(v) for k, v in self.stats.items()})
        return out
