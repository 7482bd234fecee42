"""Weight store: the learner publishes (version, params); samplers fetch them.

Publishing copies the params onto the sampler's placement (its devices / shardings), so the
learner's next donated step cannot invalidate what samplers hold. The newest `keep` versions
are retained: simulated-staleness runs sample from past versions. Each publication's time is
recorded, so samplers can take a version only after a (simulated) network delay.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxrl_llm import distributed, sharding


class WeightStore:
    def __init__(self, keep: int = 1, placement: Optional[Any] = None):
        """`placement`: a Sharding / device (or a pytree of them) for the sampler's copy;
        None keeps the learner's placement (still a private copy)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1; got {keep}")
        self.keep, self.placement = keep, placement
        self._versions: dict[int, Any] = {}
        self._published_at: dict[int, float] = {}  # time.monotonic() of each publication
        self._cond = threading.Condition()
        self._copy = jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p))

    def publish(self, version: int, params) -> None:
        """Every process publishes each version (with many processes the learner's global
        params are first gathered onto this process's devices: a collective)."""
        params = distributed.to_local(params)
        if sharding.shares_host_copy(self.placement):
            copy = sharding.put(params, self.placement)  # already private: one host copy for all devices
        else:
            copy = self._copy(params)
            if self.placement is not None:
                copy = jax.device_put(copy, self.placement)
        with self._cond:
            self._versions[int(version)] = copy
            self._published_at[int(version)] = time.monotonic()
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old], self._published_at[old]
            self._cond.notify_all()

    @property
    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._versions)

    def latest(self):
        """(version, params) of the newest publication."""
        with self._cond:
            if not self._versions:
                raise LookupError("nothing published yet")
            v = max(self._versions)
            return v, self._versions[v]

    def latest_timed(self):
        """(version, params, time.monotonic() of its publication) of the newest publication."""
        with self._cond:
            v, params = self.latest()
            return v, params, self._published_at[v]

    def get(self, version: int):
        with self._cond:
            if version not in self._versions:
                raise LookupError(f"version {version} not retained; available: {sorted(self._versions)} "
                                  f"(raise WeightStore.keep)")
            return self._versions[version]

    def wait_newer(self, version: int, timeout: Optional[float] = None) -> bool:
        """Block until a version > `version` is published; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._versions and max(self._versions) > version, timeout)
