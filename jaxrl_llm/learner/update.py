"""The learner's training step as a pure function: `train_step(state, batch, packed, plan=...)`.

One step consumes one TrajectoryBatch in `num_minibatches` gradient updates (a `lax.scan`) and
advances the policy version by one: version = completed training steps, and the sampler's
params carry the version they were published with (staleness d = learner version - token
version). `step` counts optimizer updates (it drives the LR schedule).

Extra passes run only when the objective declares them (`objectives.required_passes`):
  prox_logp  -> `prox_pass`, a separate forward before the minibatch loop;
  ref_logp   -> `ref_pass`, a forward of the frozen reference params (kl.coef > 0), swapped for
                the current params every `ref_swap_every` steps (Mroueh et al., "Revisiting Group
                Relative Policy Optimization", arXiv:2505.22257, Algorithm 1);
  neither    -> e.g. a3po: pi_prox is interpolated inside the loss, no extra forward is traced.
An objective that registered an auxiliary model (`objectives.Auxiliary`) has it trained in the
same update, after the policy, from the policy forward's hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.learner import forward, minibatches, packing, step_metrics
from jaxrl_llm.parallel import sharding
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch
from jaxrl_llm.models import lora
from jaxrl_llm.objectives.auxiliary import AuxContext, AuxInputs
from jaxrl_llm.learner.train_state import AuxState, TrainState


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything static about a learner's step, resolved once from the config."""

    fwd: forward.Forward
    objective: Callable  # registered objective (`objectives.get`)
    obj_cfg: Any  # its resolved, frozen config
    needs: frozenset  # `objectives.required_passes`
    opt: optax.GradientTransformation
    num_minibatches: int
    aux: Any = None  # the objective's `Auxiliary`, when in use
    aux_ctx: Optional[AuxContext] = None
    replicas: int = 0  # S > 0: one flat gradient all-reduce over S data shards (CPU)
    gather_metrics: bool = False  # many CPU processes: metrics on a gathered copy of the rows


def make_optimizer(c) -> optax.GradientTransformation:
    if c.schedule == "constant":
        lr = optax.warmup_constant_schedule(0.0, c.lr, c.warmup_steps) if c.warmup_steps else c.lr
    elif c.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(c.total_steps, c.warmup_steps + 1))
    else:
        raise ValueError(f"unknown schedule {c.schedule!r}; valid: constant, cosine")
    return optax.chain(optax.clip_by_global_norm(c.max_grad_norm),
                       optax.adamw(lr, c.b1, c.b2, c.eps, weight_decay=c.weight_decay))


def prox_pass(params, batch: TrajectoryBatch, packed, base=None, *, plan: StepPlan):
    """pi_prox = the policy at the start of the step (decoupled PPO's recompute pass)."""
    s = forward.batch_stats(plan.fwd, params, batch, packed, plan.num_minibatches, gather="prox_topk_logp" in plan.needs,
                            base=base)
    return s["logp"], s.get("logp_at_ids")


def ref_pass(ref_params, batch: TrajectoryBatch, packed, base=None, *, plan: StepPlan):
    """With LoRA `ref_params` are adapters over the frozen `base` (B = 0 at first: the base itself)."""
    return forward.batch_stats(plan.fwd, ref_params, batch, packed, plan.num_minibatches, gather=False, base=base)["logp"]


def _policy(s, version, rng) -> PolicyOutput:
    return PolicyOutput(logp=s["logp"], version=version, entropy=s["entropy"],
                        logp_at_behav_topk=s.get("logp_at_ids"), topk_ids=s.get("topk_ids"),
                        topk_logp=s.get("topk_logp"), rng=rng)


def loss(params, batch: TrajectoryBatch, version, rng, packed=None, replicas=0, *, plan: StepPlan, base=None):
    """Objective loss; aux = (sg(per-token stats) for the metrics, sg(final hidden states)),
    the latter handed to the auxiliary model's loss instead of a second policy forward. With
    LoRA, `params` are the adapters and `base` the frozen rest: gradients reach adapters only."""
    topk = batch.topk if "topk" in plan.needs else 0
    coef = plan.fwd.model_cfg.moe_aux_loss_coef  # a mixture of experts' load balancing (0: off)
    s = forward.stats(plan.fwd, params, batch, topk=topk, return_hidden=plan.aux is not None, packed=packed,
                      replicas=replicas, base=base, balance=coef > 0)
    value, _ = plan.objective(_policy(s, version, rng), batch, plan.obj_cfg)
    if "moe_aux_loss" in s:  # per replica under replicas: their mean, as the objective's value is
        s["moe_aux_loss"] = jnp.mean(s["moe_aux_loss"])
        value = value + coef * s["moe_aux_loss"]
    hidden = s.pop("hidden", None)
    return value, (jax.lax.stop_gradient(s), jax.lax.stop_gradient(hidden))


