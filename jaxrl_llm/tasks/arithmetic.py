"""Embedded verifiable task: multi-digit arithmetic with a character tokenizer (no download).

Prompt "<bos>37+48=", answer "85<eos>"; reward 1 for an exact match of the completion up to
the first <eos>, else 0 (`reward="digits"`: partial credit, the fraction of answer positions
right, over the longer of answer and completion: a dense signal for tiny models and tests).

Difficulty knobs: `digits` per operand, the operators `ops`, the number of operands `terms`
(evaluated left to right, like a calculator: 2+3*4 = 20), and `scratchpad`: the warm start's
answers then write every running result before the final one ("12+34+56=" -> "46=102"), so
the completion is longer, and the reward grades the text after the completion's last "=" (the
scratchpad itself is not graded).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

import numpy as np

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+-*="
VOCAB = {c: i + 3 for i, c in enumerate(_CHARS)}
INV_VOCAB = {i: c for c, i in VOCAB.items()}
VOCAB_SIZE = 3 + len(_CHARS)
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def encode(text: str) -> list[int]:
    bad = sorted(set(text) - set(_CHARS))
    if bad:
        raise ValueError(f"characters {bad} are not in the arithmetic vocabulary {_CHARS!r}")
    return [VOCAB[c] for c in text]


def decode(ids: Sequence[int]) -> str:
    """Text up to the first <eos>; special tokens dropped."""
    out = []
    for i in ids:
        if i == EOS:
            break
        if i in INV_VOCAB:
            out.append(INV_VOCAB[i])
    return "".join(out)


@dataclasses.dataclass
class Arithmetic:
    digits: int = 2
    ops: str = "+"
    eval_size: int = 64
    eval_seed: int = 12345
    reward_kind: str = "exact"  # exact | digits
    terms: int = 2
    scratchpad: bool = False
    reward_range = (0.0, 1.0)  # every reward a sample can get (a node's upload is checked against it)

    def __post_init__(self):
        bad = sorted(set(self.ops) - set(OPS))
        if not self.ops or bad:
            raise ValueError(f"unknown operator(s) {bad}; valid: {', '.join(OPS)}")
        if self.digits < 1 or self.terms < 2:
            raise ValueError(f"task.digits must be >= 1 and task.terms >= 2 (got {self.digits}, {self.terms})")
        if self.reward_kind not in ("exact", "digits"):
            raise ValueError(f"unknown task.reward {self.reward_kind!r}; valid: exact, digits")

    eos_id, pad_id, vocab_size = EOS, PAD, VOCAB_SIZE

    @property
    def eval_set(self) -> dict:
        """What evaluation runs on (the run records it): `eval_size` problems drawn with `eval_seed`."""
        return {"split": f"generated (seed {self.eval_seed})"}

    @property
    def prompt_buckets(self) -> tuple:
        return (self.max_prompt_len,)

    @property
    def max_prompt_len(self) -> int:
        return 1 + self.terms * (self.digits + 1)  # <bos>, operands, operators and "="

    @property
    def max_answer_len(self) -> int:
        """Characters of the longest running results (a sign where "-" is an operator), "=" or <eos> after each."""
        top, lens = 10**self.digits - 1, []
        bound = top
        for _ in range(self.terms - 1):
            bound = max(bound * top if "*" in self.ops else 0, bound + top)
            lens.append(len(str(bound)) + ("-" in self.ops) + 1)
        return sum(lens) if self.scratchpad else lens[-1]

    def problem(self, rng: np.random.Generator):
        """(prompt text, expected completion text): the answer, after the running results with a scratchpad."""
        hi = 10**self.digits
        nums = [int(rng.integers(0, hi)) for _ in range(self.terms)]
        ops = [self.ops[int(rng.integers(0, len(self.ops)))] for _ in range(self.terms - 1)]
        text = str(nums[0]) + "".join(op + str(n) for op, n in zip(ops, nums[1:])) + "="
        running = self._running(nums, ops)
        return text, "=".join(running if self.scratchpad else running[-1:])

    @staticmethod
    def _running(nums, ops) -> list[str]:
        out, acc = [], nums[0]
        for op, n in zip(ops, nums[1:]):
            acc = OPS[op](acc, n)
            out.append(str(acc))
        return out

    def prompts(self, rng: np.random.Generator, n: int) -> list[list[int]]:
        return [[BOS] + encode(self.problem(rng)[0]) for _ in range(n)]

    def answer(self, prompt: Sequence[int]) -> str:
        text = decode([t for t in prompt if t != BOS])
        parts = re.fullmatch(r"(\d+(?:[-+*]\d+)+)=", text)  # operands are non-negative
        if not parts:
            raise ValueError(f"not an arithmetic prompt: {text!r}")
        nums, ops = re.split(r"[-+*]", parts[1]), re.findall(r"[-+*]", parts[1])
        return self._running([int(n) for n in nums], ops)[-1]

    def final_answer(self, completion: Sequence[int]) -> Optional[str]:
        """The answer a completion gives (maj@k votes on it; the exact reward compares it): its
        text, with a scratchpad the last running result; None when it says nothing."""
        got = decode(completion)
        return (got.rsplit("=", 1)[-1] if self.scratchpad else got) or None

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        got, want = self.final_answer(completion) or "", self.answer(prompt)
        if self.reward_kind == "exact":
            return float(got == want)
        return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))

    def eval_prompts(self) -> list[list[int]]:
        """A fixed held-out set (its own seed, disjoint from training draws in practice)."""
        return self.prompts(np.random.default_rng(self.eval_seed), self.eval_size)

    def supervised(self, rng: np.random.Generator, n: int):
        """(prompt ids, answer ids + <eos>) pairs for warm-starting."""
        out = []
        for _ in range(n):
            q, a = self.problem(rng)
            out.append(([BOS] + encode(q), encode(a) + [EOS]))  # with a scratchpad, a holds the running results
        return out
