"""TrainState and how it is made: created in its shardings, described without allocating (the
template a checkpoint restores into), or taken over from host params."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm.models import lora


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one learner's state is made: the optimizer, the models' initialisers and shardings."""

    opt: optax.GradientTransformation
    mesh: Any
    init_params: Callable  # key -> policy params
    param_sh: Any  # a sharding, or a tree of them like the params
    seed: int
    with_ref: bool  # the objective reads ref_logp: a frozen reference copy
    init_aux: Optional[Callable] = None  # key -> the objective's auxiliary params
    aux_sh: Any = None
    lora: bool = False  # params are LoRA adapters (`models/lora.py`); the frozen base is not state
    base_sh: Any = None  # with lora: the base's shardings (its logical-axis rules)


def init(layout: Layout, key, params=None, aux_params=None) -> TrainState:
    """Params are created directly in their shardings (or copied there when given)."""
    if params is None:
        params = jax.jit(layout.init_params, out_shardings=layout.param_sh)(key)
    else:
        params = own(params, layout.param_sh)
    kw = {}
    if layout.init_aux is not None:
        if aux_params is None:
            aux_params = jax.jit(layout.init_aux, out_shardings=layout.aux_sh)(jax.random.fold_in(key, 1))
        else:
            aux_params = own(aux_params, layout.aux_sh)
        kw["aux"] = AuxState(aux_params, _opt_init(layout, aux_params, layout.aux_sh))
    if layout.with_ref:  # with LoRA: the adapters disabled (B = 0), i.e. the base, at adapter size
        kw["ref_params"] = lora.disabled(params) if layout.lora else jax.tree_util.tree_map(jnp.copy, params)
    return TrainState(params=params, opt_state=_opt_init(layout, params, layout.param_sh),
                      step=jnp.zeros((), jnp.int32), version=jnp.zeros((), jnp.int32),
                      rng=jax.random.PRNGKey(layout.seed), skipped=jnp.zeros((), jnp.int32), **kw)


def abstract(layout: Layout) -> TrainState:
    """`init`'s state as ShapeDtypeStructs in its shardings, nothing allocated: the template
    a checkpoint restores into (a concrete one would hold a second state during the read)."""
    rep = sharding.replicated(layout.mesh)
    key = jax.random.key(0)

    def structs(tree, shardings):
        return jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                      tree, shardings)

    def model(init_fn, shardings):
        params = jax.eval_shape(init_fn, key)
        sh = per_leaf(shardings, params)
        opt = jax.eval_shape(layout.opt.init, params)
        return structs(params, sh), structs(opt, _opt_shardings(layout, opt, sh))

    params, opt_state = model(layout.init_params, layout.param_sh)
    kw = {}
    if layout.init_aux is not None:
        kw["aux"] = AuxState(*model(layout.init_aux, layout.aux_sh))
    if layout.with_ref:
        kw["ref_params"] = params
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    rng = jax.eval_shape(lambda: jax.random.PRNGKey(layout.seed))
    return TrainState(params=params, opt_state=opt_state, step=scalar, version=scalar, skipped=scalar,
                      rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=rep), **kw)


def shardings(mesh, state: TrainState):
    """Each leaf's sharding: params and optimizer keep theirs, the rest is replicated."""
    rep = sharding.replicated(mesh)

    def sh(x):
        s = getattr(x, "sharding", None)
        return s if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh else rep

    return jax.tree_util.tree_map(sh, state)


def own(params, shardings):
    """A private copy in `shardings`: the step donates its state, so the caller's arrays
    (e.g. the sampler's published params) must not be aliased."""
    if distributed.count() > 1:  # host values every process holds -> global arrays
        return distributed.put_global(jax.device_get(params), shardings)
    return jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p), out_shardings=shardings)(params)


def _opt_shardings(layout: Layout, abstract_opt, param_sh):
    """Moments sharded like their params (`param_sh`: a tree), counters replicated."""
    rep = sharding.replicated(layout.mesh)
    return optax.tree_map_params(layout.opt, lambda _, sh: sh, abstract_opt, param_sh,
                                 transform_non_params=lambda _: rep)


def _opt_init(layout: Layout, params, param_sh):
    """Optimizer state created in place."""
    out_sh = _opt_shardings(layout, jax.eval_shape(layout.opt.init, params), per_leaf(param_sh, params))
    return jax.jit(layout.opt.init, out_shardings=out_sh)(params)


def per_leaf(shardings, tree):
    """One sharding for every leaf of `tree`, or already a tree of them."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map(lambda _: shardings, tree)
    return shardings
