"""Gold answers the answer extractor cannot parse, found at start-up.

A problem whose gold answer math-verify cannot parse scores 0 for every sample (the comparison
falls back to an exact match of the whole text), so a dataset whose answers are in a format the
extractor does not know trains on zero advantages for its full length. `unparsed` finds them:
plain numbers (an integer, a decimal, a fraction) and answers with a non-empty \\boxed{} (which
math-verify always returns, as an expression or at least as its text) are decided here; the
rest are parsed by math-verify itself in worker processes with a per-item timeout (a gold answer
whose parse overruns counts as unparsed: scoring it would overrun too).
"""

from __future__ import annotations

import re
from typing import Sequence

_PLAIN = re.compile(r"\s*-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?\s*")
_BOXED = re.compile(r"\\boxed\{\s*[^\s}]")


def plain(gold: str) -> bool:
    """Whether math-verify parses `gold` for certain: a number, or a non-empty \\boxed{}."""
    return bool(_PLAIN.fullmatch(gold)) or bool(_BOXED.search(gold))


def parses(gold: str) -> bool:
    """math-verify finds an answer in `gold` (runs in a worker process; timeouts from outside)."""
    from math_verify import parse

    return bool(parse(gold, parsing_timeout=None))


def unparsed(golds: Sequence[str], workers: int = 1, timeout: float = 5.0) -> list[int]:
    """Indices of the gold answers that nothing can parse, in order."""
    rest = [i for i, g in enumerate(golds) if not plain(g)]
    if not rest:
        return []
    from jaxrl_llm.tasks.pool import WorkerPool

    pool = WorkerPool(min(workers, len(rest)), timeout=timeout, default=False, preload=("math_verify",),
                      warmup=(parses, ("\\boxed{\\frac{1}{2}}",)))
    try:
        size = -(-len(rest) // pool.workers)  # one job per worker
        jobs = [pool.submit(parses, [(golds[i],) for i in rest[k:k + size]]) for k in range(0, len(rest), size)]
        ok = [value for job in jobs for value, _ in job.result()]
    finally:
        pool.close()
    return [i for i, good in zip(rest, ok) if not good]
