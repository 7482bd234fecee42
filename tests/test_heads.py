"""Chunked float32 log-prob heads vs a full log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import heads
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist


def _full(hidden, w, targets, temperature):
    logp = jax.nn.log_softmax((hidden @ w) / temperature, -1)
    return logp, jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_stats_match_full_log_softmax(chunk):
    k = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(k[0], (2, 37, 16))
    w = jax.random.normal(k[1], (16, 50))
    targets = jax.random.randint(k[2], (2, 37), 0, 50)
    gather = jax.random.randint(k[3], (2, 37, 3), 0, 50)
    out = heads.logprob_stats(hidden, w, targets, dist=PolicyDist(0.7), topk=5, gather_ids_BxLxK=gather, chunk=chunk)
    logp_all, logp = _full(hidden, w, targets, 0.7)
    np.testing.assert_allclose(out["logp"], logp, atol=1e-5)
    np.testing.assert_allclose(out["entropy"], -(jnp.exp(logp_all) * logp_all).sum(-1), atol=1e-5)
    ref_vals, ref_ids = jax.lax.top_k(logp_all, 5)
    np.testing.assert_array_equal(out["topk_ids"], ref_ids)
    np.testing.assert_allclose(out["topk_logp"], ref_vals, atol=1e-5)
    np.testing.assert_allclose(out["logp_at_ids"], jnp.take_along_axis(logp_all, gather, -1), atol=1e-5)


def test_gradients_match_full_computation():
    k = jax.random.split(jax.random.key(1), 3)
    hidden, w = jax.random.normal(k[0], (3, 20, 8)), jax.random.normal(k[1], (8, 30))
    targets = jax.random.randint(k[2], (3, 20), 0, 30)

    def chunked(h, w):
        o = heads.logprob_stats(h, w, targets, dist=PolicyDist(1.3), chunk=6)
        return o["logp"].sum() + 0.1 * o["entropy"].sum()

    def full(h, w):
        logp_all, logp = _full(h, w, targets, 1.3)
        return logp.sum() + 0.1 * (-(jnp.exp(logp_all) * logp_all).sum())

    for a, b in zip(jax.grad(chunked, (0, 1))(hidden, w), jax.grad(full, (0, 1))(hidden, w)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def _largest_intermediate(jaxpr):
    biggest = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(v.aval, "shape", ()) or (1,))))
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None:
                biggest = max(biggest, _largest_intermediate(getattr(inner, "jaxpr", inner)))
    return biggest


def test_sequence_logprobs_alignment_and_no_full_vocab_tensor():
    cfg = ModelConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    params = models.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 300)
    out = models.sequence_logprobs(params, cfg, tokens, chunk=8, topk=4)
    full = jax.nn.log_softmax(models.full_logits(params, cfg, tokens), -1)
    assert float(jnp.abs(out["logp"][:, 0]).max()) == 0.0
    want = jnp.take_along_axis(full[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(out["logp"][:, 1:], want, atol=1e-5)
    # The whole program (forward + grad) never holds [B, L, V] logits at once.
    fn = lambda p: models.sequence_logprobs(p, cfg, tokens, chunk=8)["logp"].sum()  # noqa: E731
    biggest = _largest_intermediate(jax.make_jaxpr(jax.grad(fn))(params).jaxpr)
    assert biggest < 2 * 32 * 300, biggest
    assert biggest >= 2 * 8 * 300  # one chunk's logits do exist
