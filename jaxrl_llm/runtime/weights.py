"""Weight store: the learner publishes (version, params); samplers fetch them.

Publishing copies the params onto the sampler's placement (its devices / shardings), so the
learner's next donated step cannot invalidate what samplers hold, and in the sampler's
compute dtype (bfloat16 weights when the model computes in bfloat16: the learner keeps its
float32 master weights, the samplers hold and read half the bytes; every matmul casts to
bfloat16 on both sides anyway). The newest `keep` versions
are retained: simulated-staleness runs sample from past versions. Each publication's time is
recorded, so samplers can take a version only after a (simulated) network delay.

LoRA (`models/lora.py`): the learner publishes its adapters only, with the frozen base; the store
places the base once and keeps, per version, the base merged with that version's adapters
(W + scale B A, in the compute dtype): the samplers' decode step is the base model's, unchanged.
`published_bytes` is what a publication carried (the adapters' bytes under LoRA);
`publication()` returns it (what sampler nodes fetch) and `base()` the frozen base they fetch once.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm.models import lora


class WeightStore:
    def __init__(self, keep: int = 1, placement: Optional[Any] = None, dtype: str = "float32",
                 lora_scale: float = 0.0):
        """`placement`: a Sharding / device (or a pytree of them, or `params -> pytree of them`)
        for the sampler's copy; None keeps the learner's placement (still a private copy).
        `dtype`: of the copy.
        `lora_scale`: alpha / rank, for publications of LoRA adapters."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1; got {keep}")
        self.keep, self.placement, self.dtype = keep, placement, jnp.dtype(dtype)
        self._versions: dict[int, Any] = {}
        self._published_at: dict[int, float] = {}  # time.monotonic() of each publication
        self._cond = threading.Condition()
        cast = lambda x: x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.copy(x)
        self._copy = jax.jit(lambda p: jax.tree_util.tree_map(cast, p))
        self._own = jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p))
        self._merge = jax.jit(lambda base, adapters: lora.merge(base, adapters, lora_scale, self.dtype))
        self._base_of, self._base, self.published_bytes = None, None, 0
        self._device = None  # where LoRA's base is placed, once it is
        self._adapters: dict = {}  # LoRA: version -> the adapters published with it (kept as `_versions`)

    def publish(self, version: int, params, base=None) -> None:
        """Every process publishes each version (with many processes the learner's global
        params are first gathered onto this process's devices: a collective). `base`: with
        LoRA, the frozen weights that `params` (adapters) complete."""
        fresh = base is None and any(x.dtype != self.dtype for x in jax.tree_util.tree_leaves(params))
        if fresh:  # cast where the learner holds them (sharded): only the store's dtype is gathered
            params = self._copy(params)
        params = distributed.to_local(params)
        fresh = fresh or distributed.count() > 1  # a private copy already (cast, or gathered)
        self.published_bytes = lora.size_bytes(params)
        adapters = None
        if base is not None:  # a private copy: the learner donates its state to the next step
            adapters, params = self._own(params), self._merged(params, base)
        placement = self._placement(params)
        if base is not None:  # the merge made a private copy in the store's dtype, on `_device`
            copy = params if placement is None else sharding.put(params, placement)
        elif sharding.shares_host_copy(placement):
            copy = sharding.put(params, placement)  # staged through one host copy for all devices
        else:
            copy = params if fresh else self._copy(params)
            if placement is not None:
                copy = sharding.put(copy, placement)
        with self._cond:
            self._versions[int(version)] = copy
            self._published_at[int(version)] = time.monotonic()
            if adapters is not None:
                self._adapters[int(version)] = adapters
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old], self._published_at[old]
                self._adapters.pop(old, None)
            self._cond.notify_all()

    def _placement(self, params):
        return self.placement(params) if callable(self.placement) else self.placement

    def _merged(self, adapters, base):
        """The base (placed once, on one device) merged with `adapters`."""
        if self._base_of is not base:
            placement = self._placement(base)
            leaf = jax.tree_util.tree_leaves(placement)[0] if placement is not None else None
            device = next(iter(leaf.device_set)) if isinstance(leaf, jax.sharding.Sharding) else \
                leaf or jax.local_devices()[0]
            self._base_of, self._base = base, jax.device_put(distributed.to_local(base), device)
            self._device = device
        return self._merge(self._base, jax.device_put(adapters, self._device))

    def publication(self):
        """(version, what it published) of the newest version: the adapters under LoRA, else
        the samplers' params (what a sampler node fetches per version)."""
        with self._cond:
            v, params = self.latest()
            return v, self._adapters.get(v, params)

    def base(self):
        """LoRA: the frozen base the publications complete (fetched once by sampler nodes)."""
        if self._base is None:
            raise LookupError("this run publishes full weights: there is no separate base")
        return self._base

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
