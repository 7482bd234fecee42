"""Jackpot's actor-side losses (Jackpot, arXiv:2602.06107, Eq. 6-7): the auxiliary model the learner trains
jointly with the policy."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives as O
from jaxrl_llm import testing
from jaxrl_llm.objectives import jackpot_actor as A
from tests import reference as R


def test_actor_ppo_matches_numpy():
    s = testing.random_batch(0)
    cfg = O.make_config(name="jackpot", jackpot__c1=1.2, clip__eps_high=0.28)
    actor_logp = s.batch.behav_logp + 0.3 * jax.random.normal(jax.random.key(1), s.batch.behav_logp.shape)
    actor_old = s.batch.behav_logp + 0.2 * jax.random.normal(jax.random.key(2), s.batch.behav_logp.shape)
    f = jax.value_and_grad(lambda lp: A.actor_ppo_loss(lp, s.batch, cfg, actor_old)[0])
    loss, grad = f(actor_logp)
    inf, old, a, m = (np.asarray(v, np.float64) for v in (s.batch.behav_logp, actor_old, s.batch.advantages, s.batch.loss_mask))

    def ref(x):
        w = np.minimum(np.exp(old - inf), 1.2)  # Eq. 6's F = TIS(c1)
        return R.agg(w * R.clip_loss(np.exp(x - old), a, 0.8, 1.28), m, "token_mean")

    x0 = np.asarray(actor_logp, np.float64)
    np.testing.assert_allclose(float(loss), ref(x0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), R.fd_grad(ref, x0), rtol=1e-4, atol=2e-6)


def test_distill_kl_value_and_gradient():
    """Eq. 7: KL(sg(p_new) || p_actor); d/d actor_logits = (softmax(actor) - softmax(new)) * m / N,
    and no gradient reaches the policy's logits."""
    rng = np.random.default_rng(0)
    new, actor = rng.normal(size=(2, 3, 4, 9)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    cfg = O.make_config(name="jackpot")
    (loss, metrics), (g_new, g_actor) = jax.value_and_grad(
        lambda n, a: A.distill_loss(n, a, jnp.asarray(mask), cfg), argnums=(0, 1), has_aux=True
    )(jnp.asarray(new), jnp.asarray(actor))

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(new.astype(np.float64)), softmax(actor.astype(np.float64))
    kl = (p * (np.log(p) - np.log(q))).sum(-1)
    np.testing.assert_allclose(float(loss), (kl * mask).sum() / mask.sum(), rtol=1e-5)
    assert float(metrics["actor/distill_kl"]) == float(loss)
    np.testing.assert_allclose(np.asarray(g_actor), (q - p) * mask[..., None] / mask.sum(), atol=1e-6)
    assert np.all(np.asarray(g_new) == 0.0)


def test_distill_lowers_kl_by_gradient_descent():
    rng = np.random.default_rng(1)
    new, actor = (jnp.asarray(rng.normal(size=(2, 5, 11)), jnp.float32) for _ in range(2))
    mask, cfg = jnp.ones((2, 5)), O.make_config(name="jackpot")
    f = jax.jit(jax.value_and_grad(lambda a: A.distill_loss(new, a, mask, cfg)[0]))
    first, _ = f(actor)
    for _ in range(50):
        val, g = f(actor)
        actor = actor - 5.0 * g
    assert float(val) < 0.2 * float(first)
