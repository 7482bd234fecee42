import numpy as np
import pytest
from scipy import stats

from jaxrl_llm.runtime import delay


@pytest.mark.parametrize("kind", ["lognormal", "weibull", "exponential"])
def test_fitted_distribution_quantiles_and_bounds(kind):
    m = delay.make(kind, min=60.0, max=1800.0)
    x = m.sample(np.random.default_rng(0), size=200_000)
    assert x.min() >= 60.0 and x.max() <= 1800.0
    # the unclipped fit puts `coverage` of its mass inside [min, max]
    if kind == "lognormal":
        p = m.params
        ref = stats.lognorm(s=p["sigma"], scale=np.exp(p["mu"]))
        assert ref.cdf(1800) - ref.cdf(60) == pytest.approx(0.995, abs=1e-9)
        assert m.quantile(0.0025) == pytest.approx(60.0) and m.quantile(0.9975) == pytest.approx(1800.0)
    else:
        assert m.quantile(0.995) == pytest.approx(1800.0)
        assert m.quantile(0.0) == pytest.approx(60.0)
    for q in (0.1, 0.5, 0.9):  # empirical quantiles of the clipped draws (inside the bounds)
        assert np.quantile(x, q) == pytest.approx(m.quantile(q), rel=0.02)
    assert np.mean(x >= 1800.0) < 0.006  # at most the ~0.25-0.5% tail is clipped onto max


def test_seeded_and_steps():
    m = delay.make("lognormal", min=60.0, max=1800.0)
    a = m.sample(np.random.default_rng(3), size=5)
    np.testing.assert_array_equal(a, m.sample(np.random.default_rng(3), size=5))
    steps = m.steps(np.random.default_rng(3), step_seconds=60.0, max_staleness=8, size=1000)
    assert steps.min() >= 1 and steps.max() <= 8
    assert delay.make("fixed", value=120.0).steps(np.random.default_rng(0), 60.0, 64) == 2
    assert delay.make("none").sample(np.random.default_rng(0)) == 0.0


def test_bad_delay_options():
    with pytest.raises(ValueError, match="valid: none, fixed, lognormal, weibull, exponential"):
        delay.make("gamma")
    with pytest.raises(ValueError, match="min < max"):
        delay.make("weibull", min=10.0, max=5.0)
    with pytest.raises(ValueError, match="min > 0"):
        delay.make("lognormal", min=0.0, max=5.0)
