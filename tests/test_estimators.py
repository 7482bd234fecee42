"""pass@k against a NumPy restatement of Chen et al.'s estimator and a brute-force enumeration of
k-subsets; maj@k by hand on a constructed case, and its sampled estimate against enumeration."""

import itertools
import math

import numpy as np
import pytest

from jaxrl_llm.tasks import estimators as E


def _brute_pass(n, c, k):
    correct = [i < c for i in range(n)]
    subsets = list(itertools.combinations(range(n), k))
    return np.mean([any(correct[i] for i in s) for s in subsets])


def test_pass_at_k_equals_enumeration_and_the_closed_form():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got = E.pass_at_k(n, c, k)
                assert got == pytest.approx(_brute_pass(n, c, k), abs=1e-12), (n, c, k)
                assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    # large n: the product form stays finite where the binomials are astronomically large
    assert E.pass_at_k(1000, 3, 100) == pytest.approx(1 - math.comb(997, 100) / math.comb(1000, 100), rel=1e-9)
    assert E.pass_at_k(10, 10, 1) == 1.0 and E.pass_at_k(10, 0, 10) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        E.pass_at_k(4, 1, 5)


def test_maj_at_k_by_hand():
    answers, correct = ["3", "3", "5", None], {"3": True, "5": False}
    assert E.maj_at_k(answers, correct, 4) == 1.0  # 3 wins 2-1
    assert E.maj_at_k(answers, correct, 1) == 0.5  # 3, 3, 5, none
    # pairs: (3,3)=1 (3,5)=tie .5 (3,-)=1 (3,5)=.5 (3,-)=1 (5,-)=0 -> 4/6
    assert E.maj_at_k(answers, correct, 2) == pytest.approx(4 / 6)
    # triples: (3,3,5)=1 (3,3,-)=1 (3,5,-)=.5 (3,5,-)=.5 -> 3/4
    assert E.maj_at_k(answers, correct, 3) == pytest.approx(0.75)
    assert E.vote([None, None], {}) == 0.0
    assert E.vote(["a", "b", "c"], {"a": True, "b": False, "c": True}) == pytest.approx(2 / 3)
    assert E.answer_correct(["7", "7", "8"], [False, True, False]) == {"7": True, "8": False}


def test_maj_at_k_resampled_where_enumeration_is_too_long():
    rng = np.random.default_rng(1)
    answers = [str(a) for a in rng.integers(0, 3, 16)]
    correct = {"0": True, "1": False, "2": False}
    k = 8
    assert math.comb(16, k) > E.ENUMERATE
    exact = np.mean([E.vote([answers[i] for i in s], correct) for s in itertools.combinations(range(16), k)])
    got = E.maj_at_k(answers, correct, k, np.random.default_rng(0), resamples=2048)
    assert abs(got - exact) < 0.04, (got, exact)  # 4 standard errors of 2048 draws of a [0, 1] score


def test_summarise_and_lengths():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.5]])
    ok = rewards >= 1.0
    answers = [["4", "5", "6", "4"], [None, "1", "1", "2"], ["9", "9", "9", "8"]]
    r = E.summarise(rewards, ok, (1, 2, 4, 8), answers)
    assert r["reward"] == pytest.approx(rewards.mean()) and r["pass@1"] == pytest.approx(ok.mean())
    assert r["pass@4"] == pytest.approx(2 / 3) and "pass@8" not in r and "maj@8" not in r
    assert r["maj@4"] == pytest.approx((1 + 0 + 1) / 3) and r["answered"] == pytest.approx(11 / 12)
    s = E.lengths(np.array([[1, 2], [3, 10]]), np.array([[False, False], [False, True]]))
    assert s == {"length/mean": 4.0, "length/p50": 2.5, "length/p90": pytest.approx(7.9), "length/max": 10.0,
                 "truncated": 0.25}
