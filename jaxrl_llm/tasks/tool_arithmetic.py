"""Embedded multi-turn task: products of three 2-digit numbers, with a calculator tool.

Prompt "<bos>37*48*91="; the model may write "<calc>37*48</calc>": the closing tag ends its turn,
the calculator (`tools.calculator`, in the sandbox) evaluates the expression, and its value
("1776") is appended as an observation; the model goes on ("<calc>1776*91</calc>" -> "161616")
and ends the episode with its answer and <eos>. The answer is the text after the last
observation, tags dropped; reward 1 when it is the product, per-turn rewards 0 (so "sum" and
"last" agree). A failing or hanging tool call comes back as "<err>".

The warm start's traces call the tool twice and copy the last value; their observations carry no
loss, as in RL.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from jaxrl_llm.tasks import arithmetic, envs, multiturn, tools
from jaxrl_llm.tasks.arithmetic import BOS, EOS, encode

CALL, END, ERR = arithmetic.VOCAB_SIZE, arithmetic.VOCAB_SIZE + 1, arithmetic.VOCAB_SIZE + 2
VOCAB_SIZE = arithmetic.VOCAB_SIZE + 3
_TEXT = {CALL: "<calc>", END: "</calc>", ERR: "<err>"}


def text(ids: Sequence[int]) -> str:
    """Readable text of ids, tags included (up to <eos>)."""
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(_TEXT.get(int(i), arithmetic.INV_VOCAB.get(int(i), "")))
    return "".join(out)


@dataclasses.dataclass
class ToolArithmetic(arithmetic.Arithmetic):
    digits: int = 2
    ops: str = "*"
    terms: int = 3
    turn: multiturn.TurnConfig = dataclasses.field(default_factory=multiturn.TurnConfig)
    vocab_size = VOCAB_SIZE
    turn_stop_ids = (END,)

    def __post_init__(self):
        super().__post_init__()
        self._envs = multiturn.Environments(self, self.turn)

    def environment(self) -> envs.Environment:
        return self._envs.get()

    def close(self) -> None:
        self._envs.close()

    @property
    def max_answer_len(self) -> int:
        """Tokens of an episode: a call and its value per operator after the first, then the answer."""
        top = 10**self.digits - 1
        value, total = top, 0
        for _ in range(self.terms - 1):
            call = len(str(value)) + 1 + self.digits + 2
            value = value * top if "*" in self.ops else value + top
            total += call + len(str(value)) + ("-" in self.ops)
        return total + len(str(value)) + ("-" in self.ops) + 1

    def supervised(self, rng: np.random.Generator, n: int):
        """(prompt ids, episode ids, loss mask) traces: one calculator call per operator, the
        observation (no loss), then the answer and <eos>."""
        return [self.trace(self.problem(rng)[0]) for _ in range(n)]

    def trace(self, question: str):
        """The warm start's trace of one problem ("37*48*91=")."""
        nums, ops = _operands(question)
        ids, loss, acc = [], [], nums[0]
        for op, b in zip(ops, nums[1:]):
            call = [CALL] + encode(f"{acc}{op}{b}") + [END]
            acc = arithmetic.OPS[op](acc, b)
            obs = encode(str(acc))
            ids += call + obs
            loss += [1.0] * len(call) + [0.0] * len(obs)
        answer = encode(str(acc)) + [EOS]
        return [BOS] + encode(question), ids + answer, loss + [1.0] * len(answer)

    def final_answer(self, episode: Sequence[int], obs: Sequence[bool]) -> str:
        """The text after the last observation (or the whole episode), tags dropped."""
        return arithmetic.decode([t for t in episode[envs.turn_start(obs):] if t not in _TEXT])

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """Single-turn view (no observations): the answer after the last tag."""
        return float(self.final_answer(completion, [False] * len(completion)) == self.answer(prompt))


def _operands(q: str):
    import re

    return [int(x) for x in re.split(r"[-+*]", q.rstrip("="))], re.findall(r"[-+*]", q)


class Calculator:
    """The environment of `ToolArithmetic`: `<calc>expr</calc>` -> the value, computed in the
    sandbox (`runner`: a `sandbox.ToolRunner`)."""

    def __init__(self, task: ToolArithmetic, runner, tool=tools.calculator):
        self.task, self.runner, self.tool = task, runner, tool
        self.stop_ids = (END,)

    def reply(self, prompt, episode, obs) -> Future:
        turn = list(episode[envs.turn_start(obs):])
        start = max((i for i, t in enumerate(turn) if t == CALL), default=None)
        if start is None:  # a closing tag with no call: nothing to run (a call, if a broken one)
            out: Future = Future()
            out.set_result(envs.Reply(obs_ids=(ERR,), tool_calls=1, tool_errors=1))
            return out
        expr = arithmetic.decode([t for t in turn[start + 1:-1] if t not in _TEXT])

        def observe(r):
            ok = r.status == "ok" and set(r.text) <= set(arithmetic.VOCAB)  # a float result has no tokens
            return (encode(r.text) if ok else (ERR,)), r.status == "ok" and not ok

        return envs.tool_reply(self.runner.submit(self.tool, [(expr,)]), observe)

    def final(self, prompt, episode, obs) -> float:
        return float(self.task.final_answer(episode, obs) == self.task.answer(prompt))


@envs.register("calculator")
def _calculator(task, runner):
    return Calculator(task, runner)
