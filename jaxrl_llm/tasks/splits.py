"""The held-out part of a training split, and what is said of a dataset's evaluation set.

An evaluation on the training split would report training figures as held-out ones, so a dataset
without the evaluation split is refused, naming the splits it has and the two ways out: another
`task.eval_split`, or `task.eval_holdout`, a fraction of the training split held out. The
held-out rows are a seeded draw (`task.eval_holdout_seed`), so every run of a sweep, a resumed
run and a sampler node hold out the same problems; the run records them in its workdir.
"""

from __future__ import annotations

import numpy as np


def holdout_rows(n: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted rows of an `n`-row split held out: round(fraction * n), at least 1 and at most
    n - 1, drawn without replacement with `seed`."""
    if n < 2:
        raise ValueError(f"task.eval_holdout: the training split has {n} row(s); holding out needs at least 2")
    k = min(max(1, round(fraction * n)), n - 1)
    return np.sort(np.random.default_rng([seed, 0xE7A1]).permutation(n)[:k])


def missing(path: str, split: str, eval_split: str, found: list) -> str:
    """The refusal for a dataset without `eval_split` (`found`: the splits it has)."""
    return (f"task.path={path!r} has no {eval_split!r} split to evaluate on (splits found: "
            f"{', '.join(found) or 'none'}); set --config.task.eval_split to one of them, or hold out a "
            f"fraction of {split!r} with --config.task.eval_holdout=0.05 (disjoint, seeded, recorded in the workdir)")


def describe(eval_set: dict) -> str:
    """One line for records and logs: which split, held out how."""
    if eval_set.get("holdout"):
        return (f"{eval_set['split']}, {len(eval_set['rows'])} rows held out "
                f"({eval_set['holdout']:g} with seed {eval_set['seed']})")
    return eval_set["split"]
