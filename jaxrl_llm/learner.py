"""TrainState and the sharded, jitted learner step.

One training step consumes one TrajectoryBatch in `num_minibatches` gradient updates and
advances the policy version by one: version = number of completed training steps, and the
sampler's params carry the version they were published with (so staleness d = learner version
- token version). `step` counts optimizer updates (it drives the LR schedule).

Extra passes run only when the objective declares them (`objectives.required_passes`):
  prox_logp  -> a separate jitted forward before the minibatch loop (timed: prox_time_s);
  ref_logp   -> a jitted forward of the frozen reference params (kl.coef > 0), swapped for the
                current params every `ref_swap_every` steps (Mroueh et al., "Revisiting Group
                Relative Policy Optimization", arXiv:2505.22257, Algorithm 1);
  neither    -> e.g. a3po: pi_prox is interpolated inside the loss, no extra forward is traced.
An objective that registered an auxiliary model (`objectives.Auxiliary`) has it trained in the
same update, after the policy, from the policy forward's hidden states; its params and
optimizer state live in `TrainState.aux`.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import distributed, minibatches, objectives, packing, sharding, step_metrics
from jaxrl_llm import validation as V
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.models import decoder, heads
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.objectives.auxiliary import AuxContext, AuxInputs
from jaxrl_llm.objectives.common import check_choice


@struct.dataclass
class AuxState:
    params: Any  # the objective's auxiliary model
    opt_state: Any


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # optimizer updates so far
    version: jax.Array  # completed training steps
    rng: jax.Array  # raw uint32[2] key (checkpoint friendly)
    skipped: jax.Array  # updates skipped for non-finite loss / grads
    ref_params: Any = None
    aux: Optional[AuxState] = None  # when the objective trains an auxiliary model


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.lr = 1e-5
    c.b1, c.b2, c.eps, c.weight_decay = 0.9, 0.999, 1e-8, 0.0
    c.max_grad_norm = 1.0
    c.max_bad_steps = 10  # the run stops after this many steps in a row skipped a non-finite update (0: never)
    c.schedule = "constant"  # constant | cosine (with warmup_steps, total_steps updates)
    c.warmup_steps = 0
    c.total_steps = 1000
    c.num_minibatches = 4  # the A-3PO paper uses 4
    c.logprob_chunk = 128
    # sampled: pi_theta is the distribution the sampler draws from (temperature, top-k, top-p;
    #   models/policy_dist.py), so fresh tokens have ratio 1. full: the full temperature softmax
    #   (under top-k / top-p every fresh ratio is then the kept mass, < 1).
    c.policy_dist = "sampled"
    # auto: the decoder runs on packed rows (packing.py) when that removes rows and the rows are
    #   at least packing_min_len tokens long (one process; objectives still see the padded
    #   layout). Each new packed-row count compiles the step once: for short rows (the embedded
    #   task's 13 tokens) that costs more than packing saves. off: always the padded layout.
    c.packing = "auto"
    c.packing_min_len = 128
    c.ref_swap_every = 0  # S: copy params into the reference every S steps (0: never)
    c.seed = 0
    return c


RULES = {  # validation.py: checked at start-up, with every other section
    "lr": V.positive(), "b1": V.below_one(), "b2": V.below_one(), "eps": V.positive(),
    "weight_decay": V.non_negative(), "max_grad_norm": V.positive(), "max_bad_steps": V.integer(0),
    "schedule": V.one_of("constant", "cosine"), "warmup_steps": V.integer(0), "total_steps": V.integer(1),
    "num_minibatches": V.integer(1), "logprob_chunk": V.integer(1), "policy_dist": V.one_of("sampled", "full"),
    "packing": V.one_of("auto", "off"), "packing_min_len": V.integer(0), "ref_swap_every": V.integer(0), "seed": V.integer(0),
}


def make_optimizer(c) -> optax.GradientTransformation:
    if c.schedule == "constant":
        lr = optax.warmup_constant_schedule(0.0, c.lr, c.warmup_steps) if c.warmup_steps else c.lr
    elif c.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(c.total_steps, c.warmup_steps + 1))
    else:
        raise ValueError(f"unknown schedule {c.schedule!r}; valid: constant, cosine")
    return optax.chain(optax.clip_by_global_norm(c.max_grad_norm),
                       optax.adamw(lr, c.b1, c.b2, c.eps, weight_decay=c.weight_decay))


class Learner:
    """Builds the jitted passes for one (model, objective, mesh) and runs training steps."""

    def __init__(self, model_cfg: ModelConfig, objective_cfg, learner_cfg=None, mesh=None, mesh_cfg=None,
                 aux_model_cfg: Optional[ModelConfig] = None, dist: PolicyDist = PolicyDist()):
        """`dist`: the sampler's temperature / top-k / top-p, so the policy's log-probs are those
        of the distribution the tokens were drawn from (`learner.policy_dist="full"` keeps only
        the temperature). `aux_model_cfg`: the decoder of the objective's auxiliary model, for
        objectives whose auxiliary needs one (e.g. a separate rollout model)."""
        self.model_cfg = model_cfg
        self.cfg = learner_cfg or default_config()
        check_choice("learner.policy_dist", self.cfg.policy_dist, ("sampled", "full"))
        self.dist = dist if self.cfg.policy_dist == "sampled" else PolicyDist(dist.temperature)
        check_choice("learner.packing", self.cfg.packing, ("auto", "off"))
        self.obj_cfg = objectives.make_config(objective_cfg)
        self.objective = objectives.get(self.obj_cfg.name)
        self.needs = objectives.required_passes(self.obj_cfg)
        self.aux = _active_aux(self.objective, aux_model_cfg)
        self._aux_samples = self.aux is not None and self.aux.samples
        self.aux_ctx = AuxContext(model_cfg, aux_model_cfg, self.dist, self.cfg.logprob_chunk)
        self.opt = make_optimizer(self.cfg)
        self.mesh = mesh or sharding.make_mesh(mesh_cfg)
        self.param_sh = sharding.param_shardings(decoder.logical_axes(model_cfg), self.mesh, mesh_cfg)
        self.aux_sh = None
        if self.aux is not None:
            axes = self.aux.logical_axes and self.aux.logical_axes(self.aux_ctx)
            self.aux_sh = (sharding.param_shardings(axes, self.mesh, mesh_cfg) if axes is not None
                           else sharding.replicated(self.mesh))
        # Pure data parallelism on CPU (fsdp = tensor = 1): one flat gradient all-reduce
        # (`minibatches.replica_value_and_grad`); gloo makes one call per buffer. GPU/TPU
        # collectives combine buffers themselves, and the flat copy would cost a gradient's memory.
        cpu = self.mesh.devices.flat[0].platform == "cpu"
        self._replicas = sharding.batch_size(self.mesh) if cpu and sharding.pure_data(self.mesh) else 0
        # Many processes on CPU: the step's metrics are computed on a gathered copy of the rows
        # (`minibatches.replicate_rows`), not with a gloo all-reduce per metric.
        self._gather_metrics = cpu and self.mesh.devices.size > len(self.mesh.local_devices)
        self._on_shards = NamedSharding(self.mesh, P(sharding.BATCH_AXES))
        self.forward_traces = 0  # policy forwards traced (a3po must add none)
        self._prox = jax.jit(self._prox_pass)
        self._ref = jax.jit(self._ref_pass)
        self._step = None  # built by place(): needs the state's shardings
        self.step_traces = 0

    @property
    def temperature(self) -> float:
        return self.dist.temperature

    @property
    def rollout_model_cfg(self) -> ModelConfig:
        """The model the samplers run: the auxiliary's when it samples, else the policy."""
        return self.aux_ctx.model_cfg if self._aux_samples else self.model_cfg

    def rollout_params(self, state: TrainState):
        """The params the samplers generate with (see `rollout_model_cfg`)."""
        return state.aux.params if self._aux_samples else state.params

    # ------------------------------------------------------------------ state
    def init(self, key, params=None, aux_params=None) -> TrainState:
        """Params are created directly in their shardings (or moved there when given)."""
        mc = self.model_cfg
        if params is None:
            params = jax.jit(lambda k: decoder.init_params(mc, k), out_shardings=self.param_sh)(key)
        else:
            params = self._own(params, self.param_sh)
        opt_state = self._opt_init(params, self.param_sh)
        kw = {}
        if self.aux is not None:
            if aux_params is None:
                aux_params = jax.jit(lambda k: self.aux.init(k, self.aux_ctx),
                                     out_shardings=self.aux_sh)(jax.random.fold_in(key, 1))
            else:
                aux_params = self._own(aux_params, self.aux_sh)
            kw["aux"] = AuxState(aux_params, self._opt_init(aux_params, self.aux_sh))
        if "ref_logp" in self.needs:
            kw["ref_params"] = jax.tree_util.tree_map(jnp.copy, params)
        state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                           version=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(self.cfg.seed),
                           skipped=jnp.zeros((), jnp.int32), **kw)
        return self.place(state)

    @staticmethod
    def _own(params, shardings):
        """A private copy in `shardings`: the step donates its state, so the caller's arrays
        (e.g. the sampler's published params) must not be aliased."""
        if distributed.count() > 1:  # host values every process holds -> global arrays
            return distributed.put_global(jax.device_get(params), shardings)
        return jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p), out_shardings=shardings)(params)

    def _opt_shardings(self, abstract_opt, param_sh):
        """Moments sharded like their params (`param_sh`: a tree), counters replicated."""
        rep = sharding.replicated(self.mesh)
        return optax.tree_map_params(self.opt, lambda _, sh: sh, abstract_opt, param_sh,
                                     transform_non_params=lambda _: rep)

    def _opt_init(self, params, param_sh):
        """Optimizer state created in place."""
        out_sh = self._opt_shardings(jax.eval_shape(self.opt.init, params), _per_leaf(param_sh, params))
        return jax.jit(self.opt.init, out_shardings=out_sh)(params)

    def abstract_state(self) -> TrainState:
        """`init`'s state as ShapeDtypeStructs in its shardings, nothing allocated: the template
        a checkpoint restores into (a concrete one would hold a second state during the read)."""
        rep = sharding.replicated(self.mesh)
        key = jax.random.key(0)

        def structs(tree, shardings):
            return jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                          tree, shardings)

        def model(init, shardings):
            params = jax.eval_shape(init, key)
            sh = _per_leaf(shardings, params)
            opt = jax.eval_shape(self.opt.init, params)
            return structs(params, sh), structs(opt, self._opt_shardings(opt, sh))

        params, opt_state = model(lambda k: decoder.init_params(self.model_cfg, k), self.param_sh)
        kw = {}
        if self.aux is not None:
            kw["aux"] = AuxState(*model(lambda k: self.aux.init(k, self.aux_ctx), self.aux_sh))
        if "ref_logp" in self.needs:
            kw["ref_params"] = params
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        rng = jax.eval_shape(lambda: jax.random.PRNGKey(self.cfg.seed))
        return TrainState(params=params, opt_state=opt_state, step=scalar, version=scalar, skipped=scalar,
                          rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=rep), **kw)

    def place(self, state: TrainState) -> TrainState:
        """Commit every leaf to the mesh (params/optimizer keep their shardings, the rest is
        replicated) and pin the step's output shardings to them, so steps never retrace."""
        rep = sharding.replicated(self.mesh)

        def sh(x):
            s = getattr(x, "sharding", None)
            return s if isinstance(s, jax.sharding.NamedSharding) and s.mesh == self.mesh else rep

        shardings = jax.tree_util.tree_map(sh, state)
        if self._step is None:
            self._step = jax.jit(self._train_step, donate_argnums=0, out_shardings=(shardings, rep))
        return jax.device_put(state, shardings)

    # ------------------------------------------------------------------ passes
    def _stats(self, params, batch, topk=0, gather=True, return_hidden=False, plan=None, replicas=0):
        """Per-token stats in the padded [B, L] layout; with a (one-minibatch) `plan` the
        decoder runs on the packed rows and the results are scattered back. `replicas` = S:
        `params` holds one copy per batch shard ([S, ...]); shard s's rows use copy s."""
        self.forward_traces += 1
        gather_ids = batch.topk_ids if gather and batch.topk > 0 else None
        kw = dict(dist=self.dist, topk=topk, chunk=self.cfg.logprob_chunk, return_hidden=return_hidden)
        if replicas:
            split = lambda x: minibatches.by_shard(x, replicas, self._on_shards)  # noqa: E731
            one = lambda p, t, m, k, g: heads.sequence_logprobs(  # noqa: E731
                p, self.model_cfg, t, m, kept_BxL=k, gather_ids_BxLxK=g, **kw)
            out = jax.vmap(one)(params, split(batch.tokens), split(batch.input_mask), split(batch.behav_kept),
                                split(gather_ids))
            return {k: v.reshape(-1, *v.shape[2:]) for k, v in out.items()}
        if plan is None:
            return heads.sequence_logprobs(params, self.model_cfg, batch.tokens, batch.input_mask,
                                           kept_BxL=batch.behav_kept, gather_ids_BxLxK=gather_ids, **kw)
        rows = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(sharding.BATCH_AXES)))
        pack = lambda x: None if x is None else rows(packing.pack(x, plan.src))
        s = heads.sequence_logprobs(params, self.model_cfg, pack(batch.tokens), kept_BxL=pack(batch.behav_kept),
                                    gather_ids_BxLxK=pack(gather_ids),
                                    segments=(rows(plan.segment), rows(plan.position)), **kw)
        return {k: packing.unpack(v, plan.dst) for k, v in s.items()}

    def _batch_stats(self, params, batch, plan, **kw):
        """`_stats` over a whole batch: with a plan, minibatch by minibatch (plans are per
        minibatch), the results concatenated back to [B, ...]."""
        if plan is None:
            return self._stats(params, batch, **kw)
        m, shards = plan.src.shape[0], sharding.batch_size(self.mesh)
        mbs = jax.tree_util.tree_map(lambda x: minibatches.split(x, m, shards), batch)
        out = jax.lax.map(lambda a: self._stats(params, a[0], plan=a[1], **kw), (mbs, plan))
        return jax.tree_util.tree_map(lambda y: minibatches.join(y, shards), out)

    def _prox_pass(self, params, batch, plan):
        """pi_prox = the policy at the start of the step (decoupled PPO's recompute pass)."""
        s = self._batch_stats(params, batch, plan, gather="prox_topk_logp" in self.needs)
        return s["logp"], s.get("logp_at_ids")

    def _ref_pass(self, ref_params, batch, plan):
        return self._batch_stats(ref_params, batch, plan, gather=False)["logp"]

    def _policy(self, s, version, rng) -> PolicyOutput:
        return PolicyOutput(logp=s["logp"], version=version, entropy=s["entropy"],
                            logp_at_behav_topk=s.get("logp_at_ids"), topk_ids=s.get("topk_ids"),
                            topk_logp=s.get("topk_logp"), rng=rng)

    def _loss(self, params, batch, version, rng, plan=None, replicas=0):
        """Objective loss; aux = (sg(per-token stats) for `_metrics`, sg(final hidden states)),
        the latter handed to the auxiliary model's loss instead of a second policy forward."""
        topk = batch.topk if "topk" in self.needs else 0
        s = self._stats(params, batch, topk=topk, return_hidden=self.aux is not None, plan=plan, replicas=replicas)
        loss, _ = self.objective(self._policy(s, version, rng), batch, self.obj_cfg)
        hidden = s.pop("hidden", None)
        return loss, (jax.lax.stop_gradient(s), jax.lax.stop_gradient(hidden))

    def _metrics(self, s, batch, version, rng):
        """One update's metrics from the per-token stats its loss saw (`step_metrics.of_update`)."""
        return step_metrics.of_update(self.objective, self.obj_cfg, self._policy(s, version, rng), batch)

    def _train_step(self, state: TrainState, batch: TrajectoryBatch, plan: Optional[packing.PackPlan] = None):
        self.step_traces += 1
        m_count = self.cfg.num_minibatches
        shards = sharding.batch_size(self.mesh)
        mbs = jax.tree_util.tree_map(lambda x: minibatches.split(x, m_count, shards), batch)  # laid out by prepare

        def update(params, opt_state, grads, loss):
            # Nothing is applied on a non-finite loss or gradient. A cond, not a select between
            # new and old: XLA then updates in place (a select kept ~2.5 extra parameter trees).
            def apply(p, o, g):
                updates, new_opt = self.opt.update(g, o, p)
                return optax.apply_updates(p, updates), new_opt, optax.global_norm(updates)

            ok = jnp.isfinite(loss) & step_metrics.finite(grads)
            return (*jax.lax.cond(ok, apply, lambda p, o, _: (p, o, jnp.float32(0.0)), params, opt_state, grads), ok)

        def one(carry, xs):
            st, (mb, pl) = carry, xs
            rng = jax.random.fold_in(st.rng, st.step)
            if self._replicas and pl is None and mb.shape[0] % self._replicas == 0:
                (loss, (stats, hidden)), grads = minibatches.replica_value_and_grad(
                    self._loss, st.params, self._replicas, self._on_shards, mb, st.version, rng, replicas=self._replicas)
            else:
                (loss, (stats, hidden)), grads = jax.value_and_grad(self._loss, has_aux=True)(
                    st.params, mb, st.version, rng, pl)
            params, opt_state, update_norm, ok = update(st.params, st.opt_state, grads, loss)
            metrics = {"grad_norm": optax.global_norm(grads), "update_norm": update_norm}
            aux = st.aux
            if self.aux is not None:  # the objective's auxiliary model, from the same forward
                (aloss, am), agrads = jax.value_and_grad(self.aux.loss, has_aux=True)(
                    aux.params, AuxInputs(st.params, hidden), mb, self.obj_cfg, self.aux_ctx)
                aparams, aopt, _, aok = update(aux.params, aux.opt_state, agrads, aloss)
                aux = AuxState(aparams, aopt)
                metrics.update(am)
                ok = ok & aok
            st = st.replace(params=params, opt_state=opt_state, step=st.step + 1, aux=aux,
                            skipped=st.skipped + (~ok).astype(jnp.int32))
            return st, (metrics, stats, rng)

        state, (ms, stats, rngs) = jax.lax.scan(one, state, (mbs, plan))
        # The objective's metrics for all M updates at once, after the loop: inside it every masked
        # mean over the sharded batch was an all-reduce, a rendezvous of the processes, per update.
        if self._gather_metrics:
            stats, mbs = minibatches.replicate_rows((stats, mbs), 1, sharding.replicated(self.mesh))
        ms.update(jax.vmap(self._metrics, in_axes=(0, 0, None, 0))(stats, mbs, state.version, rngs))
        metrics = step_metrics.reduce_minibatches(ms)
        metrics["param_norm"] = optax.global_norm(state.params)
        metrics["trained_tokens"] = mbs.loss_mask.sum()  # on the gathered rows: no extra rendezvous
        return state.replace(version=state.version + 1), metrics

    # ------------------------------------------------------------------ host API
    def prepare(self, state: TrainState, batch: TrajectoryBatch):
        """Validate, plan the packing, shard, and run the extra passes the objective needs.
        Returns (batch, plan or None, timings)."""
        batch.validate()
        b = batch.shape[0] * distributed.count()  # every process contributes its rows
        if b % self.cfg.num_minibatches:
            raise ValueError(f"TrajectoryBatch.tokens: {b} sequences do not split into "
                             f"num_minibatches={self.cfg.num_minibatches}")
        if batch.input_mask is None:
            batch = batch.replace(input_mask=jnp.ones(batch.shape, jnp.float32))
        plan = None
        if (self.cfg.packing == "auto" and distributed.count() == 1
                and batch.shape[1] >= self.cfg.get("packing_min_len", 0)):
            plan = packing.plan(jax.device_get(batch.input_mask), self.cfg.num_minibatches,
                                multiple=sharding.batch_size(self.mesh))
        batch = minibatches.host_layout(batch, self.cfg.num_minibatches, sharding.batch_size(self.mesh),
                                        distributed.count(), distributed.index())
        batch = sharding.shard_batch(batch, self.mesh)
        if plan is not None:  # packed rows split over the batch axes like the batch's rows
            row_sh = NamedSharding(self.mesh, P(None, sharding.BATCH_AXES))
            plan = plan.replace(src=jax.device_put(plan.src, row_sh), segment=jax.device_put(plan.segment, row_sh),
                                position=jax.device_put(plan.position, row_sh),
                                dst=jax.device_put(plan.dst, sharding.replicated(self.mesh)))
        timings = {}
        if "prox_logp" in self.needs:
            t = time.perf_counter()
            prox, prox_topk = jax.block_until_ready(self._prox(state.params, batch, plan))
            timings["prox_time_s"] = time.perf_counter() - t
            batch = batch.replace(prox_logp=prox, prox_topk_logp=prox_topk)
        else:
            timings["prox_time_s"] = 0.0
        if "ref_logp" in self.needs:
            batch = batch.replace(ref_logp=self._ref(state.ref_params, batch, plan))
        return batch, plan, timings

    def lower_step(self, state: TrainState, batch: TrajectoryBatch):
        """`train_step`'s program, lowered and not run (its memory analysis, its HLO)."""
        batch, plan, _ = self.prepare(state, batch)
        return self._step.lower(state, batch, plan)

    def train_step(self, state: TrainState, batch: TrajectoryBatch):
        """One training step (num_minibatches updates). Returns (new_state, metrics)."""
        t0 = time.perf_counter()
        batch, plan, timings = self.prepare(state, batch)
        state, metrics = self._step(state, batch, plan)
        metrics = jax.device_get(metrics)
        tokens = float(metrics.pop("trained_tokens"))  # over the global batch, from the step itself
        if self.cfg.ref_swap_every and int(state.version) % self.cfg.ref_swap_every == 0:
            state = state.replace(ref_params=jax.tree_util.tree_map(jnp.copy, state.params))
        elapsed = time.perf_counter() - t0
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(timings, step_time_s=elapsed, skipped_updates=float(state.skipped),
                       version=float(state.version),
                       tokens_per_s=tokens / elapsed)
        return state, metrics


def _per_leaf(shardings, tree):
    """One sharding for every leaf of `tree`, or already a tree of them."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map(lambda _: shardings, tree)
    return shardings


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
