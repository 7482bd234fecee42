"""Every objective's loss and gradient against the NumPy references in tests/reference.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives as O
from jaxrl_llm import testing
from tests import reference as R

# (objective, overrides): each shared option is exercised on at least one objective.
CASES = [
    ("ppo", {}),
    ("ppo", dict(clip__eps_high=0.28, clip__dual_clip=3.0, loss_agg="seq_mean_token_mean")),
    ("ppo", dict(kl__coef=0.1, kl__estimator="k1", loss_agg="seq_mean_token_sum")),
    ("ppo", dict(kl__coef=0.1, kl__estimator="k2", loss_agg="seq_mean_token_sum_norm")),
    ("ppo", dict(kl__coef=0.05, kl__estimator="k3", loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=20)),
    ("decoupled_ppo", {}),
    ("decoupled_ppo", dict(is_correction__kind="tis", is_correction__cap=1.1)),
    ("decoupled_ppo", dict(is_correction__kind="icepop", is_correction__low=0.8, is_correction__high=1.25)),
    ("a3po", {}),
    ("a3po", dict(kl__coef=0.1, is_correction__kind="tis", is_correction__cap=1.2, loss_agg="seq_mean_token_mean")),
    ("ppo", dict(loss_agg="token_sum_norm")),
    ("decoupled_ppo", dict(is_correction__kind="icepop", is_correction__low=0.8, is_correction__high=1.25,
                           loss_agg_rejected="drop")),
    ("gspo", {}),
    ("gspo", dict(gspo__eps_low=0.1, gspo__eps_high=0.2, gspo__loss_agg="token_mean")),
    ("gspo", dict(gspo__variant="token", gspo__eps_low=0.1, gspo__eps_high=0.2)),
    ("m2po", {}),
    ("m2po", dict(m2po__tau=0.01, loss_agg_rejected="drop", kl__coef=0.1)),
    ("m2po", dict(m2po__clip=True, clip__eps_low=0.1, clip__eps_high=0.1, is_correction__kind="tis")),
    ("cispo", {}),
    ("cispo", dict(cispo__eps_low=0.1, cispo__eps_high=0.1, loss_agg="seq_mean_token_mean", kl__coef=0.1)),
    ("gepo", {}),
    ("gepo", dict(gepo__eps=0.3, kl__coef=0.1)),
    ("gepo", dict(gepo__eps_mode="var", gepo__eps_var_coef=50.0, gepo__eps_max=0.9)),
    ("offpolicy_grpo", {}),
    ("offpolicy_grpo", dict(offpolicy_grpo__r_prime="prox", kl__coef=0.1)),
    ("offpolicy_grpo", dict(offpolicy_grpo__zero_var_mask=False, clip__eps_low=0.1)),
    ("jackpot", {}),
    ("jackpot", dict(jackpot__lam=0.7, jackpot__c1=1.5, jackpot__c2=1.3)),
    ("jackpot", dict(jackpot__p_target="ref", jackpot__lam=1.3)),
    ("jackpot", dict(jackpot__p_ref="current", kl__coef=0.1)),
    ("jackpot", dict(jackpot__correction="tis", jackpot__c1=1.5)),
    ("jackpot", dict(jackpot__correction="none")),
]


def _reference(name, cfg, s):
    fn = getattr(R, name)
    if name == "jackpot":
        u = np.asarray(jax.random.uniform(s.policy.rng, s.batch.loss_mask.shape), np.float64)
        return lambda x, xs: fn(x, xs, s, cfg, u)
    return lambda x, xs: fn(x, xs, s, cfg)


@pytest.mark.parametrize("name,overrides", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_grad_match_numpy(name, overrides, seed):
    s = testing.random_batch(seed, drift=0.25)
    cfg = O.make_config(name=name, **overrides)
    fn = jax.jit(O.get(name), static_argnums=2)

    def loss_of(logp):
        return fn(s.policy.replace(logp=logp), s.batch, cfg)[0]

    loss, grad = jax.value_and_grad(loss_of)(s.policy.logp)
    x0 = np.asarray(s.policy.logp, np.float64)
    ref = _reference(name, cfg, s)
    np.testing.assert_allclose(float(loss), ref(x0, x0), rtol=1e-5, atol=1e-6)
    ref_grad = R.fd_grad(lambda x: ref(x, x0), x0)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=2e-6)
    assert np.abs(ref_grad).sum() > 0, "case must exercise a non-zero gradient"


@pytest.mark.parametrize("name", O.BUILTIN)
def test_prompt_and_pad_tokens_do_not_matter(name):
    """Changing anything at loss_mask == 0 positions changes neither loss nor gradient."""
    s = testing.random_batch(3)
    cfg = O.make_config(name=name, kl__coef=0.1)
    off = np.asarray(s.batch.loss_mask) == 0
    noise = np.random.default_rng(0).normal(size=off.shape).astype(np.float32)

    def perturb(a):
        return jnp.where(off, a + noise, a)

    batch2 = s.batch.replace(
        behav_logp=perturb(s.batch.behav_logp), prox_logp=perturb(s.batch.prox_logp),
        ref_logp=perturb(s.batch.ref_logp), advantages=perturb(s.batch.advantages),
    )
    policy2 = s.policy.replace(logp=perturb(s.policy.logp))
    f = O.get(name)
    l1, g1 = jax.value_and_grad(lambda lp: f(s.policy.replace(logp=lp), s.batch, cfg)[0])(s.policy.logp)
    l2, g2 = jax.value_and_grad(lambda lp: f(policy2.replace(logp=lp), batch2, cfg)[0])(policy2.logp)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-8)
    assert np.all(np.asarray(g1)[off] == 0.0)


def test_metrics_match_numpy():
    s = testing.random_batch(4)
    cfg = O.make_config(name="decoupled_ppo", clip__eps_low=0.1, clip__eps_high=0.1)
    _, m = O.get("decoupled_ppo")(s.policy, s.batch, cfg)
    mask = np.asarray(s.batch.loss_mask) > 0
    behav, prox, x = (np.asarray(a, np.float64) for a in (s.batch.behav_logp, s.batch.prox_logp, s.policy.logp))
    w, r, a = np.exp(prox - behav)[mask], np.exp(x - prox)[mask], np.asarray(s.batch.advantages)[mask]
    clipped = -a * np.clip(r, 0.9, 1.1) > -a * r
    d = (int(s.policy.version) - np.asarray(s.batch.versions))[mask]
    expect = {
        "is_weight/mean": w.mean(), "is_weight/max": w.max(), "is_weight/min": w.min(), "is_weight/var": w.var(),
        "ratio/mean": r.mean(), "ratio/max": r.max(), "ratio/min": r.min(),
        "clip_frac": clipped.mean(), "clipped_tokens": clipped.sum(),
        "approx_kl": (r - 1 - np.log(r)).mean(), "entropy": np.asarray(s.policy.entropy)[mask].mean(),
        "staleness/mean": d.mean(), "staleness/max": d.max(),
    }
    assert clipped.sum() > 0
    for k, v in expect.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_stable_metric_names_for_every_objective():
    s = testing.random_batch(5)
    required = {"loss", "clip_frac", "clipped_tokens", "is_weight/mean", "is_weight/max", "is_weight/min",
                "is_weight/var", "ratio/mean", "ratio/max", "ratio/min", "approx_kl", "entropy",
                "staleness/mean", "staleness/max"}
    for name in O.BUILTIN:
        loss, m = O.get(name)(s.policy, s.batch, O.make_config(name=name))
        assert required <= set(m), (name, required - set(m))
        assert all(np.isfinite(float(v)) for v in m.values()), name
        assert float(m["loss"]) == float(loss)
    assert {"jackpot/accept_rate", "jackpot/kappa"} <= set(O.get("jackpot")(s.policy, s.batch, O.make_config(name="jackpot"))[1])
    assert "gepo/eps" in O.get("gepo")(s.policy, s.batch, O.make_config(name="gepo"))[1]


def test_log_ratio_clamp_keeps_extreme_staleness_finite():
    s = testing.random_batch(6)
    far = s.batch.replace(behav_logp=s.batch.behav_logp - 200.0, prox_logp=s.batch.prox_logp - 150.0)
    for name in O.BUILTIN:
        f = O.get(name)
        loss, grad = jax.value_and_grad(lambda lp: f(s.policy.replace(logp=lp), far, O.make_config(name=name))[0])(s.policy.logp)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad))), name


def test_no_retrace_across_same_shape_batches():
    cfg = O.make_config(name="a3po")

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(policy, batch):
        return O.get("a3po")(policy, batch, cfg)[0]

    for seed in range(3):
        s = testing.random_batch(seed)
        step(s.policy, s.batch)


def test_objectives_are_jittable_with_static_cfg_and_one_trace_per_cfg():
    s = testing.random_batch(7)
    for name in O.BUILTIN:
        f = jax.jit(O.get(name), static_argnums=2)
        a = f(s.policy, s.batch, O.make_config(name=name))[0]
        b = f(s.policy, s.batch, O.make_config(name=name))[0]  # equal frozen configs hit the cache
        assert float(a) == float(b)


@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_offpolicy_grpo_zero_variance_groups_get_no_gradient(kl_coef):
    """Seed 003 Eq. 7: groups with zero reward variance are masked (surrogate and KL), even when
    their advantages are non-zero (e.g. a baseline-free estimator); others are untouched."""
    s = testing.random_batch(8)
    batch = s.batch.replace(advantages=(s.batch.rewards[:, None] - 0.3) * s.batch.loss_mask)
    zero_var = np.asarray(R.zero_variance_keep(np.asarray(batch.rewards), np.asarray(batch.group_ids))) == 0
    assert zero_var.any() and (~zero_var).any()
    f = O.get("offpolicy_grpo")

    def grad(mask_on):
        cfg = O.make_config(name="offpolicy_grpo", kl__coef=kl_coef, offpolicy_grpo__zero_var_mask=mask_on)
        return np.asarray(jax.grad(lambda lp: f(s.policy.replace(logp=lp), batch, cfg)[0])(s.policy.logp))

    g_on, g_off = grad(True), grad(False)
    assert np.all(g_on[zero_var] == 0.0)
    assert np.abs(g_off[zero_var]).sum() > 0
    np.testing.assert_allclose(g_on[~zero_var], g_off[~zero_var], rtol=1e-6, atol=1e-9)


def test_a3po_prox_diagnostics_against_numpy():
    """`a3po.prox_metrics`: the interpolation's errors against the recomputed pi_prox, overall
    and per staleness bucket; the loss itself is the plain A-3PO loss."""
    from jaxrl_llm.objectives.ppo import PROX_BUCKETS, bucket_name

    s = testing.random_batch(seed=4, max_staleness=12, learner_version=12)
    true = np.asarray(s.batch.prox_logp)
    batch = s.batch.replace(prox_logp=jnp.asarray(true))
    on = O.make_config(name="a3po", a3po__prox_metrics=True)
    loss_on, m = O.get("a3po")(s.policy, batch, on)
    loss_off, m_off = O.get("a3po")(s.policy, batch, O.make_config(name="a3po"))
    assert float(loss_on) == float(loss_off) and "a3po_prox/abs_err" not in m_off
    assert O.required_passes(on) == {"prox_logp"} and O.required_passes(O.make_config(name="a3po")) == set()
    mask = np.asarray(batch.loss_mask) > 0
    d = np.where(mask, 12 - np.asarray(batch.versions), 0)
    alpha = 1.0 / np.maximum(d, 1)
    behav, logp = np.asarray(batch.behav_logp, np.float64), np.asarray(s.policy.logp, np.float64)
    approx = alpha * behav + (1 - alpha) * logp
    err = np.abs(approx - true)
    np.testing.assert_allclose(m["a3po_prox/abs_err"], err[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["a3po_prox/abs_err/max"], err[mask].max(), rtol=1e-5)
    np.testing.assert_allclose(m["a3po_prox/rel_err"], (err / np.maximum(np.abs(true), 1e-6))[mask].mean(), rtol=1e-4)
    iw_err = np.abs(np.exp(approx - behav) - np.exp(true - behav))
    np.testing.assert_allclose(m["a3po_prox/is_weight_err"], iw_err[mask].mean(), rtol=1e-4)
    r_err = np.abs(np.exp(logp - approx) - np.exp(logp - true))
    np.testing.assert_allclose(m["a3po_prox/ratio_err"], r_err[mask].mean(), rtol=1e-4)
    total = 0
    for lo, hi in PROX_BUCKETS:
        inside = mask & (d >= lo) & (d <= (hi if hi is not None else 10**9))
        name = bucket_name(lo, hi)
        assert m[f"a3po_prox/tokens/{name}"] == inside.sum()
        if inside.any():
            np.testing.assert_allclose(m[f"a3po_prox/abs_err/{name}"], err[inside].mean(), rtol=1e-5)
        total += inside.sum()
    assert total == mask.sum() and len({int(x) for x in d[mask]}) >= 5  # several buckets exercised
