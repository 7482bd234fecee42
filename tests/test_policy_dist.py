"""One sampling distribution on both sides: tokens sampled under temperature / top-k / top-p and
evaluated by the learner at the same params have ratio 1, for every objective; the learner's
truncation (`policy_dist.restrict`) against a NumPy reference, finite where the drawn token
left pi_theta's kept set; the full-softmax option's ratio is the kept mass."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.learner import learner as L
from jaxrl_llm import models, objectives
from jaxrl_llm.parallel import sharding
from jaxrl_llm.batch import PolicyOutput
from jaxrl_llm.models import heads, policy_dist
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.rollout import Sampler, SamplerConfig
from tests import hf_fixtures as F

PROMPTS = [[5, 9, 2, 33, 4], [7] * 9, [1, 2, 3], [60, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
GRID = list(itertools.product((0.7, 1.0), (0, 20), (0.9, 1.0)))


@pytest.fixture(scope="module")
def qwen256(tmp_path_factory):
    model = F.make_hf_model("qwen2_tied", vocab=256, seed=4)
    return models.load_params(F.save(model, str(tmp_path_factory.mktemp("q256"))))


def _sample(params, cfg, dist: PolicyDist, topk=4, seed=0):
    scfg = SamplerConfig(max_new_tokens=12, temperature=dist.temperature, top_k=dist.top_k, top_p=dist.top_p,
                         capture_topk=topk, num_samples=2, prompt_buckets=(16,), decode_segment=5)
    return Sampler(cfg, scfg).generate(params, PROMPTS, jax.random.key(seed), version=0).validate()


def _stats(params, cfg, batch, dist, topk=0):
    return heads.sequence_logprobs(params, cfg, batch.tokens, batch.input_mask, dist=dist, kept_BxL=batch.behav_kept,
                                   topk=topk, gather_ids_BxLxK=batch.topk_ids)


@pytest.mark.parametrize("temperature,top_k,top_p", GRID)
def test_on_policy_ratio_is_one_for_every_sampling_option(qwen256, temperature, top_k, top_p):
    params, cfg = qwen256
    dist = PolicyDist(temperature, top_k, top_p)
    batch = _sample(params, cfg, dist)
    gen = np.asarray(batch.loss_mask) > 0
    s = _stats(params, cfg, batch, dist)
    diff = np.abs(np.asarray(s["logp"]) - np.asarray(batch.behav_logp))[gen]
    assert gen.sum() == 96 and diff.max() <= 1e-5, diff.max()
    # The behaviour top-K agrees too (-inf outside the truncated support on both sides).
    np.testing.assert_allclose(np.asarray(s["logp_at_ids"])[gen], np.asarray(batch.topk_logp)[gen], atol=1e-5)
    # The full temperature softmax is the other option: its ratio is the kept mass, < 1 when truncated.
    full = np.asarray(_stats(params, cfg, batch, PolicyDist(temperature))["logp"])
    log_r = (full - np.asarray(batch.behav_logp))[gen]
    if dist.truncated:
        assert log_r.max() < -1e-3, "the full softmax must under-weight truncated draws"
    else:
        assert np.abs(log_r).max() <= 1e-5


def test_without_a_record_the_learner_reapplies_the_samplers_rule(qwen256):
    params, cfg = qwen256
    dist = PolicyDist(1.0, 20, 0.9)
    batch = _sample(params, cfg, dist)
    gen = np.asarray(batch.loss_mask) > 0
    s = _stats(params, cfg, batch.replace(behav_kept=None), dist)
    # Rank vs mass rule: equal unless a boundary token flips; on this batch none does.
    np.testing.assert_allclose(np.asarray(s["logp"])[gen], np.asarray(batch.behav_logp)[gen], atol=1e-5)


def _restrict_reference(logits, n, target, temperature):
    """NumPy: keep the n largest scaled logits and the target, renormalise (n <= 0: all)."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones_like(x, bool) if n <= 0 else x >= np.sort(x)[::-1][n - 1]
    keep[target] = True
    z = np.log(np.exp(x[keep] - x[keep].max()).sum()) + x[keep].max()
    return x[target] - z


@pytest.mark.parametrize("top_k,top_p", [(6, 1.0), (0, 0.8), (6, 0.8)])
def test_restrict_matches_numpy_and_stays_finite_outside_the_kept_set(top_k, top_p):
    rng = np.random.default_rng(0)
    d, v, length = 8, 40, 6
    h = rng.normal(size=(2, length, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    logits = h @ w
    dist = PolicyDist(0.8, top_k, top_p)
    n = rng.integers(1, top_k or v, (2, length)).astype(np.int32)
    n[0, 0] = 0  # a prompt/pad position: no truncation
    # Half the targets lie outside the kept top-n: their log-prob must be finite (floor rule).
    ranks = np.argsort(-logits, -1)
    targets = np.where(rng.random((2, length)) < 0.5, ranks[..., 0], ranks[..., -1]).astype(np.int32)
    got = heads.logprob_stats(jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets), dist=dist,
                              kept_BxL=jnp.asarray(n), chunk=4)["logp"]
    ref = np.vectorize(lambda b, t: _restrict_reference(logits[b, t], n[b, t], targets[b, t], 0.8))(
        *np.indices((2, length)))
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5)

    def total(hh):
        out = heads.logprob_stats(hh, jnp.asarray(w), jnp.asarray(targets), dist=dist, kept_BxL=jnp.asarray(n), chunk=4)
        return out["logp"].sum() + out["entropy"].sum()

    g = jax.grad(total)(jnp.asarray(h))
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def _policy(stats, rng):
    return PolicyOutput(logp=stats["logp"], version=jnp.int32(0), entropy=stats["entropy"],
                        logp_at_behav_topk=stats["logp_at_ids"], rng=rng)


