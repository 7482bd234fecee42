import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as A


def _groups(gid):
    return {g: [i for i in range(len(gid)) if gid[i] == g] for g in set(gid.tolist())}


def np_grpo(r, gid, eps=1e-6):
    out = np.zeros_like(r)
    for idx in _groups(gid).values():
        if len(idx) > 1:
            out[idx] = (r[idx] - r[idx].mean()) / (r[idx].std(ddof=1) + eps)
    return out


def np_dr_grpo(r, gid):
    out = np.zeros_like(r)
    for idx in _groups(gid).values():
        out[idx] = r[idx] - r[idx].mean()
    return out


def np_rloo(r, gid):
    out = np.zeros_like(r)
    for idx in _groups(gid).values():
        for i in idx:
            others = [j for j in idx if j != i]
            out[i] = r[i] - np.mean(r[others]) if others else 0.0
    return out


REFS = {"grpo": np_grpo, "dr_grpo": np_dr_grpo, "rloo": np_rloo}


@pytest.mark.parametrize("name", list(REFS))
def test_estimators_match_numpy_with_arbitrary_group_ids(name):
    rng = np.random.default_rng(0)
    gid = np.array([7, 7, 7, 7, -3, -3, 100, 5, 5, 5, 5, 5], np.int32)  # incl. a singleton
    r = rng.normal(size=gid.size).astype(np.float32)
    mask = (rng.random((gid.size, 6)) < 0.7).astype(np.float32)
    f = jax.jit(lambda r, g, m: A.compute(name, r, g, m), static_argnums=())
    got = np.asarray(f(jnp.asarray(r), jnp.asarray(gid), jnp.asarray(mask)))
    want = REFS[name](r.astype(np.float64), gid)[:, None] * mask
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rloo_is_scaled_dr_grpo():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0])
    g = jnp.zeros(5, jnp.int32)
    np.testing.assert_allclose(A.rloo(r, g), A.dr_grpo(r, g) * 5 / 4, rtol=1e-6)


def test_zero_variance_mask():
    r = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    g = jnp.array([0, 0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(A.nonzero_variance(r, g), [0, 0, 0, 1, 1, 0, 0])
    adv = A.compute("dr_grpo", r + jnp.array([0, 0, 1e-3, 0, 0, 0, 0]), g, jnp.ones((7, 2)), mask_zero_variance=True)
    assert float(jnp.abs(adv[:3]).sum()) > 0  # group 0 no longer has zero spread
    adv = A.compute("grpo", r, g, jnp.ones((7, 2)), mask_zero_variance=True)
    np.testing.assert_array_equal(np.asarray(adv)[[0, 1, 2, 5, 6]], 0.0)
    assert float(adv[3, 0]) < 0 < float(adv[4, 0])


def test_unknown_estimator_lists_valid():
    with pytest.raises(ValueError, match="valid: grpo, dr_grpo, rloo"):
        A.compute("ppo_gae", jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones((2, 2)))
