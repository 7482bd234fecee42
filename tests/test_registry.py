import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives as O
from jaxrl_llm.objectives import common


def test_registry_holds_the_nine_objectives():
    assert set(O.BUILTIN) <= set(O.registry())
    assert len(O.BUILTIN) == 9
    assert O.get("decoupled_ppo").needs == {"prox_logp"}
    assert O.get("a3po").needs == frozenset()  # no extra forward pass


def test_aggregation_modes_hand_computed():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # third: no tokens
    assert float(common.aggregate(loss, mask, "token_mean")) == pytest.approx((1 + 4 + 5 + 6) / 4)
    assert float(common.aggregate(loss, mask, "seq_mean_token_mean")) == pytest.approx((1 + 5) / 2)
    assert float(common.aggregate(loss, mask, "seq_mean_token_sum")) == pytest.approx((1 + 15) / 2)
    assert float(common.aggregate(loss, mask, "seq_mean_token_sum_norm")) == pytest.approx(16 / (3 * 3))
    assert float(common.aggregate(loss, mask, "seq_mean_token_sum_norm", norm_len=8)) == pytest.approx(16 / 24)
    assert float(common.aggregate(loss, jnp.zeros_like(mask), "token_mean")) == 0.0


def test_kl_estimators_hand_computed():
    logp, ref = jnp.array([-1.0]), jnp.array([-1.5])  # log r = -0.5
    assert float(common.kl_penalty(logp, ref, "k1", 20.0)[0]) == pytest.approx(0.5)
    assert float(common.kl_penalty(logp, ref, "k2", 20.0)[0]) == pytest.approx(0.125)
    assert float(common.kl_penalty(logp, ref, "k3", 20.0)[0]) == pytest.approx(np.exp(-0.5) - 1 + 0.5)


def test_is_corrections():
    w = jnp.array([0.1, 0.9, 1.5, 3.0])
    np.testing.assert_allclose(common.is_correction(w, "none", 2, 0.5, 2), w)
    np.testing.assert_allclose(common.is_correction(w, "tis", 2.0, 0.5, 2), [0.1, 0.9, 1.5, 2.0])
    np.testing.assert_allclose(common.is_correction(w, "icepop", 2, 0.5, 2.0), [0.0, 0.9, 1.5, 0.0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="grpo_v2"), "unknown objective 'grpo_v2'; valid: a3po, cispo, decoupled_ppo, gepo, gspo, jackpot, m2po, offpolicy_grpo, ppo"),
        (dict(loss_agg="mean"), "loss_agg='mean': expected one of 'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm', 'token_sum_norm'"),
        (dict(kl__estimator="k4"), "kl.estimator='k4': expected one of 'k1', 'k2', 'k3'"),
        (dict(is_correction__kind="clip"), "is_correction.kind='clip': expected one of 'none', 'tis', 'icepop'"),
        (dict(gepo__eps_mode="adaptive"), "gepo.eps_mode='adaptive': expected one of 'const', 'var'"),
        (dict(jackpot__p_target="old"), "jackpot.p_target='old': expected one of 'new', 'ref'"),
        (dict(clip__eps_lo=0.1), "unknown objective option 'clip.eps_lo'; valid: dual_clip, eps_high, eps_low"),
        (dict(temperature=1.0), "unknown objective option 'temperature'"),
        (dict(name="ppo", is_correction__kind="tis"), "applies to objectives with a separate behaviour importance weight"),
        (dict(clip__dual_clip=0.5), r"clip.dual_clip=0.5: expected 0 \(off\) or a number > 1"),
        (dict(offpolicy_grpo__zero_var_mask="yes"), "expects bool"),
        (dict(gepo__eps=1.5), r"gepo.eps=1.5: expected a number in \[0, 1\]"),
        (dict(m2po__tau=0.0), r"m2po.tau=0.0: expected"),
        (dict(name="cispo", loss_agg_rejected="drop"), "rejects none"),
    ],
)
def test_invalid_config_fails_with_clear_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        O.make_config(**kwargs)


def test_missing_inputs_fail_with_what_to_change():
    from jaxrl_llm import testing

    s = testing.random_batch(0, with_ref=False)
    with pytest.raises(ValueError, match="decoupled_ppo needs TrajectoryBatch.prox_logp"):
        O.get("decoupled_ppo")(s.policy, s.batch.replace(prox_logp=None), O.make_config(name="decoupled_ppo"))
    with pytest.raises(ValueError, match="kl.coef > 0 needs TrajectoryBatch.ref_logp"):
        O.get("ppo")(s.policy, s.batch, O.make_config(kl__coef=0.1))
    with pytest.raises(ValueError, match="PolicyOutput.rng"):
        O.get("jackpot")(s.policy.replace(rng=None), s.batch, O.make_config(name="jackpot"))


def test_register_rejects_duplicates_and_unknown_needs():
    with pytest.raises(ValueError, match="already registered"):
        O.register("ppo")(lambda p, b, c: (0.0, {}))
    with pytest.raises(ValueError, match="unknown objective need 'values'"):
        O.register("x", needs=("values",))


def test_config_file_for_every_objective():
    from configs.objectives import get_config

    for name in O.BUILTIN:
        cfg = get_config(name)
        assert O.make_config(cfg).name == name
    with pytest.raises(ValueError, match="unknown objective 'nope'"):
        get_config("nope")
