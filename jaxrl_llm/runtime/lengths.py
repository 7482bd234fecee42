"""Completion lengths of an async run, generated / trained / dropped, kept as counts per length.

The metrics (token fractions trained and dropped, mean and p90 length of each kind) cover the
whole run. Kept as counts they cost O(longest completion) per learner step; a list of every
row made each step's metrics O(rows so far) (a 3,000-step default run spent more time there
than in the learner by its end).
"""

from __future__ import annotations

import threading

import numpy as np

KINDS = ("generated", "trained", "dropped")


def completion_lengths(batch) -> np.ndarray:
    """Generated tokens of each row."""
    return np.asarray(batch.loss_mask).sum(1).astype(np.int64)


class LengthCounts:
    """Thread-safe: sampler workers add generated rows while the learner adds trained ones."""

    def __init__(self):
        self._counts = {k: np.zeros(1, np.int64) for k in KINDS}
        self._lock = threading.Lock()

    def add(self, kind: str, batch) -> None:
        new = np.bincount(completion_lengths(batch))
        with self._lock:
            old = self._counts[kind]
            grown = np.zeros(max(len(old), len(new)), np.int64)
            grown[:len(old)] += old
            grown[:len(new)] += new
            self._counts[kind] = grown

    def state(self) -> dict:
        with self._lock:
            return {k: c.tolist() for k, c in self._counts.items()}

    def load(self, state: dict) -> None:
        with self._lock:
            self._counts = {k: np.asarray(state[k], np.int64) for k in KINDS}

    def samples(self, kind: str) -> np.ndarray:
        """Every recorded length of `kind`, sorted."""
        c = self._counts[kind]
        return np.repeat(np.arange(len(c)), c)

    def metrics(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
        tokens = {k: float(np.arange(len(c)) @ c) for k, c in counts.items()}
        m = {f"runtime/tokens_{k}_frac": tokens[k] / max(1.0, tokens["generated"]) for k in ("trained", "dropped")}
        for k, c in counts.items():
            n = int(c.sum())
            m[f"runtime/length_{k}_mean"] = tokens[k] / n if n else 0.0
            m[f"runtime/length_{k}_p90"] = _percentile(c, n, 0.9) if n else 0.0
        return m


def _percentile(counts: np.ndarray, n: int, q: float) -> float:
    """np.percentile(samples, 100 q) (linear interpolation) from counts per value."""
    h = q * (n - 1)
    lo = int(np.floor(h))
    ends = np.cumsum(counts)  # the sorted samples at positions [ends[v-1], ends[v]) equal v
    at = lambda i: float(np.searchsorted(ends, i, side="right"))  # noqa: E731
    return at(lo) if lo + 1 >= n else at(lo) + (h - lo) * (at(lo + 1) - at(lo))
