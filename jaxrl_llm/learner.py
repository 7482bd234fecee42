"""TrainState and the sharded, jitted learner step.

One training step consumes one TrajectoryBatch in `num_minibatches` gradient updates and
advances the policy version by one: version = number of completed training steps, and the
sampler's params carry the version they were published with (so staleness d = learner version
- token version). `step` counts optimizer updates (it drives the LR schedule).

Extra passes run only when the objective needs them (`objective.needs`):
  prox_logp  -> a separate jitted forward before the minibatch loop (timed: prox_time_s);
  ref_logp   -> a jitted forward of the frozen reference params (kl.coef > 0), swapped for the
                current params every `ref_swap_every` steps (seed 003 Algorithm 1);
  a3po       -> neither: pi_prox is interpolated inside the loss, no extra forward is traced.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from jaxrl_llm import objectives, sharding
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.models import decoder, heads
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.objectives.common import masked_mean
from jaxrl_llm.objectives.jackpot import actor_ppo_loss


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # optimizer updates so far
    version: jax.Array  # completed training steps
    rng: jax.Array  # raw uint32[2] key (checkpoint friendly)
    skipped: jax.Array  # updates skipped for non-finite loss / grads
    ref_params: Any = None
    actor_params: Any = None  # Jackpot: the smaller rollout model, trained jointly
    actor_opt_state: Any = None
    actor_version: Any = None


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.lr = 1e-5
    c.b1, c.b2, c.eps, c.weight_decay = 0.9, 0.999, 1e-8, 0.0
    c.max_grad_norm = 1.0
    c.schedule = "constant"  # constant | cosine (with warmup_steps, total_steps updates)
    c.warmup_steps = 0
    c.total_steps = 1000
    c.num_minibatches = 4  # the A-3PO paper uses 4
    c.temperature = 1.0  # must equal the sampler's
    c.logprob_chunk = 128
    c.ref_swap_every = 0  # S: copy params into the reference every S steps (0: never)
    c.distill_coef = 1.0  # Jackpot lambda_distill for the actor
    c.seed = 0
    return c


def make_optimizer(c) -> optax.GradientTransformation:
    if c.schedule == "constant":
        lr = optax.warmup_constant_schedule(0.0, c.lr, c.warmup_steps) if c.warmup_steps else c.lr
    elif c.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(c.total_steps, c.warmup_steps + 1))
    else:
        raise ValueError(f"unknown schedule {c.schedule!r}; valid: constant, cosine")
    return optax.chain(optax.clip_by_global_norm(c.max_grad_norm),
                       optax.adamw(lr, c.b1, c.b2, c.eps, weight_decay=c.weight_decay))


def _finite(tree):
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def _select(ok, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)


def _reduce_metrics(ms):
    """Per-minibatch metrics [M] -> one number each (max/min keep their meaning)."""
    out = {}
    for k, v in ms.items():
        out[k] = v.max() if k.endswith("/max") else v.min() if k.endswith("/min") else v.mean()
    return out


def required_passes(objective, cfg) -> frozenset:
    """What the learner must compute for `objective` under `cfg`: its registered needs,
    refined by options (Jackpot's p_ref / p_target, a KL reference)."""
    needs = set(objective.needs)
    if cfg.name == "jackpot":
        if cfg.jackpot.p_ref == "current":
            needs.discard("prox_logp")  # p_ref = sg(pi_theta): no recompute pass
        elif cfg.jackpot.p_target == "ref":
            needs.add("prox_topk_logp")  # Z_approx needs p_ref on the behaviour top-K
    if cfg.kl.coef > 0:
        needs.add("ref_logp")
    return frozenset(needs)


class Learner:
    """Builds the jitted passes for one (model, objective, mesh) and runs training steps."""

    def __init__(self, model_cfg: ModelConfig, objective_cfg, learner_cfg=None, mesh=None, mesh_cfg=None,
                 actor_cfg: Optional[ModelConfig] = None):
        self.model_cfg, self.actor_cfg = model_cfg, actor_cfg
        self.cfg = learner_cfg or default_config()
        self.obj_cfg = objectives.make_config(objective_cfg)
        self.objective = objectives.get(self.obj_cfg.name)
        self.needs = required_passes(self.objective, self.obj_cfg)
        self.opt = make_optimizer(self.cfg)
        self.mesh = mesh or sharding.make_mesh(mesh_cfg)
        self.param_sh = sharding.param_shardings(decoder.logical_axes(model_cfg), self.mesh, mesh_cfg)
        self.actor_sh = (sharding.param_shardings(decoder.logical_axes(actor_cfg), self.mesh, mesh_cfg)
                         if actor_cfg else None)
        self.forward_traces = 0  # policy forwards traced (a3po must add none)
        self._prox = jax.jit(self._prox_pass)
        self._ref = jax.jit(self._ref_pass)
        self._step = None  # built by place(): needs the state's shardings
        self.step_traces = 0

    # ------------------------------------------------------------------ state
    def init(self, key, params=None, actor_params=None) -> TrainState:
        """Params are created directly in their shardings (or moved there when given)."""
        mc = self.model_cfg
        if params is None:
            params = jax.jit(lambda k: decoder.init_params(mc, k), out_shardings=self.param_sh)(key)
        else:
            params = self._own(params, self.param_sh)
        opt_state = self._opt_init(params, self.param_sh)
        kw = {}
        if self.actor_cfg is not None:
            if actor_params is None:
                actor_params = jax.jit(lambda k: decoder.init_params(self.actor_cfg, k),
                                       out_shardings=self.actor_sh)(jax.random.fold_in(key, 1))
            else:
                actor_params = self._own(actor_params, self.actor_sh)
            kw = dict(actor_params=actor_params, actor_opt_state=self._opt_init(actor_params, self.actor_sh),
                      actor_version=jnp.zeros((), jnp.int32))
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
        return jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p), out_shardings=shardings)(params)

    def _opt_init(self, params, param_sh):
        """Optimizer state created in place: moments sharded like their params, counters replicated."""
        abstract = jax.eval_shape(self.opt.init, params)
        rep = sharding.replicated(self.mesh)
        out_sh = optax.tree_map_params(self.opt, lambda _, sh: sh, abstract, param_sh,
                                       transform_non_params=lambda _: rep)
        return jax.jit(self.opt.init, out_shardings=out_sh)(params)

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
    def _stats(self, params, batch, topk=0, gather=True, return_hidden=False):
        self.forward_traces += 1
        gather_ids = batch.topk_ids if gather and batch.topk > 0 else None
        return heads.sequence_logprobs(params, self.model_cfg, batch.tokens, batch.input_mask,
                                       temperature=self.cfg.temperature, topk=topk, gather_ids_BxLxK=gather_ids,
                                       chunk=self.cfg.logprob_chunk, return_hidden=return_hidden)

    def _prox_pass(self, params, batch):
        """pi_prox = the policy at the start of the step (decoupled PPO's recompute pass)."""
        s = self._stats(params, batch, gather="prox_topk_logp" in self.needs)
        return s["logp"], s.get("logp_at_ids")

    def _ref_pass(self, ref_params, batch):
        return self._stats(ref_params, batch, gather=False)["logp"]

    def _loss(self, params, batch, version, rng):
        """Objective loss; aux = (metrics, sg(final hidden states)), the latter reused by the
        Jackpot actor's distillation instead of a second policy forward."""
        topk = batch.topk if "topk" in self.needs else 0
        s = self._stats(params, batch, topk=topk, return_hidden=self.actor_cfg is not None)
        policy = PolicyOutput(logp=s["logp"], version=version, entropy=s["entropy"],
                              logp_at_behav_topk=s.get("logp_at_ids"), topk_ids=s.get("topk_ids"),
                              topk_logp=s.get("topk_logp"), rng=rng)
        loss, metrics = self.objective(policy, batch, self.obj_cfg)
        mask = batch.loss_mask
        lp = jax.lax.stop_gradient(s["logp"])
        metrics["kl_behav/sampled"] = masked_mean(batch.behav_logp - lp, mask)  # E_behav[log b - log theta]
        if "logp_at_ids" in s:
            pb = jnp.exp(batch.topk_logp)
            kl = (pb * (batch.topk_logp - jax.lax.stop_gradient(s["logp_at_ids"]))).sum(-1)
            metrics["kl_behav/topk"] = masked_mean(kl, mask)
        return loss, (metrics, jax.lax.stop_gradient(s.get("hidden")))

    def _actor_loss(self, actor_params, params, hidden_new, batch):
        """Jackpot Eq. 6 + lambda_distill * Eq. 7 for the rollout model; `hidden_new` are the
        policy's final hidden states from this update's forward (no second policy pass)."""
        a = self.actor_cfg
        h_act = decoder.forward(actor_params, a, batch.tokens, batch.input_mask)[:, :-1]
        w_act = decoder.unembed_matrix(actor_params, a)
        stats = heads.logprob_stats(h_act, w_act, batch.tokens[:, 1:], temperature=self.cfg.temperature,
                                    entropy=False, chunk=self.cfg.logprob_chunk)
        logp = jnp.pad(stats["logp"], [(0, 0), (1, 0)])
        ppo, m = actor_ppo_loss(logp, batch, self.obj_cfg)
        kl = heads.distill_kl(hidden_new[:, :-1], decoder.unembed_matrix(params, self.model_cfg), h_act, w_act,
                              temperature=self.cfg.temperature, chunk=self.cfg.logprob_chunk)
        kl = jnp.pad(kl, [(0, 0), (1, 0)])
        distill = masked_mean(kl, batch.loss_mask)
        m["actor/distill_kl"] = distill
        return ppo + self.cfg.distill_coef * distill, m

    def _train_step(self, state: TrainState, batch: TrajectoryBatch):
        self.step_traces += 1
        m_count = self.cfg.num_minibatches
        mbs = jax.tree_util.tree_map(lambda x: x.reshape(m_count, x.shape[0] // m_count, *x.shape[1:]), batch)

        def update(params, opt_state, grads, loss):
            ok = jnp.isfinite(loss) & _finite(grads)
            updates, new_opt = self.opt.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            return _select(ok, new_params, params), _select(ok, new_opt, opt_state), ok, updates

        def one(carry, mb):
            st = carry
            rng = jax.random.fold_in(st.rng, st.step)
            (loss, (metrics, hidden)), grads = jax.value_and_grad(self._loss, has_aux=True)(
                st.params, mb, st.version, rng)
            params, opt_state, ok, updates = update(st.params, st.opt_state, grads, loss)
            metrics.update({"grad_norm": optax.global_norm(grads), "update_norm": optax.global_norm(updates)})
            kw = {}
            if self.actor_cfg is not None:
                (aloss, am), agrads = jax.value_and_grad(self._actor_loss, has_aux=True)(
                    st.actor_params, st.params, hidden, mb)
                aparams, aopt, aok, _ = update(st.actor_params, st.actor_opt_state, agrads, aloss)
                kw = dict(actor_params=aparams, actor_opt_state=aopt)
                metrics.update(am)
                ok = ok & aok
            st = st.replace(params=params, opt_state=opt_state, step=st.step + 1,
                            skipped=st.skipped + (~ok).astype(jnp.int32), **kw)
            return st, metrics

        state, ms = jax.lax.scan(one, state, mbs)
        metrics = _reduce_metrics(ms)
        metrics["param_norm"] = optax.global_norm(state.params)
        state = state.replace(version=state.version + 1)
        if self.actor_cfg is not None:
            state = state.replace(actor_version=state.actor_version + 1)
        return state, metrics

    # ------------------------------------------------------------------ host API
    def prepare(self, state: TrainState, batch: TrajectoryBatch):
        """Validate, shard, and run the extra passes the objective needs. Returns (batch, timings)."""
        batch.validate()
        b = batch.shape[0]
        if b % self.cfg.num_minibatches:
            raise ValueError(f"TrajectoryBatch.tokens: {b} sequences do not split into "
                             f"num_minibatches={self.cfg.num_minibatches}")
        if batch.input_mask is None:
            batch = batch.replace(input_mask=jnp.ones(batch.shape, jnp.float32))
        batch = sharding.shard_batch(batch, self.mesh)
        timings = {}
        if "prox_logp" in self.needs:
            t = time.perf_counter()
            prox, prox_topk = jax.block_until_ready(self._prox(state.params, batch))
            timings["prox_time_s"] = time.perf_counter() - t
            batch = batch.replace(prox_logp=prox, prox_topk_logp=prox_topk)
        else:
            timings["prox_time_s"] = 0.0
        if "ref_logp" in self.needs:
            batch = batch.replace(ref_logp=self._ref(state.ref_params, batch))
        return batch, timings

    def train_step(self, state: TrainState, batch: TrajectoryBatch):
        """One training step (num_minibatches updates). Returns (new_state, metrics)."""
        t0 = time.perf_counter()
        batch, timings = self.prepare(state, batch)
        state, metrics = self._step(state, batch)
        metrics = jax.device_get(metrics)
        if self.cfg.ref_swap_every and int(state.version) % self.cfg.ref_swap_every == 0:
            state = state.replace(ref_params=jax.tree_util.tree_map(jnp.copy, state.params))
        elapsed = time.perf_counter() - t0
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(timings, step_time_s=elapsed, skipped_updates=float(state.skipped),
                       version=float(state.version),
                       tokens_per_s=float(np.asarray(batch.loss_mask).sum()) / elapsed)
        return state, metrics
