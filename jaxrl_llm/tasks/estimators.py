"""Estimators over `n` samples per problem: pass@k, maj@k and response statistics.

pass@k is the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, eq. 1): with `c` of `n`
samples correct, the chance that a uniformly drawn k-subset holds at least one correct sample,
1 - C(n-c, k) / C(n, k), computed as their numerically stable product (their Figure 3).

maj@k is the same expectation for a majority vote: over uniformly drawn k-subsets, the vote of
the subset's extracted answers (samples with no answer do not vote) is correct when its answer
is. A tie between t answers counts as the fraction of them that is correct (a uniform tie-break,
in expectation). Subsets are enumerated when there are at most `ENUMERATE` of them, else
`resamples` are drawn with a seeded generator. With n = k this is the plain majority vote.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Optional, Sequence

import numpy as np

ENUMERATE = 4096  # k-subsets enumerated exactly up to this many


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): at least one of k samples (drawn without replacement from n,
    c of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def vote(answers: Sequence[Optional[str]], correct: dict) -> float:
    """The majority vote of `answers` (None: no answer, no vote), scored by `correct[answer]`;
    a tie scores the fraction of the tied answers that are correct; no answer at all scores 0."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    tied = [a for a, m in counts.items() if m == top]
    return sum(bool(correct[a]) for a in tied) / len(tied)


def maj_at_k(answers: Sequence[Optional[str]], correct: dict, k: int, rng: Optional[np.random.Generator] = None,
             resamples: int = 1024) -> float:
    """The expected majority-vote score of a uniformly drawn k-subset of `answers`."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n; got n={n}, k={k}")
    if math.comb(n, k) <= ENUMERATE:
        subsets = itertools.combinations(range(n), k)
    else:
        rng = rng if rng is not None else np.random.default_rng(0)
        subsets = (rng.choice(n, k, replace=False) for _ in range(resamples))
    scores = [vote([answers[i] for i in s], correct) for s in subsets]
    return float(np.mean(scores))


def answer_correct(answers: Sequence[Optional[str]], success: Sequence[bool]) -> dict:
    """answer -> whether any sample that gave it succeeded (equal final answers score alike:
    the reward is a function of the answer for the tasks that extract one)."""
    out: dict = {}
    for a, s in zip(answers, success):
        if a is not None:
            out[a] = out.get(a, False) or bool(s)
    return out


def lengths(tokens_PxN: np.ndarray, truncated_PxN: np.ndarray) -> dict:
    """Response length statistics (generated tokens) and the truncation rate."""
    t = np.asarray(tokens_PxN, np.float64).ravel()
    return {"length/mean": float(t.mean()), "length/p50": float(np.percentile(t, 50)),
            "length/p90": float(np.percentile(t, 90)), "length/max": float(t.max()),
            "truncated": float(np.mean(truncated_PxN))}


def summarise(rewards_PxN: np.ndarray, success_PxN: np.ndarray, ks: Sequence[int], answers=None,
              seed: int = 0) -> dict:
    """Mean reward, pass@k and (with `answers`, a list per problem) maj@k for every k <= n."""
    p, n = rewards_PxN.shape
    out = {"reward": float(np.mean(rewards_PxN)), "problems": p, "samples_per_problem": n}
    c = np.asarray(success_PxN, bool).sum(1)
    for k in (k for k in ks if k <= n):
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(ci), k) for ci in c]))
    if answers is not None:
        rng = np.random.default_rng(seed)
        for k in (k for k in ks if k <= n):
            out[f"maj@{k}"] = float(np.mean([maj_at_k(a, answer_correct(a, s), k, rng)
                                             for a, s in zip(answers, success_PxN)]))
        out["answered"] = float(np.mean([[x is not None for x in a] for a in answers]))
    return out
