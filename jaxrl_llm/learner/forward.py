"""The learner's policy forward in its three layouts, as pure functions of a static `Forward`.

  padded  -> the batch's own [B, L] rows (`heads.sequence_logprobs`);
  packed  -> several rows per packed row (`packing.PackLayout`, one minibatch's), results
             scattered back to [B, L] so objectives always see the padded layout;
  replica -> `params` holds one copy per batch shard ([S, ...], `minibatches.replica_value_and_grad`);
             shard s's rows use copy s, so each gradient stays on its shard until one all-reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.learner import minibatches, packing
from jaxrl_llm.parallel import sharding
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.models import attention, heads, lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist


@dataclasses.dataclass(frozen=True)
class Forward:
    """What a forward needs besides params and batch: the model, the distribution the
    sampler drew from, the log-prob chunk and the learner's mesh."""

    model_cfg: ModelConfig
    dist: PolicyDist
    chunk: int
    mesh: Mesh

    @property
    def on_shards(self) -> NamedSharding:
        """Rows split over the mesh's batch axes."""
        return NamedSharding(self.mesh, P(sharding.BATCH_AXES))


def stats(fwd: Forward, params, batch: TrajectoryBatch, topk: int = 0, gather: bool = True,
          return_hidden: bool = False, packed: Optional[packing.PackLayout] = None, replicas: int = 0,
          base=None, balance: bool = False) -> dict:
    """Per-token stats (`heads.sequence_logprobs`) in the padded [B, L] layout. `gather`: also
    the policy's log-probs at the behaviour top-K ids; `topk`: the policy's own top-K. `base`:
    with LoRA, the frozen weights the adapters `params` complete (one copy, also under replicas).
    `balance`: also `moe_aux_loss`, the load-balancing loss (a scalar; per replica under replicas)."""
    gather_ids = batch.topk_ids if gather and batch.topk > 0 else None
    full = (lambda p: p) if base is None else (lambda p: lora.combine(base, p))  # noqa: E731
    kw = dict(dist=fwd.dist, topk=topk, chunk=fwd.chunk, return_hidden=return_hidden, balance=balance)
    routing = replayed(fwd.model_cfg, batch)
    if replicas:
        split = lambda x: minibatches.by_shard(x, replicas, fwd.on_shards)  # noqa: E731
        one = lambda p, t, m, k, g, r: heads.sequence_logprobs(  # noqa: E731
            full(p), fwd.model_cfg, t, m, kept_BxL=k, gather_ids_BxLxK=g, routing_BxLxMxK=r, **kw)
        out = jax.vmap(one)(params, split(batch.tokens), split(batch.input_mask), split(batch.behav_kept),
                            split(gather_ids), split(routing))
        return {k: v if k == "moe_aux_loss" else v.reshape(-1, *v.shape[2:]) for k, v in out.items()}
    if packed is None:
        with attention.on_mesh(fwd.model_cfg, fwd.mesh):
            return heads.sequence_logprobs(full(params), fwd.model_cfg, batch.tokens, batch.input_mask,
                                           kept_BxL=batch.behav_kept, gather_ids_BxLxK=gather_ids,
                                           routing_BxLxMxK=routing, **kw)
    rows = lambda x: jax.lax.with_sharding_constraint(x, fwd.on_shards)  # noqa: E731
    pack = lambda x: None if x is None else rows(packing.pack(x, packed.src))
    with attention.on_mesh(fwd.model_cfg, fwd.mesh):
        s = heads.sequence_logprobs(full(params), fwd.model_cfg, pack(batch.tokens), kept_BxL=pack(batch.behav_kept),
                                    gather_ids_BxLxK=pack(gather_ids), routing_BxLxMxK=pack(routing),
                                    segments=(rows(packed.segment), rows(packed.position)), **kw)
    return {k: v if k == "moe_aux_loss" else packing.unpack(v, packed.dst) for k, v in s.items()}


def replayed(cfg: ModelConfig, batch: TrajectoryBatch):
    """The experts the sampler used (a mixture of experts): replayed under `model.moe.routing=replay`
    (which needs them), else compared with the learner's own (`routing_differs`)."""
    if cfg.moe_routing == "replay" and batch.routing is None:
        raise ValueError("model.moe.routing=replay: this batch carries no routing (a sampler with "
                         "SamplerConfig.record_routing records it)")
    return batch.routing if cfg.num_experts else None


def batch_stats(fwd: Forward, params, batch: TrajectoryBatch, packed: Optional[packing.PackLayout],
                num_minibatches: int = 1, **kw) -> dict:
    """`stats` over a whole batch (the extra passes: prox, ref), minibatch by minibatch as the
    update runs (`num_minibatches`; pack plans are per minibatch), so a pass holds no more than an
    update's forward; the results concatenated back to [B, ...]."""
    m = packed.src.shape[0] if packed is not None else num_minibatches
    if packed is None and (m <= 1 or batch.shape[0] % m):
        return stats(fwd, params, batch, **kw)
    shards = sharding.batch_size(fwd.mesh)
    mbs = jax.tree_util.tree_map(lambda x: minibatches.split(x, m, shards), batch)
    out = jax.lax.map(lambda a: stats(fwd, params, a[0], packed=a[1], **kw), (mbs, packed))
    return jax.tree_util.tree_map(lambda y: minibatches.join(y, shards), out)
