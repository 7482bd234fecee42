"""Network-delay models (HeteroRL / GEPO, arXiv:2508.17850, §4.1), seeded and bounded.

A delay governs when a sampler sees a new policy version: seconds in real asynchronous runs,
learner steps in simulated runs. The paper draws delays from a log-normal bounded to
[min, max] with a 99.5% interval (60 s .. 1800 s), and also uses Weibull and exponential
delays. Here every distribution is fitted so that [min, max] holds `coverage` (0.995) of
its mass, and draws are clipped into [min, max]:

  lognormal    ln X ~ N(mu, sigma): the central `coverage` interval is exactly [min, max]
  weibull      X = min + lam W, W ~ Weibull(shape): P(X <= max) = coverage
  exponential  X = min + E, E ~ Exp(rate):           P(X <= max) = coverage
  fixed        X = value;  none: X = 0
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import numpy as np

KINDS = ("none", "fixed", "lognormal", "weibull", "exponential")


@dataclasses.dataclass(frozen=True)
class DelayModel:
    kind: str = "none"
    min: float = 60.0
    max: float = 1800.0
    value: float = 60.0  # for kind="fixed"
    weibull_shape: float = 1.5
    coverage: float = 0.995

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown delay model {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.kind in ("lognormal", "weibull", "exponential"):
            if not 0 <= self.min < self.max:
                raise ValueError(f"delay bounds need 0 <= min < max; got min={self.min}, max={self.max}")
            if self.kind == "lognormal" and self.min <= 0:
                raise ValueError("a log-normal delay needs min > 0")
        if not 0 < self.coverage < 1:
            raise ValueError(f"coverage must be in (0, 1); got {self.coverage}")
        if self.kind == "fixed" and self.value < 0:
            raise ValueError(f"fixed delay must be >= 0; got {self.value}")

    # Distribution parameters (unclipped) ------------------------------------------------
    @property
    def params(self) -> dict:
        if self.kind == "lognormal":
            z = NormalDist().inv_cdf(0.5 + self.coverage / 2)
            lo, hi = math.log(self.min), math.log(self.max)
            return {"mu": (lo + hi) / 2, "sigma": (hi - lo) / (2 * z)}
        if self.kind == "weibull":
            return {"scale": (self.max - self.min) / (-math.log(1 - self.coverage)) ** (1 / self.weibull_shape)}
        if self.kind == "exponential":
            return {"rate": -math.log(1 - self.coverage) / (self.max - self.min)}
        return {}

    def quantile(self, q: float) -> float:
        """Quantile of the unclipped fitted distribution (for checks and plots)."""
        p = self.params
        if self.kind == "lognormal":
            return math.exp(p["mu"] + p["sigma"] * NormalDist().inv_cdf(q))
        if self.kind == "weibull":
            return self.min + p["scale"] * (-math.log(1 - q)) ** (1 / self.weibull_shape)
        if self.kind == "exponential":
            return self.min - math.log(1 - q) / p["rate"]
        return self.value if self.kind == "fixed" else 0.0

    def sample(self, rng: np.random.Generator, size=None):
        """Draw delay(s), clipped into [min, max]."""
        p = self.params
        if self.kind == "none":
            return np.zeros(size) if size is not None else 0.0
        if self.kind == "fixed":
            return np.full(size, self.value) if size is not None else float(self.value)
        if self.kind == "lognormal":
            x = rng.lognormal(p["mu"], p["sigma"], size)
        elif self.kind == "weibull":
            x = self.min + p["scale"] * rng.weibull(self.weibull_shape, size)
        else:
            x = self.min + rng.exponential(1.0 / p["rate"], size)
        x = np.clip(x, self.min, self.max)
        return x if size is not None else float(x)

    def steps(self, rng: np.random.Generator, step_seconds: float, max_staleness: int, size=None):
        """A delay expressed in learner steps (simulated mode): ceil(delay / step_seconds),
        capped at max_staleness."""
        d = np.ceil(np.asarray(self.sample(rng, size)) / step_seconds).astype(int)
        d = np.minimum(d, max_staleness)
        return d if size is not None else int(d)


def make(kind: str = "none", **kw) -> DelayModel:
    return DelayModel(kind=kind, **kw)
