"""Properties the papers prove, checked numerically against our implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm import objectives as O
from jaxrl_llm import testing
from jaxrl_llm.batch import PolicyOutput
from jaxrl_llm.objectives import jackpot as J
from jaxrl_llm.objectives.ppo import a3po_prox_logp
from jaxrl_llm.objectives.sequence import group_expectation_logq
from tests import reference as R

# ---------------------------------------------------------------- A-3PO (arXiv:2512.06547)
logps = st.floats(min_value=-12.0, max_value=-0.0009765625, allow_nan=False, width=32)


@given(st.lists(st.tuples(logps, logps, st.integers(0, 64)), min_size=1, max_size=16))
def test_a3po_sandwich_and_r_equals_w_pow_alpha(rows):
    """Eq. 6: pi_prox in [min(pi_behav, pi_theta), max(...)]; Eq. 7: r = w^alpha with
    w = pi_theta/pi_behav; alpha = 1/d for d >= 1 and 1 (pi_prox = pi_behav) at d = 0."""
    theta, behav, d = (np.array(c) for c in zip(*rows))
    version = 64
    s = testing.random_batch(0)  # only used for its dataclass layout
    batch = s.batch.replace(behav_logp=jnp.asarray(behav[None], jnp.float32),
                            versions=jnp.asarray((version - d)[None], jnp.int32))
    policy = PolicyOutput(logp=jnp.asarray(theta[None], jnp.float32), version=jnp.asarray(version))
    prox, alpha = (np.asarray(a[0], np.float64) for a in a3po_prox_logp(policy, batch))
    theta32, behav32 = np.float32(theta).astype(np.float64), np.float32(behav).astype(np.float64)
    lo, hi = np.minimum(theta32, behav32), np.maximum(theta32, behav32)
    assert np.all(prox >= lo - 1e-5) and np.all(prox <= hi + 1e-5)
    np.testing.assert_allclose(alpha, 1.0 / np.maximum(d, 1), rtol=1e-6)
    np.testing.assert_allclose(prox[d <= 1], behav32[d <= 1], atol=1e-6)  # d = 0 and d = 1: pi_prox = pi_behav
    w = np.exp(theta32 - behav32)
    np.testing.assert_allclose(np.exp(theta32 - prox), w**alpha, rtol=2e-5)


def test_a3po_at_zero_staleness_is_on_policy_ppo():
    """d = 0 means pi_theta = pi_behav (first update on fresh data): A-3PO == PPO in value
    and gradient, for several clip settings."""
    s = testing.random_batch(1)
    fresh = s.batch.replace(versions=jnp.where(s.batch.versions >= 0, s.policy.version, -1))
    policy = s.policy.replace(logp=fresh.behav_logp)
    for over in ({}, dict(clip__eps_high=0.28), dict(loss_agg="seq_mean_token_mean")):
        vals = []
        for name in ("a3po", "ppo"):
            cfg = O.make_config(name=name, **over)
            vals.append(jax.value_and_grad(lambda lp: O.get(name)(policy.replace(logp=lp), fresh, cfg)[0])(policy.logp))
        np.testing.assert_allclose(float(vals[0][0]), float(vals[1][0]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(vals[0][1]), np.asarray(vals[1][1]), rtol=1e-6, atol=1e-9)
        assert np.abs(np.asarray(vals[0][1])).sum() > 0


def test_a3po_on_fresh_tokens_after_an_update_is_ppo():
    """A later minibatch on fresh data (d = 0, pi_theta != pi_behav): A-3PO equals PPO and
    decoupled PPO with pi_prox = pi_behav in loss and gradient (the literal Eq. 5, alpha = 0,
    would give ratio 1 and no clipping here), and it clips."""
    s = testing.random_batch(3, drift=0.6)
    fresh = s.batch.replace(versions=jnp.where(s.batch.versions >= 0, s.policy.version, -1))
    assert np.abs(np.asarray(s.policy.logp - fresh.behav_logp))[np.asarray(fresh.loss_mask) > 0].min() > 0
    runs = {}
    for name, batch in (("a3po", fresh), ("ppo", fresh), ("decoupled_ppo", fresh.replace(prox_logp=fresh.behav_logp))):
        cfg = O.make_config(name=name)
        f = jax.value_and_grad(lambda lp: O.get(name)(s.policy.replace(logp=lp), batch, cfg), has_aux=True)
        (loss, metrics), grad = f(s.policy.logp)
        runs[name] = (float(loss), np.asarray(grad), float(metrics["clip_frac"]))
    for other in ("ppo", "decoupled_ppo"):
        np.testing.assert_allclose(runs["a3po"][0], runs[other][0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(runs["a3po"][1], runs[other][1], rtol=1e-5, atol=1e-8)
    assert runs["a3po"][2] > 0  # the trust region acts


def test_a3po_is_decoupled_ppo_with_interpolated_prox():
    s = testing.random_batch(2)
    cfg = O.make_config(name="a3po")
    prox, _ = a3po_prox_logp(s.policy, s.batch)
    la, ma = O.get("a3po")(s.policy, s.batch, cfg)
    ld, md = O.get("decoupled_ppo")(s.policy, s.batch.replace(prox_logp=prox), O.make_config(name="decoupled_ppo"))
    np.testing.assert_allclose(float(la), float(ld), rtol=1e-6)
    assert float(ma["is_weight/max"]) == pytest.approx(float(md["is_weight/max"]))


# ---------------------------------------------------------------- GEPO (arXiv:2508.17850)
def test_gepo_group_expectation_per_group():
    rng = np.random.default_rng(0)
    log_q = rng.uniform(-6, -0.1, size=10)
    gid = np.array([7, 7, 7, 3, 3, -1, -1, -1, -1, 42])
    valid = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 1], bool)
    got = np.exp(np.asarray(group_expectation_logq(jnp.asarray(log_q, jnp.float32), jnp.asarray(gid), jnp.asarray(valid))))
    want = R.gepo_expectation(np.exp(log_q), gid, valid)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_gepo_eps_one_gives_policy_gradient_direction():
    """Eq. 15 with eps = 1: w = p / sg(p) = 1, gradient of -A log p (the plain PG)."""
    s = testing.random_batch(3)
    cfg = O.make_config(name="gepo", gepo__eps=1.0)
    (loss, m), grad = jax.value_and_grad(lambda lp: O.get("gepo")(s.policy.replace(logp=lp), s.batch, cfg), has_aux=True)(s.policy.logp)
    assert float(m["is_weight/max"]) == pytest.approx(1.0) and float(m["is_weight/min"]) == pytest.approx(1.0)
    mask, adv = np.asarray(s.batch.loss_mask), np.asarray(s.batch.advantages)
    adv_seq = (adv * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
    # token_mean of a per-sequence loss -A_i log p_i, log p_i = mean_t log pi: d/dx_it = -A_i / N.
    np.testing.assert_allclose(np.asarray(grad), -adv_seq[:, None] * mask / mask.sum(), rtol=1e-5, atol=1e-8)


def _random_far_pair(rng, n):
    while True:
        p = rng.dirichlet(np.full(n, 0.3))
        q = rng.dirichlet(np.full(n, 0.3))
        if (p * np.log(p / q)).sum() > np.log(n * n + 1):
            return p, q


@pytest.mark.parametrize("n", [2, 3, 5])
def test_gepo_theorem1_variance_reduction(n):
    """Theorem 1 / Corollary 1: for discrete p, q with KL(p||q) > log(n^2 + 1),
    Var_q[p/q] - Var_q[p/E_q[q]] >= exp(KL) - (n^2 + 1) > 0, with E_q[q] from our estimator
    applied to the whole support as one group."""
    rng = np.random.default_rng(n)
    for _ in range(20):
        p, q = _random_far_pair(rng, n)
        e_q = float(np.exp(group_expectation_logq(jnp.log(jnp.asarray(q)), jnp.zeros(n, jnp.int32), jnp.ones(n, bool))[0]))
        np.testing.assert_allclose(e_q, (q**2).sum(), rtol=1e-5)
        var_std = (q * (p / q) ** 2).sum() - 1.0
        w_new = p / e_q
        var_new = (q * w_new**2).sum() - (q * w_new).sum() ** 2
        kl = (p * np.log(p / q)).sum()
        assert var_std - var_new >= np.exp(kl) - (n * n + 1) - 1e-6
        assert var_std > var_new


# ---------------------------------------------------------------- OBRS / Jackpot (arXiv:2602.06107)
def _kl(p, q):
    return float((p * np.log(p / q)).sum())


@pytest.mark.parametrize("seed", range(5))
def test_obrs_moves_proposal_toward_target(seed):
    """Theorem 3.3: KL(p || q~) <= KL(p || q) for every lam < max p/q."""
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(50)), rng.dirichlet(np.ones(50))
    for lam in np.exp(np.linspace(np.log((p / q).min()) - 1, np.log((p / q).max()), 12))[:-1]:
        a = np.asarray(jnp.exp(J.obrs_log_accept(jnp.log(p), jnp.log(q), float(lam))), np.float64)
        q_tilde = q * a / (q * a).sum()
        assert _kl(p, q_tilde) <= _kl(p, q) + 1e-9


@pytest.mark.parametrize("target", [0.3, 0.6, 0.9, 0.99])
def test_obrs_lambda_hits_budget_and_is_optimal(target):
    """Theorem 3.4: bisection finds the lam whose acceptance equals the budget, and no other
    acceptance rule with that budget gets closer to p."""
    rng = np.random.default_rng(int(target * 100))
    p, q = rng.dirichlet(np.ones(30)), rng.dirichlet(np.ones(30))
    lam = float(J.obrs_lambda_for_acceptance(jnp.asarray(p), jnp.asarray(q), target))
    a = np.minimum(1.0, p / (lam * q))
    assert (q * a).sum() == pytest.approx(target, abs=1e-5)
    kl_obrs = _kl(p, q * a / (q * a).sum())
    tried = 0
    for i in range(2000):
        # random rules with the same budget: scale acceptances down, or rejections up
        c = rng.random(30) ** rng.uniform(0.2, 3)
        b = c * target / (q * c).sum() if i % 2 else 1.0 - c * (1 - target) / (q * c).sum()
        if b.max() > 1 or b.min() < 0:
            continue
        tried += 1
        assert _kl(p, q * b / (q * b).sum()) >= kl_obrs - 1e-9
    assert tried > 50


def test_jackpot_kappa_calibrates_z_to_empirical_acceptance():
    """§4.4.2: kappa * mean(Z_approx) == empirical acceptance; Z_approx <= Z (true, full vocab);
    and the empirical acceptance tracks E[a] = Z on a large batch."""
    s = testing.random_batch(0, num_prompts=8, group_size=8, length=24, vocab=32, topk=4)
    cfg = O.make_config(name="jackpot", jackpot__lam=0.8)
    _, m = O.get("jackpot")(s.policy, s.batch, cfg)
    assert float(m["jackpot/kappa"]) * float(m["jackpot/z_approx_mean"]) == pytest.approx(float(m["jackpot/accept_rate"]), rel=1e-5)
    mask = np.asarray(s.batch.loss_mask) > 0
    z_true = np.minimum(np.exp(s.behav_logp_BxLxV), np.exp(s.policy_logp_BxLxV) / 0.8).sum(-1)[mask]
    _, z_approx, _, _, _ = R.jackpot_parts(np.asarray(s.policy.logp, np.float64), s, cfg, np.zeros(mask.shape))
    assert np.all(z_approx[mask] <= z_true + 1e-9) and np.all(z_approx[mask] > 0)
    assert float(m["jackpot/z_approx_mean"]) == pytest.approx(z_approx[mask].mean(), rel=1e-5)
    n = mask.sum()
    rates = [float(O.get("jackpot")(s.policy.replace(rng=jax.random.key(k)), s.batch, cfg)[1]["jackpot/accept_rate"]) for k in range(8)]
    se = np.sqrt(z_true.mean() * (1 - z_true.mean()) / (8 * n))
    assert abs(np.mean(rates) - z_true.mean()) < 4 * se + 1e-3


def test_jackpot_weight_is_target_over_obrs_distribution():
    """w_OBRS = Z max(lam, p_t/p_inf) equals p_target / P_OBRS with P_OBRS = min(p_inf, p_t/lam)/Z
    (Eq. 4); checked on full distributions with the exact Z (kappa = 1)."""
    rng = np.random.default_rng(1)
    p_inf, p_t = rng.dirichlet(np.ones(20)), rng.dirichlet(np.ones(20))
    for lam in (0.5, 1.0, 2.0):
        z = float(J.obrs_acceptance(jnp.asarray(p_t), jnp.asarray(p_inf), lam))
        w = z * np.maximum(lam, p_t / p_inf)
        p_obrs = np.minimum(p_inf, p_t / lam) / z
        np.testing.assert_allclose(w, p_t / p_obrs, rtol=1e-5)
        np.testing.assert_allclose((p_obrs * w).sum(), 1.0, rtol=1e-5)  # E_{P_OBRS}[w] = 1
