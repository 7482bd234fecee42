"""`Learner`: the owner of one learner's compiled step and its host-side preparation.

The step itself is the pure `update.train_step(state, batch, packed, plan=...)`; the forward
layouts are in `forward.py`, the state's creation in `train_state.py`. Here: the `learner`
config section, the `StepPlan` resolved from it, the jitted programs, and `prepare` (validate,
pack, lay out and shard a host batch, run the extra passes the objective needs).
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import objectives
from jaxrl_llm.learner import minibatches, packing, train_state, update
from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm import validation as V
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.learner.forward import Forward
from jaxrl_llm.models import decoder, lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.objectives.auxiliary import AuxContext
from jaxrl_llm.learner.train_state import AuxState, TrainState  # noqa: F401  (the learner's state types)


SECTION = V.Section(
    lr=(1e-5, V.positive()), b1=(0.9, V.below_one()), b2=(0.999, V.below_one()), eps=(1e-8, V.positive()),
    weight_decay=(0.0, V.non_negative()), max_grad_norm=(1.0, V.positive()),
    max_bad_steps=(10, V.integer(0)),  # the run stops after this many steps in a row skipped a non-finite update (0: never)
    schedule=("constant", V.one_of("constant", "cosine")),  # cosine: with warmup_steps, over total_steps updates
    warmup_steps=(0, V.integer(0)), total_steps=(1000, V.integer(1)),
    num_minibatches=(4, V.integer(1)),  # the A-3PO paper uses 4
    logprob_chunk=(128, V.integer(1)),
    # sampled: pi_theta is the distribution the sampler draws from (temperature, top-k, top-p;
    #   models/policy_dist.py), so fresh tokens have ratio 1. full: the full temperature softmax
    #   (under top-k / top-p every fresh ratio is then the kept mass, < 1).
    policy_dist=("sampled", V.one_of("sampled", "full")),
    # auto: the decoder runs on packed rows (packing.py) when that removes rows and the rows are
    #   at least packing_min_len tokens long (one process; objectives still see the padded
    #   layout). Each new packed-row count compiles the step once: for short rows (the embedded
    #   task's 13 tokens) that costs more than packing saves. off: always the padded layout.
    packing=("auto", V.one_of("auto", "off")), packing_min_len=(128, V.integer(0)),
    ref_swap_every=(0, V.integer(0)),  # S: copy params into the reference every S steps (0: never)
    seed=(0, V.integer(0)),
)
default_config = SECTION.config  # the `learner` section
RULES = SECTION.rules


class Learner:
    """Compiles the step for one (model, objective, mesh) and runs training steps on host batches."""

    def __init__(self, model_cfg: ModelConfig, objective_cfg, learner_cfg=None, mesh=None, mesh_cfg=None,
                 aux_model_cfg: Optional[ModelConfig] = None, dist: PolicyDist = PolicyDist()):
        """`dist`: the sampler's temperature / top-k / top-p, so the policy's log-probs are those
        of the distribution the tokens were drawn from (`learner.policy_dist="full"` keeps only
        the temperature). `aux_model_cfg`: the decoder of the objective's auxiliary model, for
        objectives whose auxiliary needs one (e.g. a separate rollout model)."""
        self.model_cfg, self.cfg = model_cfg, learner_cfg or default_config()
        V.raise_all(V.check(self.cfg, RULES, "learner."), what="invalid learner option")  # also when built without a config file
        self.plan, self.layout = _resolve(model_cfg, self.cfg, objective_cfg, mesh or sharding.make_mesh(mesh_cfg),
                                          mesh_cfg, aux_model_cfg, dist)
        self.mesh, self.aux = self.plan.fwd.mesh, self.plan.aux
        self._prox = jax.jit(functools.partial(update.prox_pass, plan=self.plan))
        self._ref = jax.jit(functools.partial(update.ref_pass, plan=self.plan))
        self._step = None  # built by place(): needs the state's shardings
        self._prepare = None  # the objective's step-level selection (`_keep`), when it has one
        self.base = None  # LoRA: the frozen weights the adapters complete (`hold_base`)
        scale, dtype = model_cfg.lora_scale, model_cfg.dtype
        self._merge = jax.jit(lambda base, adapters: lora.merge(base, adapters, scale, dtype))

    @property
    def temperature(self) -> float:
        return self.plan.fwd.dist.temperature

    @property
    def rollout_model_cfg(self) -> ModelConfig:
        """The model the samplers run: the auxiliary's when it samples, else the policy."""
        if self.aux is not None and self.aux.samples:
            return self.plan.aux_ctx.model_cfg
        return self.model_cfg.for_sampling()  # LoRA: samplers get merged weights (`WeightStore`)

    def rollout_params(self, state: TrainState):
        """The params the samplers generate with (see `rollout_model_cfg`)."""
        return state.aux.params if self.aux is not None and self.aux.samples else state.params

    @property
    def publishes_adapters(self) -> bool:
        """LoRA with the policy sampling: each version publishes adapters over `rollout_base`."""
        return self.layout.lora and not (self.aux is not None and self.aux.samples)

    @property
    def rollout_base(self):
        """With LoRA (and the policy sampling): the frozen base the published adapters complete."""
        return self.base if self.publishes_adapters else None

    def init(self, key, params=None, aux_params=None, adapters=None) -> TrainState:
        """A new state, created in its shardings (given params are copied there). With LoRA,
        `params` is the base (random when None) and the state holds `adapters` (new when None)."""
        if self.layout.lora:
            self.hold_base(params if params is not None else decoder.init_params(
                self.model_cfg.without_lora(), jax.random.fold_in(key, 2)))
            params = adapters
        return self.place(train_state.init(self.layout, key, params, aux_params))

    def hold_base(self, params) -> None:
        """LoRA: keep the frozen base (float weights in the compute dtype) on the learner's mesh."""
        cast = lambda x: x.astype(self.model_cfg.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
        self.base = train_state.own(jax.tree_util.tree_map(cast, params), self.layout.base_sh)

    def policy_params(self, state: TrainState):
        """The policy as plain decoder params (LoRA: merged into a new copy, compute dtype)."""
        return self._merge(self.base, state.params) if self.layout.lora else state.params

    def abstract_state(self) -> TrainState:
        """`init`'s state, abstract: the template a checkpoint restores into."""
        return train_state.abstract(self.layout)

    def place(self, state: TrainState) -> TrainState:
        """Commit every leaf to the mesh and pin the step's output shardings to them, so steps
        never retrace."""
        shardings = train_state.shardings(self.mesh, state)
        if self._step is None:
            self._step = jax.jit(functools.partial(update.train_step, plan=self.plan), donate_argnums=0,
                                 out_shardings=(shardings, sharding.replicated(self.mesh)))
        return jax.device_put(state, shardings)

    def prepare(self, state: TrainState, batch: TrajectoryBatch):
        """Validate, plan the packing, shard, and run the extra passes the objective needs.
        Returns (batch, pack plan or None, timings)."""
        batch.validate()
        m = self.cfg.num_minibatches
        b = batch.shape[0] * distributed.count()  # every process contributes its rows
        if b % m:
            raise ValueError(f"TrajectoryBatch.tokens: {b} sequences do not split into num_minibatches={m}")
        if batch.input_mask is None:
            batch = batch.replace(input_mask=jnp.ones(batch.shape, jnp.float32))
        packed = None
        if (self.cfg.packing == "auto" and distributed.count() == 1
                and batch.shape[1] >= self.cfg.get("packing_min_len", 0)):
            packed = packing.layout(jax.device_get(batch.input_mask), m, multiple=sharding.batch_size(self.mesh))
        batch = minibatches.host_layout(batch, m, sharding.batch_size(self.mesh), distributed.count(),
                                        distributed.index())
        batch = sharding.shard_batch(batch, self.mesh)
        if packed is not None:  # packed rows split over the batch axes like the batch's rows
            row_sh = NamedSharding(self.mesh, P(None, sharding.BATCH_AXES))
            packed = packed.replace(src=jax.device_put(packed.src, row_sh),
                                    segment=jax.device_put(packed.segment, row_sh),
                                    position=jax.device_put(packed.position, row_sh),
                                    dst=jax.device_put(packed.dst, sharding.replicated(self.mesh)))
        timings = {"prox_time_s": 0.0}
        if "prox_logp" in self.plan.needs:
            t = time.perf_counter()
            prox, prox_topk = jax.block_until_ready(self._prox(state.params, batch, packed, self.base))
            timings["prox_time_s"] = time.perf_counter() - t
            batch = batch.replace(prox_logp=prox, prox_topk_logp=prox_topk)
        if "ref_logp" in self.plan.needs:
            batch = batch.replace(ref_logp=self._ref(state.ref_params, batch, packed, self.base))
        obj = self.plan.objective
        if obj.prepare is not None and obj.prepare_when(self.plan.obj_cfg):  # a selection over the step's whole batch
            batch = batch.replace(token_keep=self._keep(batch.loss_mask.sharding)(batch))
        return batch, packed, timings

    def _keep(self, row_sharding):
        """The objective's `prepare`, jitted once, its [B, L] output laid out as the batch's rows."""
        if self._prepare is None:
            self._prepare = jax.jit(lambda b: self.plan.objective.prepare(b, self.plan.obj_cfg),
                                    out_shardings=row_sharding)
        return self._prepare

    def lower_step(self, state: TrainState, batch: TrajectoryBatch):
        """`train_step`'s program, lowered and not run (its memory analysis, its HLO)."""
        batch, packed, _ = self.prepare(state, batch)
        return self._step.lower(state, batch, packed, self.base)

    def train_step(self, state: TrainState, batch: TrajectoryBatch):
        """One training step (num_minibatches updates). Returns (new_state, metrics)."""
        t0 = time.perf_counter()
        batch, packed, timings = self.prepare(state, batch)
        state, metrics = self._step(state, batch, packed, self.base)
        metrics = jax.device_get(metrics)
        tokens = float(metrics.pop("trained_tokens"))  # over the global batch, from the step itself
        if self.cfg.ref_swap_every and int(state.version) % self.cfg.ref_swap_every == 0:
            state = state.replace(ref_params=jax.tree_util.tree_map(jnp.copy, state.params))
        elapsed = time.perf_counter() - t0
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(timings, step_time_s=elapsed, skipped_updates=float(state.skipped),
                       version=float(state.version), tokens_per_s=tokens / elapsed)
        return state, metrics


def _resolve(model_cfg, cfg, objective_cfg, mesh, mesh_cfg, aux_model_cfg, dist):
    """The learner config -> (the step's `StepPlan`, the state's `Layout`)."""
    dist = dist if cfg.policy_dist == "sampled" else PolicyDist(dist.temperature)
    obj_cfg = objectives.make_config(objective_cfg)
    objective = objectives.get(obj_cfg.name)
    needs = frozenset(objectives.required_passes(obj_cfg))
    aux = _active_aux(objective, aux_model_cfg)
    aux_ctx = AuxContext(model_cfg, aux_model_cfg, dist, cfg.logprob_chunk)
    opt = update.make_optimizer(cfg)
    param_sh = sharding.param_shardings(decoder.logical_axes(model_cfg.without_lora()), mesh, mesh_cfg,
                                        kv_heads=model_cfg.num_kv_heads)
    init_params, base_sh = functools.partial(decoder.init_params, model_cfg), None
    if model_cfg.lora_rank:
        # Adapters are replicated: r (in + out) per target is ~1-2% of the base at rank 16, so
        # a copy per device costs little and no layer all-gathers them; their gradients are one
        # small all-reduce. Stacked experts' adapters (E times as many) split as their experts do
        # (`lora.expert_side`). The base keeps its logical-axis shardings.
        adapter_axes = lora.split(decoder.logical_axes(model_cfg))[1]
        init_params, base_sh = functools.partial(_init_adapters, model_cfg), param_sh
        param_sh = sharding.param_shardings(adapter_axes, mesh, mesh_cfg)
    aux_sh = None
    if aux is not None:
        axes = aux.logical_axes and aux.logical_axes(aux_ctx)
        kv = aux_model_cfg.num_kv_heads if aux_model_cfg is not None else 0
        aux_sh = sharding.param_shardings(axes, mesh, mesh_cfg, kv) if axes is not None else sharding.replicated(mesh)
    # Pure data parallelism on CPU (fsdp = tensor = 1): one flat gradient all-reduce
    # (`minibatches.replica_value_and_grad`); gloo makes one call per buffer. GPU/TPU
    # collectives combine buffers themselves, and the flat copy would cost a gradient's memory.
    cpu = mesh.devices.flat[0].platform == "cpu"
    plan = update.StepPlan(
        fwd=Forward(model_cfg, dist, cfg.logprob_chunk, mesh), objective=objective, obj_cfg=obj_cfg, needs=needs,
        opt=opt, num_minibatches=cfg.num_minibatches, aux=aux, aux_ctx=aux_ctx,
        replicas=sharding.batch_size(mesh) if cpu and sharding.pure_data(mesh) else 0,
        # Many processes on CPU: the step's metrics on a gathered copy of the rows
        # (`minibatches.replicate_rows`), not a gloo all-reduce per metric.
        gather_metrics=cpu and mesh.devices.size > len(mesh.local_devices))
    layout = train_state.Layout(
        opt=opt, mesh=mesh, init_params=init_params, param_sh=param_sh,
        seed=cfg.seed, with_ref="ref_logp" in needs, init_aux=aux and functools.partial(_init_aux, aux, aux_ctx),
        aux_sh=aux_sh, lora=bool(model_cfg.lora_rank), base_sh=base_sh)
    return plan, layout


def _init_adapters(model_cfg, key):
    """New LoRA adapters (A random, B zero); the base XLA builds beside them is dead code."""
    return lora.split(decoder.init_params(model_cfg, key))[1]


def _init_aux(aux, ctx, key):
    return aux.init(key, ctx)


def _active_aux(objective, aux_model_cfg):
    """The objective's auxiliary model when it is in use; a model config given to an objective
    that has no use for one is an error, not silently ignored."""
    aux = objective.aux
    if aux is not None and (not aux.needs_model or aux_model_cfg is not None):
        return aux
    if aux_model_cfg is not None:
        raise ValueError(f"objective {objective.objective_name!r} trains no auxiliary model, but one was given; "
                         f"objectives that train one: {', '.join(objectives.with_aux()) or 'none'}")
    return None
