"""Scoring throughput: math-verify checks per second with 1 and N worker processes, and the
in-process fast path (not a test).

    python experiments/bench_scoring.py [--workers 2] [--groups 64] [--group_size 8] [--json out.json]

A batch of `--groups` prompt groups of `--group_size` completions shaped like a model's (LaTeX
fractions and expressions in \\boxed{}, words with numbers), each group one job, as a sampler
hands them over. Every completion needs sympy (none takes the fast path), so the figure is the
checker's. `workers_speedup` is N workers' samples/s over one worker's, measured in the same
run; the limit is min(N, cores). `fast_path_us` is the cost of a sample the fast path decides.

The start-up check of gold answers (`tasks/gold.py`): `gold_check_s_per_10k_*` is the wall time
of `gold.unparsed` over 10,000 gold answers with `--workers` processes (their start included):
GSM8K-shaped (integers after '####'), MATH-shaped (solutions ending in a \\boxed{} integer,
fraction, root or power) and, the worst case, bare LaTeX answers with no \\boxed{} (fractions,
roots, powers: each one parsed by math-verify, which reads LaTeX only in math mode, so most are
reported unparsed: `gold_check_unparsed_*`); the limit is 2 s per 10,000 (`gold_check_limit_s`).
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402

from jaxrl_llm.tasks import gold, math_dataset  # noqa: E402
from jaxrl_llm.tasks.pool import WorkerPool  # noqa: E402


def batch(groups: int, size: int, seed: int = 0):
    """[(group of (completion, gold))]: golds are fractions, decimals and expressions."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        a, b = rng.randint(1, 40), rng.randint(2, 40)
        gold = rng.choice([f"\\frac{{{a}}}{{{b}}}", f"{a}.{b}", f"{a}\\sqrt{{{b}}}", f"x^{{{a % 5 + 1}}}"])
        answers = [gold, f"\\frac{{{2 * a}}}{{{2 * b}}}", f"{a + 1}/{b}", f"{a} + {b}", f"{a}.{b + 1}", gold]
        out.append([(f"We compute step by step: {a} and {b} give {rng.randint(1, 99)}. "
                     f"So the answer is $\\boxed{{{rng.choice(answers)}}}$.", gold) for _ in range(size)])
    return out


def rate(workers: int, jobs, repeats: int) -> float:
    pool = WorkerPool(workers, timeout=30.0, preload=("math_verify",))
    pool.map(math_dataset.score, jobs[0])  # workers started and the checker loaded before the clock
    for _ in range(workers):
        pool.map(math_dataset.score, jobs[0])
    best = float("inf")
    for _ in range(repeats):
        math_dataset._parsed_gold.cache_clear()
        t = time.perf_counter()
        futures = [pool.submit(math_dataset.score, job) for job in jobs]
        for f in futures:
            f.result()
        best = min(best, time.perf_counter() - t)
    pool.close()
    return sum(map(len, jobs)) / best


def gold_check_s(workers: int, seed: int = 0) -> dict:
    """Seconds to check 10,000 gold answers at start-up, GSM8K- and MATH-shaped."""
    rng = random.Random(seed)
    gsm8k = [math_dataset.gold_answer(f"So she has {n} left.\n#### {n:,}") for n in
             (rng.randint(0, 10**6) for _ in range(10_000))]
    forms = ["\\frac{{{a}}}{{{b}}}", "{a}\\sqrt{{{b}}}", "x^{{{b}}}", "{a}"]
    latex = [rng.choice(forms).format(a=rng.randint(1, 40), b=rng.randint(2, 40)) for _ in range(10_000)]
    math = [math_dataset.gold_answer(f"We find ... so the answer is $\\boxed{{{x}}}$.") for x in latex]
    out = {}
    for name, golds in (("gsm8k", gsm8k), ("math", math), ("unboxed", latex)):
        t = time.perf_counter()
        bad = gold.unparsed(golds, workers)
        out[f"gold_check_s_per_10k_{name}"] = time.perf_counter() - t
        out[f"gold_check_unparsed_{name}"] = len(bad)
    return out


def main():
    a = common.parse_args(__doc__.splitlines()[0], extra=lambda ap: (
        ap.add_argument("--workers", type=int, default=2), ap.add_argument("--groups", type=int, default=64),
        ap.add_argument("--group_size", type=int, default=8)))
    jobs = batch(a.groups, a.group_size)
    checks = gold_check_s(a.workers)
    one = rate(1, jobs, a.repeats)
    many = rate(a.workers, jobs, a.repeats)
    texts = [(f"{i}", math_dataset.gold_int(str(i % 7))) for i in range(20000)]
    t = time.perf_counter()
    for text, answer in texts:
        math_dataset.fast_score(text, answer)
    fast_us = (time.perf_counter() - t) / len(texts) * 1e6
    common.report({**common.cpu_kind(), "cores": os.cpu_count(), "samples": sum(map(len, jobs)),
                   "samples_per_s_1_worker": one, f"samples_per_s_{a.workers}_workers": many,
                   "workers_speedup": many / one, "workers_speedup_limit": min(a.workers, os.cpu_count() or 1),
                   "fast_path_us": fast_us, "math_verify_us": 1e6 / one, **checks, "gold_check_limit_s": 2.0,
                   "gold_check_fraction_of_limit_unboxed": checks["gold_check_s_per_10k_unboxed"] / 2.0}, a.json)


if __name__ == "__main__":
    main()
