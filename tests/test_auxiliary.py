"""An objective with its own auxiliary model, registered from outside the package: a value head
on the policy's hidden states, trained jointly by the learner with no edit to the core."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.learner import learner as L
from jaxrl_llm import objectives, testing
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.objectives import common

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8)


def value_loss(params, inputs, batch, cfg, ctx):
    """Squared error of a linear value head V(h_t) against the sequence's reward, on loss tokens."""
    v_BxL = (inputs.hidden_BxLxD @ params["w"])[..., 0] + params["b"]
    err = jnp.square(v_BxL - batch.rewards[:, None])
    loss = common.masked_mean(err, batch.loss_mask)
    return loss, {"value/mse": loss}


VALUE = objectives.Auxiliary(
    name="value",
    init=lambda key, ctx: {"w": 0.01 * jax.random.normal(key, (ctx.policy_cfg.hidden_size, 1)), "b": jnp.zeros(())},
    loss=value_loss,
)


@pytest.fixture(scope="module")
def ppo_with_value():
    objectives.register("ppo_with_value", aux=VALUE)(lambda policy, batch, cfg: objectives.get("ppo")(policy, batch, cfg))
    yield "ppo_with_value"
    objectives.unregister("ppo_with_value")


def test_registered_value_head_is_trained_jointly(ppo_with_value):
    c = L.default_config()
    c.lr, c.num_minibatches = 3e-2, 2
    lrn = L.Learner(CFG, {"name": ppo_with_value}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    state = lrn.init(jax.random.key(0))
    assert set(state.aux.params) == {"w", "b"} and state.aux.opt_state is not None
    assert lrn.rollout_params(state) is state.params  # the value head does not sample
    batch = testing.model_batch(state.params, CFG, seed=1)
    hidden = decoder.forward(state.params, CFG, batch.tokens, batch.input_mask)

    def mse(aux_params):  # NumPy reference of the head's error at the current policy
        v = np.asarray(hidden, np.float64) @ np.asarray(aux_params["w"], np.float64)
        v = v[..., 0] + float(aux_params["b"])
        m = np.asarray(batch.loss_mask, np.float64)
        return float(((v - np.asarray(batch.rewards)[:, None]) ** 2 * m).sum() / m.sum())

    first = mse(state.aux.params)
    embed0 = np.asarray(state.params["embed"])  # the step donates its state
    for _ in range(6):
        state, m = lrn.train_step(state, batch)
    assert "value/mse" in m and "clip_frac" in m  # both losses ran
    assert float(m["value/mse"]) < first
    assert not np.allclose(embed0, np.asarray(state.params["embed"]))


def test_a_model_for_an_objective_without_auxiliary_is_refused():
    with pytest.raises(ValueError, match="trains no auxiliary model.*objectives that train one: jackpot"):
        L.Learner(CFG, {"name": "ppo"}, aux_model_cfg=CFG)
