"""Embedded verifiable task: multi-digit arithmetic with a character tokenizer (no download).

Prompt "<bos>37+48=", answer "85<eos>"; reward 1 for an exact match of the completion up to
the first <eos>, else 0 (`reward="digits"`: partial credit, the fraction of answer positions
right, over the longer of answer and completion: a dense signal for tiny models and tests).
Difficulty: number of digits per operand and the operators.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

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

    def __post_init__(self):
        bad = sorted(set(self.ops) - set(OPS))
        if not self.ops or bad:
            raise ValueError(f"unknown operator(s) {bad}; valid: {', '.join(OPS)}")
        if self.digits < 1:
            raise ValueError("digits must be >= 1")
        if self.reward_kind not in ("exact", "digits"):
            raise ValueError(f"unknown task.reward {self.reward_kind!r}; valid: exact, digits")

    eos_id, pad_id, vocab_size = EOS, PAD, VOCAB_SIZE

    @property
    def prompt_buckets(self) -> tuple:
        return (self.max_prompt_len,)

    @property
    def max_prompt_len(self) -> int:
        return 2 * self.digits + 3  # <bos> a op b =

    @property
    def max_answer_len(self) -> int:
        return 2 * self.digits + 2  # product digits (+ sign) + <eos>

    def problem(self, rng: np.random.Generator):
        hi = 10**self.digits
        a, b = int(rng.integers(0, hi)), int(rng.integers(0, hi))
        op = self.ops[int(rng.integers(0, len(self.ops)))]
        return f"{a}{op}{b}=", str(OPS[op](a, b))

    def prompts(self, rng: np.random.Generator, n: int) -> list[list[int]]:
        return [[BOS] + encode(self.problem(rng)[0]) for _ in range(n)]

    def answer(self, prompt: Sequence[int]) -> str:
        text = decode([t for t in prompt if t != BOS])
        for op in OPS:  # operands are non-negative, so the first operator splits them
            if op in text[:-1]:
                a, b = text[:-1].split(op, 1)
                return str(OPS[op](int(a), int(b)))
        raise ValueError(f"not an arithmetic prompt: {text!r}")

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        got, want = decode(completion), self.answer(prompt)
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
            out.append(([BOS] + encode(q), encode(a) + [EOS]))
        return out
