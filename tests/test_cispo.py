"""CISPO (MiniMax-M1, arXiv:2506.13585): properties of the clipped, stop-gradient IS weight
(the loss and gradient against NumPy are in test_objectives)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm import objectives as O
from jaxrl_llm import testing

drift = st.lists(st.floats(-0.125, 0.125, width=32, allow_subnormal=False), min_size=12 * 12, max_size=12 * 12)


def _grad(name, cfg, s, logp):
    return np.asarray(jax.grad(lambda lp: O.get(name)(s.policy.replace(logp=lp), s.batch, cfg)[0])(logp))


@settings(max_examples=25, deadline=None)
@given(drift)
def test_without_clipping_cispo_is_importance_weighted_reinforce(d):
    """No weight clipped (all r inside [1 - eps_low, 1 + eps_high]): the gradient is that of
    -(pi_theta / pi_behav) A, REINFORCE with importance weights (grad r = r grad log pi)."""
    s = testing.random_batch(1)
    logp = s.batch.behav_logp + jnp.asarray(np.reshape(d, s.batch.behav_logp.shape), jnp.float32)
    cfg = O.make_config(name="cispo", cispo__eps_low=0.5, cispo__eps_high=0.5)  # |log r| <= 0.125 stays inside
    mask = s.batch.loss_mask

    def reinforce(lp):
        r = jnp.exp(lp - s.batch.behav_logp)
        return -(r * s.batch.advantages * mask).sum() / mask.sum()

    np.testing.assert_allclose(_grad("cispo", cfg, s, logp), np.asarray(jax.grad(reinforce)(logp)), rtol=1e-5,
                               atol=1e-7)


def test_clipped_tokens_keep_a_gradient_where_ppo_drops_them():
    """The point of CISPO: a token whose ratio left the trust region still gets gradient,
    scaled by the capped weight; PPO's clip zeroes it."""
    s = testing.random_batch(3, drift=0.6)
    logp = s.policy.logp
    r = np.exp(np.asarray(logp - s.batch.behav_logp))
    adv, mask = np.asarray(s.batch.advantages), np.asarray(s.batch.loss_mask) > 0
    out = mask & (((r > 1.2) & (adv > 0)) | ((r < 0.8) & (adv < 0))) & (adv != 0)
    assert out.any()
    g_ppo = _grad("ppo", O.make_config(name="ppo"), s, logp)
    g_cispo = _grad("cispo", O.make_config(name="cispo", cispo__eps_low=0.2, cispo__eps_high=0.2), s, logp)
    assert np.all(g_ppo[out] == 0) and np.all(g_cispo[out] != 0)
    w = np.clip(r, 0.8, 1.2)  # the gradient is -w A / n on every loss token
    np.testing.assert_allclose(g_cispo[mask], (-w * adv / mask.sum())[mask], rtol=1e-5, atol=1e-8)