def test_every_objective_sees_on_policy_data_as_on_policy(qwen256):
    """At unchanged params each objective's loss on the sampled batch equals its value on the
    same batch with pi_behav (and pi_prox, pi_ref) set to the learner's own log-probs."""
    params, cfg = qwen256
    dist = PolicyDist(0.7, 20, 0.9)
    batch = _sample(params, cfg, dist, topk=8)
    adv = np.random.default_rng(1).normal(size=batch.shape).astype(np.float32)
    batch = batch.replace(advantages=jnp.asarray(adv) * batch.loss_mask)
    s = _stats(params, cfg, batch, dist)
    own = batch.replace(behav_logp=s["logp"] * batch.loss_mask, topk_logp=s["logp_at_ids"])
    key = jax.random.key(3)
    for name in sorted(objectives.registry()):
        ocfg = objectives.make_config(name=name)
        fn = objectives.get(name)
        extra = dict(prox_logp=s["logp"], prox_topk_logp=s["logp_at_ids"], ref_logp=s["logp"])
        got = fn(_policy(s, key), batch.replace(**extra), ocfg)[0]
        want = fn(_policy(s, key), own.replace(**extra), ocfg)[0]
        np.testing.assert_allclose(float(got), float(want), atol=1e-5, err_msg=name)
    # The check can fail: under the full softmax the same data looks off-policy to PPO.
    full = heads.sequence_logprobs(params, cfg, batch.tokens, batch.input_mask, dist=PolicyDist(0.7))
    _, m = objectives.get("ppo")(_policy(full | {"logp_at_ids": s["logp_at_ids"]}, key), batch,
                                 objectives.make_config(name="ppo"))
    assert float(m["clip_frac"]) > 0.3


@pytest.mark.parametrize("policy_dist", ["sampled", "full"])
def test_learner_logs_mismatch_on_fresh_tokens(qwen256, policy_dist):
    params, cfg = qwen256
    dist = PolicyDist(1.0, 20, 1.0)
    batch = _sample(params, cfg, dist)
    batch = batch.replace(advantages=batch.loss_mask * 0.5)
    c = L.default_config()
    c.num_minibatches, c.policy_dist = 2, policy_dist
    lrn = L.Learner(cfg, dict(name="ppo"), c, mesh=sharding.make_mesh(None, jax.devices()[:1]), dist=dist)
    _, m = lrn.train_step(lrn.init(jax.random.key(0), params), batch)
    assert m["mismatch/fresh_tokens"] == 48  # the first minibatch: 4 of 8 rows x 12 tokens
    if policy_dist == "sampled":
        assert m["mismatch/abs_logp_max"] <= 1e-5 and m["mismatch/k3_kl"] <= 1e-9
        assert m["mismatch/out_of_clip_frac"] == 0.0
    else:  # top-20 of 256: the kept mass is far below the clip band
        assert m["mismatch/abs_logp_mean"] > 0.5 and m["mismatch/out_of_clip_frac"] == 1.0


def _nucleus_reference(x, top_k, top_p):
    """NumPy, float64, with a full sort (the rule as stated): the kept mask and each entry's mass
    strictly before it in descending order (the first of a tie group's)."""
    x = x.astype(np.float64)
    if top_k:
        x = np.where(x >= np.sort(x, -1)[:, ::-1][:, top_k - 1:top_k], x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    above = np.array([[p[r][x[r] > v].sum() for v in x[r]] for r in range(len(x))])
    return np.isfinite(x) & (above < top_p), above


@pytest.mark.parametrize("v,top_k,top_p", [(300, 0, 0.9), (300, 0, 0.3), (300, 12, 0.8), (8192, 50, 0.9),
                                           (8192, 0, 0.95)])
def test_nucleus_without_a_sort_keeps_the_stated_set(v, top_k, top_p):
    rng = np.random.default_rng(v + top_k)
    x = (rng.normal(size=(6, v)) * 3).astype(np.float32)
    x[0, :40] = x[0, 7]  # a tie group, straddling the k-th with top-k
    x[1] = np.round(x[1])  # many ties everywhere
    dist = PolicyDist(1.0, top_k, top_p)
    got = np.isfinite(np.asarray(jax.jit(lambda x: policy_dist.truncate(x, dist))(jnp.asarray(x))))
    want, above = _nucleus_reference(x, top_k, top_p)
    # Equal except where float32 and float64 disagree on which side of top_p a mass lies.
    assert ((got == want) | (np.abs(above - top_p) < 1e-5)).all()
    assert (got != want).sum() <= 3 and got.sum(-1).min() >= 1  # boundary tokens only (above)
    # No operation of the program sorts a vocabulary-wide row (one HLO sort over [6, v] is the old way).
    hlo = jax.jit(lambda x: policy_dist.truncate(x, dist)).lower(jnp.asarray(x)).as_text()
    assert not [ln for ln in hlo.splitlines() if "sort" in ln and f"x{v}x" in ln.replace("<", "x").replace(">", "x")]


def test_nth_largest_is_the_sorted_rows_entry():
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=(8, 500)) * 4).astype(np.float32)  # ties
    x[0, 0] = -0.0
    n = rng.integers(1, 501, 8).astype(np.int32)
    got = np.asarray(policy_dist.nth_largest(jnp.asarray(x), jnp.asarray(n)))[:, 0]
    np.testing.assert_array_equal(got, [np.sort(r)[::-1][k - 1] for r, k in zip(x, n)])