def _apply(plan: StepPlan, params, opt_state, grads, value):
    """Nothing is applied on a non-finite loss or gradient. A cond, not a select between new
    and old: XLA then updates in place (a select kept ~2.5 extra parameter trees)."""
    def apply(p, o, g):
        updates, new_opt = plan.opt.update(g, o, p)
        return optax.apply_updates(p, updates), new_opt, optax.global_norm(updates)

    ok = jnp.isfinite(value) & step_metrics.finite(grads)
    return (*jax.lax.cond(ok, apply, lambda p, o, _: (p, o, jnp.float32(0.0)), params, opt_state, grads), ok)


def train_step(state: TrainState, batch: TrajectoryBatch, packed: Optional[packing.PackLayout] = None, base=None, *,
               plan: StepPlan):
    """`num_minibatches` updates on `batch` (laid out by `minibatches.host_layout`) -> (state
    with version + 1, metrics). `base`: with LoRA, the frozen weights `state.params` adapt
    (an input, not state: never donated, never checkpointed, no optimizer state)."""
    shards = sharding.batch_size(plan.fwd.mesh)
    mbs = jax.tree_util.tree_map(lambda x: minibatches.split(x, plan.num_minibatches, shards), batch)
    loss_fn = functools.partial(loss, plan=plan, base=base)

    def one(st, xs):
        mb, pl = xs
        rng = jax.random.fold_in(st.rng, st.step)
        if plan.replicas and pl is None and mb.shape[0] % plan.replicas == 0:
            (value, (stats, hidden)), grads = minibatches.replica_value_and_grad(
                loss_fn, st.params, plan.replicas, plan.fwd.on_shards, mb, st.version, rng, replicas=plan.replicas)
        else:
            (value, (stats, hidden)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                st.params, mb, st.version, rng, pl)
        params, opt_state, update_norm, ok = _apply(plan, st.params, st.opt_state, grads, value)
        metrics = {"grad_norm": optax.global_norm(grads), "update_norm": update_norm}
        aux = st.aux
        if plan.aux is not None:  # the objective's auxiliary model, from the same forward
            (aloss, am), agrads = jax.value_and_grad(plan.aux.loss, has_aux=True)(
                aux.params, AuxInputs(st.params if base is None else lora.combine(base, st.params), hidden), mb,
                plan.obj_cfg, plan.aux_ctx)
            aparams, aopt, _, aok = _apply(plan, aux.params, aux.opt_state, agrads, aloss)
            aux = AuxState(aparams, aopt)
            metrics.update(am)
            ok = ok & aok
        st = st.replace(params=params, opt_state=opt_state, step=st.step + 1, aux=aux,
                        skipped=st.skipped + (~ok).astype(jnp.int32))
        return st, (metrics, stats, rng)

    state, (ms, stats, rngs) = jax.lax.scan(one, state, (mbs, packed))
    if "moe_aux_loss" in stats:  # [M]: one per update
        ms["moe/aux_loss"] = stats.pop("moe_aux_loss")
    # The objective's metrics for all M updates at once, after the loop: inside it every masked
    # mean over the sharded batch was an all-reduce, a rendezvous of the processes, per update.
    if plan.gather_metrics:
        stats, mbs = minibatches.replicate_rows((stats, mbs), 1, sharding.replicated(plan.fwd.mesh))
    of_update = lambda s, b, v, r: step_metrics.of_update(plan.objective, plan.obj_cfg, _policy(s, v, r), b)  # noqa: E731
    ms.update(jax.vmap(of_update, in_axes=(0, 0, None, 0))(stats, mbs, state.version, rngs))
    if "routing_differs" in stats:  # a mixture of experts with the sampler's routing
        ms.update(jax.vmap(step_metrics.routing, in_axes=(0, 0, None))(stats["routing_differs"], mbs,
                                                                      mbs.routing.shape[-2]))
    metrics = step_metrics.reduce_minibatches(ms)
    metrics["param_norm"] = optax.global_norm(state.params)
    metrics["trained_tokens"] = mbs.loss_mask.sum()  # on the gathered rows: no extra rendezvous
    return state.replace(version=state.version + 1), metrics
