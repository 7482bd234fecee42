"""A run's parts, built from its plan: the task and its scorer, the learner, the orchestrator
with its sampler, the greedy evaluation samplers, and the weights the run starts from.

`build(config) -> Parts` is what `experiment` runs and what benchmarks and tests take apart;
`initial_params` gives a run's starting weights (loaded, or random and warm-started).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import models, tasks
from jaxrl_llm.gateway import agents
from jaxrl_llm.learner import learner
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm.rollout import backend
from jaxrl_llm.rollout.backend import RolloutBackend
from jaxrl_llm.run import plan as plan_lib
from jaxrl_llm.runtime import orchestrator
from jaxrl_llm.tasks import warmstart


@dataclasses.dataclass(frozen=True)
class Parts:
    plan: plan_lib.RunPlan  # validated, resolved, memory checked (`plan.resolve`)
    task: Any
    scorer: Any  # the task's scoring stage (closed with the run)
    learner: learner.Learner
    orchestrator: orchestrator.Orchestrator
    greedy: RolloutBackend  # the policy's evaluation sampler
    params: Any = None  # the policy's loaded weights (None: random); dropped once the learner holds them
    aux_params: Any = None  # the auxiliary's, likewise
    aux_greedy: Optional[RolloutBackend] = None  # a sampling auxiliary's evaluation sampler
    aux_eval: bool = False  # whether that auxiliary is evaluated beside the policy

    @property
    def model_cfg(self) -> ModelConfig:
        return self.plan.model

    @property
    def aux_cfg(self) -> Optional[ModelConfig]:
        return self.plan.aux_model

    @property
    def memory_plan(self) -> dict:
        return self.plan.memory

    def without_weights(self) -> "Parts":
        """These parts without the loaded weights (the learner holds its own copy by then)."""
        return dataclasses.replace(self, params=None, aux_params=None)


def _load(m, cfg, shardings=None):
    """The checkpoint's weights (float32 master copies) or None for a random model; with
    `shardings`, each tensor read straight into its place on the learner's mesh."""
    if not m.hf_path:
        return None
    place = shardings and sharding.placer(shardings, cfg.param_dtype)
    return models.load_params(m.hf_path, cfg.without_lora(), place=place)[0]


def build(config) -> Parts:
    """The run's parts, from its plan (`plan.resolve`: validated, resolved, memory checked)."""
    p = plan_lib.resolve(config)
    c = p.config
    lrn = learner.Learner(p.model, p.objective, c.learner, mesh=sharding.make_mesh(c.mesh, p.learner_devices),
                          mesh_cfg=c.mesh, aux_model_cfg=p.aux_model, dist=p.sampler.dist)
    placed = lrn.layout.base_sh if lrn.layout.lora else lrn.layout.param_sh  # the full model's shardings
    params, aux_params = _load(c.model, p.model, placed), p.aux_model and _load(c.aux_model, p.aux_model)
    # Samplers split rows over their devices (data parallel), each holding whole weights but a
    # mixture's experts (split over them: `Sampler.splits_experts`). The weight store publishes
    # each version onto them when they are devices of their own, when the learner shards its
    # params (fsdp / tensor: a sampler handed sharded weights would all-gather them inside every
    # call), or when the samplers split experts.
    mesh = Mesh(np.asarray(p.sampler_devices), ("data",))
    sharded = lrn.mesh.size > 1 and not sharding.pure_data(lrn.mesh)
    rollout = backend.make(lrn.rollout_model_cfg, p.sampler, mesh)
    placement = NamedSharding(mesh, PartitionSpec()) if p.own_sampler_devices or sharded else None
    if getattr(rollout, "splits_experts", False):
        placement = rollout.shardings
    scorer = tasks.scorer(p.task, c.task)
    if isinstance(p.task, agents.AgentTask):  # sessions the task checks are scored by the run's stage too
        p.task.scorer = scorer
    orch = orchestrator.Orchestrator(lrn, rollout, p.task, c.runtime, placement=placement, scorer=scorer,
                                     node_config={"task": c.task.to_dict(), "hf_path": c.model.hf_path,
                                                  "agent": plan_lib.node_agent(c)})
    # A sampling auxiliary (a rollout model) is evaluated beside the policy; any auxiliary may be warm-started.
    return Parts(plan=p, task=p.task, scorer=scorer, learner=lrn, orchestrator=orch,
                 greedy=backend.make(p.model.for_sampling(), p.greedy, mesh), params=params, aux_params=aux_params,
                 aux_greedy=p.aux_model and backend.make(p.aux_model, p.greedy, mesh),
                 aux_eval=lrn.aux is not None and lrn.aux.samples)


def initial_params(config, params, cfg, task, key, greedy, notes, role="policy"):
    """Given weights, or random ones warm-started on the task (tasks with `supervised`)."""
    if params is not None:
        return params
    params = models.init_params(cfg, key)
    w = config.warm_start
    if w.steps and hasattr(task, "supervised") and distributed.is_main():  # the others take process 0's
        params, note = warmstart.cached(
            lambda p: warmstart.to_target(p, cfg, task, greedy, w, config.seed), params, w,
            warmstart.cache_key(cfg, config.task, w, config.seed, role))
        notes.append(note)
    return distributed.broadcast(params)  # every process starts from process 0's weights
