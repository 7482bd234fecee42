"""The rollout backend interface: what the producer, evaluation, warm start, multi-turn
generation and sampler nodes use of a sampler, and the backends registered by name.

A backend turns prompts into a version-tagged `TrajectoryBatch` (`generate`; static batches,
multi-turn episodes through `turns`, mid-generation weight swaps through `refresh`) and, for
continuous batching, streams rows through decode slots (`slots(rows).stream`). It records each
drawn token's log-prob, top-K and version, as the batch contract asks (`to_batch` builds one
from its outputs). The JAX sampler is `"jax"`; another (an HTTP-served or vLLM-style engine)
is one module that implements `RolloutBackend` and calls `register(name, factory)`, chosen with
`sampler.backend=name`. Tunix's `rollout/base_rollout.py` is the same idea.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout.sampling import SamplerConfig


class SlotStream(Protocol):
    """Continuous batching (`SlotEngine`): rows fed in as slots free up, finished rows out."""

    def row_keys(self, key, ids) -> np.ndarray:
        """Each row's own key data (its draws depend on the key and its id alone)."""

    def stream(self, params, p: int, version: int, feed: Callable, refresh=None, stop=None,
               turns=None) -> Iterator[tuple[np.ndarray, dict]]:
        """`(ids, outputs)` of the rows finished at each boundary (`SlotEngine.stream`)."""

    def outputs(self, got: dict) -> dict:
        """Streamed outputs -> the static output dict `to_batch` takes."""


@runtime_checkable
class RolloutBackend(Protocol):
    model_cfg: ModelConfig
    cfg: SamplerConfig
    reprefill: dict  # turn_cache="recompute": rows resumed, tokens re-scored, |log-prob gap| sum and max

    def generate(self, params, prompts: Sequence[Sequence[int]], key, version: int = 0, refresh=None, limits=None,
                 turns=None) -> TrajectoryBatch:
        """G samples of every prompt (rows as `pad_prompts` lays them out)."""

    def slots(self, rows: int) -> SlotStream:
        """The continuous-batching engine (`cfg.batching == "continuous"`)."""

    def bucket(self, length: int) -> int:
        """The prompt width a prompt of `length` tokens is padded to."""

    def pad_prompts(self, prompts: Sequence[Sequence[int]], width: Optional[int] = None):
        """(tokens, mask, group ids): prompts left-padded to a bucket, each repeated G times."""

    def place_params(self, params):
        """`params` where this backend decodes from (e.g. onto its devices)."""


_BACKENDS: dict[str, Callable] = {}


def register(name: str, factory: Callable) -> None:
    """`factory(model_cfg, sampler_cfg, mesh) -> RolloutBackend`, chosen by `sampler.backend=name`."""
    _BACKENDS[name] = factory


def names() -> list[str]:
    return sorted(_BACKENDS)


def make(model_cfg: ModelConfig, cfg: SamplerConfig, mesh=None) -> RolloutBackend:
    """The backend `cfg.backend` names, for `model_cfg` on `mesh`."""
    if cfg.backend not in _BACKENDS:
        raise ValueError(f"unknown sampler.backend {cfg.backend!r}; registered: {', '.join(names())}")
    return _BACKENDS[cfg.backend](model_cfg, cfg, mesh)


def _jax(model_cfg, cfg, mesh):
    from jaxrl_llm.rollout.sampler import Sampler

    return Sampler(model_cfg, cfg, mesh)


register("jax", _jax)
