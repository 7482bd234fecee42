"""How a sampler lays out its devices (`Sampler`): rows split over them (data parallel), a
mixture's stacked experts split over the rows' devices (`SamplerConfig.expert_parallel`,
`experts.among_devices`), and with `SamplerConfig.tensor` = T > 1 tensor parallelism: the devices
form a (data, tensor) grid, and within each group of T devices every attention layer's heads (and
KV heads, and so the KV cache), every dense MLP's width and the vocabulary are split T ways, as
the learner's `tensor` axis splits them (`parallel.sharding.DEFAULT_RULES`). A model too large
for one device's memory then samples on T of them.

The sampler's `shard_map` is manual over the row axes only (`decode.per_device`); XLA partitions
the tensor axis from the weights' shardings (GSPMD), inserting the reductions of Megatron-style
tensor parallelism, so the decoder's code is the same on every layout. A mixture's stacked
experts split over the row devices on E (`experts.among_devices` exchanges the tokens) and over
tensor along their width; its routers stay whole (every token's top k is over all E).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm.models import decoder, experts
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.parallel import sharding

TENSOR = "tensor"


def grid(mesh, tensor: int):
    """(mesh, row axes): the sampler's devices as (data, tensor) when `tensor` > 1, else as given."""
    if tensor == 1:
        return mesh, mesh and tuple(mesh.axis_names)
    check_tensor(1 if mesh is None else mesh.size, tensor)
    return Mesh(np.asarray(mesh.devices).reshape(-1, tensor), ("data", TENSOR)), ("data",)


def check_tensor(devices: int, tensor: int) -> None:
    """`sampler.tensor` must divide the sampler's devices: refused naming the sizes that do."""
    if devices % tensor:
        raise ValueError(f"sampler.tensor={tensor} must divide the sampler's devices ({devices}): set "
                         f"--config.sampler.tensor to one of {[t for t in range(1, devices + 1) if devices % t == 0]}")


def row_devices(mesh) -> int:
    """How many devices the rows split over (each runs its own rows)."""
    return 1 if mesh is None else mesh.size // dict(mesh.shape).get(TENSOR, 1)


def _split_names(cfg: ModelConfig, tensor: int) -> set:
    """The logical axes split over `tensor`: those the learner's rules map to it, where it divides them."""
    mlp = cfg.intermediate_size if cfg.shared_expert_intermediate_size % tensor == 0 else 1  # both MLPs' width
    sizes = dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, mlp=mlp, vocab=cfg.vocab_size)
    return {name for name, axis in sharding.DEFAULT_RULES
            if axis == TENSOR and sizes.get(name, 0) % tensor == 0 and name in sizes}


@functools.lru_cache(maxsize=8)
def _logical_axes(cfg: ModelConfig):
    """The model's logical axes, traced once per model (the weight store asks on every publish)."""
    return decoder.logical_axes(cfg)


def specs(cfg: ModelConfig, params, mesh, rows, split_experts: bool):
    """PartitionSpecs of `params` on the sampler's mesh: stacked experts split on E over the row
    axes (`split_experts`), with a tensor axis the heads / MLP / vocab dims over it, the rest
    replicated."""
    tensor = 1 if mesh is None else dict(mesh.shape).get(TENSOR, 1)
    ex = experts.expert_specs(params, rows) if split_experts else jax.tree.map(lambda _: P(), params)
    if tensor == 1:
        return ex
    split = _split_names(cfg, tensor)
    width = cfg.moe_intermediate_size % tensor == 0
    logical = _logical_axes(cfg)

    def spec(path, e, names):
        names = tuple(names)
        if "expert" in names:  # stacked experts: E over the row devices (or whole), their width over tensor
            return P(*(e[0] if e and i == 0 else TENSOR if name == "mlp" and width else None
                       for i, name in enumerate(names)))
        return P(*(TENSOR if name in split else None for name in names))

    return jax.tree_util.tree_map_with_path(spec, ex, logical, is_leaf=lambda x: isinstance(x, P))


def manual(rows, params_specs):
    """`specs` as a `shard_map` manual over the row axes reads them: the tensor axis left to XLA."""
    def keep(a):
        return a if a is not None and all(n in rows for n in (a if isinstance(a, tuple) else (a,))) else None

    return jax.tree.map(lambda s: P(*map(keep, s)), params_specs, is_leaf=lambda x: isinstance(x, P))


def shardings(mesh, params_specs):
    """A NamedSharding per leaf: where the weight store publishes and `Sampler.place_params` puts them."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), params_specs, is_leaf=lambda x: isinstance(x, P))
