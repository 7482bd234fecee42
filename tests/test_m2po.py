"""M2PO (arXiv:2510.01161; AReaL's `_apply_m2po_masking`): the second-moment mask against a
NumPy loop of AReaL's rule, its properties, the step-level scope in the learner, and the case
where the docs' pi_theta and the code's pi_prox readings differ."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.learner import learner as L
from jaxrl_llm import objectives as O
from jaxrl_llm import testing
from jaxrl_llm.batch import PolicyOutput
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.objectives.m2po import second_moment_mask
from tests import reference as R

rows = st.integers(1, 4).flatmap(lambda b: st.integers(2, 8).flatmap(lambda l: st.tuples(
    st.lists(st.floats(-3, 0, width=32, allow_subnormal=False), min_size=b * l, max_size=b * l),
    st.lists(st.floats(-3, 0, width=32, allow_subnormal=False), min_size=b * l, max_size=b * l),
    st.lists(st.booleans(), min_size=b * l, max_size=b * l), st.just((b, l)))))


def _arrays(case):
    behav, prox, mask, shape = case
    return (np.asarray(behav, np.float32).reshape(shape), np.asarray(prox, np.float32).reshape(shape),
            np.asarray(mask, np.float32).reshape(shape))


@settings(max_examples=30, deadline=None)  # each shape compiles the mask once
@given(rows, st.floats(1e-3, 2.0), st.floats(1e-3, 2.0))
def test_mask_matches_the_numpy_rule_and_is_monotone_in_tau(case, tau1, tau2):
    behav, prox, mask = _arrays(case)
    m2 = (prox - behav) ** 2
    if np.unique(m2[mask > 0]).size < (mask > 0).sum():
        return  # ties: which of two equal tokens goes first is the sort's choice, in both implementations
    lo, hi = sorted((tau1, tau2))
    keep_lo, keep_hi = (np.asarray(second_moment_mask(jnp.asarray(behav), jnp.asarray(prox), jnp.asarray(mask), t))
                        for t in (lo, hi))
    np.testing.assert_array_equal(keep_lo, R.m2po_keep(behav, prox, mask, lo))
    assert np.all(keep_lo <= keep_hi)  # a larger tau masks a subset of the tokens
    assert np.all(keep_lo <= mask)  # only loss tokens are kept
    n = int(mask.sum())
    if n:
        assert keep_lo.sum() >= 1  # never all
        kept = m2[keep_lo > 0]
        assert kept.mean() < lo or kept.size == 1  # the bound holds, or only one token is left
        dropped = m2[(mask > 0) & (keep_lo == 0)]
        assert dropped.size == 0 or dropped.min() >= kept.max()  # the largest go first


def test_the_mask_reads_pi_prox_not_the_current_policy():
    """AReaL's docs write m2 with log pi_theta / pi_behav; its code with pi_prox. They agree at
    the step's first update (pi_theta = pi_prox) and differ after it: built is the mask from
    pi_prox, fixed for the step. The case where they differ: pi_theta far from pi_prox."""
    s = testing.random_batch(2, drift=0.4)
    cfg = O.make_config(name="m2po", m2po__tau=0.05)
    theta = s.batch.prox_logp + 0.8 * jnp.asarray(np.random.default_rng(0).normal(size=s.batch.loss_mask.shape),
                                                  jnp.float32)
    args = (np.asarray(s.batch.behav_logp, np.float64), np.asarray(s.batch.loss_mask, np.float64), 0.05)
    by_prox = R.m2po_keep(args[0], np.asarray(s.batch.prox_logp, np.float64), *args[1:])
    by_theta = R.m2po_keep(args[0], np.asarray(theta, np.float64), *args[1:])
    assert (by_prox != by_theta).any()  # the readings differ on this batch
    _, m = O.get("m2po")(s.policy.replace(logp=theta), s.batch, cfg)
    mask = np.asarray(s.batch.loss_mask) > 0
    np.testing.assert_allclose(float(m["m2po/masked_frac"]), 1 - by_prox[mask].mean(), rtol=1e-6)
    x0 = np.asarray(theta, np.float64)
    loss = O.get("m2po")(s.policy.replace(logp=theta), s.batch, cfg)[0]
    np.testing.assert_allclose(float(loss), R.m2po(x0, x0, s, cfg), rtol=1e-5, atol=1e-7)


def test_the_learner_masks_over_the_whole_step_not_each_minibatch():
    """The learner's `prepare` computes the mask once over every loss token of the step (here
    2 minibatches); a minibatch alone would keep other tokens. The mask's own data (behav and
    the recompute pass's pi_prox) come from the prepared batch."""
    model = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    c = L.default_config()
    c.num_minibatches = 2
    lrn = L.Learner(model, {"name": "m2po", "m2po": {"tau": 0.02}}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    state = lrn.init(jax.random.key(0))
    data = testing.model_batch(lrn.init(jax.random.key(5)).params, model, num_prompts=4, group_size=2, version=0)
    # behaviour log-probs further off for later rows: the rows differ in how much they are masked
    noise = np.random.default_rng(1).normal(size=data.behav_logp.shape) * np.linspace(0.02, 0.5, 8)[:, None]
    data = data.replace(behav_logp=data.behav_logp + jnp.asarray(noise, jnp.float32) * data.loss_mask)
    batch, _, _ = lrn.prepare(state, data)
    behav, prox, mask = (np.asarray(x, np.float64) for x in (batch.behav_logp, batch.prox_logp, batch.loss_mask))
    whole = R.m2po_keep(behav, prox, mask, 0.02)
    np.testing.assert_array_equal(np.asarray(batch.token_keep), whole)
    assert 0 < whole.sum() < mask.sum()
    half = batch.shape[0] // 2
    per_half = np.concatenate([R.m2po_keep(behav[:half], prox[:half], mask[:half], 0.02),
                               R.m2po_keep(behav[half:], prox[half:], mask[half:], 0.02)])
    assert (per_half != whole).any()  # the scope matters on this batch
    # m2po.scope=minibatch (AReaL's per-call mask): no step-level selection; each loss call on a
    # minibatch masks over that minibatch's tokens, as the objective does on a batch alone.
    per_call = L.Learner(model, {"name": "m2po", "m2po": {"tau": 0.02, "scope": "minibatch"}}, c,
                         mesh=sharding.make_mesh(None, jax.devices()[:1]))
    prepared, _, _ = per_call.prepare(state, data)
    assert prepared.token_keep is None
    cfg = per_call.plan.obj_cfg
    first = jax.tree.map(lambda x: x[:half], prepared)
    policy = PolicyOutput(logp=first.prox_logp, version=jnp.int32(0))
    _, m = O.get("m2po")(policy, first, cfg)
    np.testing.assert_allclose(float(m["m2po/masked_frac"]), 1 - per_half[:half].sum() / mask[:half].sum(), rtol=1e-6)
    state, metrics = lrn.train_step(state, data)
    assert np.isfinite(metrics["loss"]) and 0 < metrics["m2po/masked_frac"] < 1
