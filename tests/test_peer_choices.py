"""Where this project, verl and AReaL define things differently (docs/objectives.md, "Where this
project and verl / AReaL differ"): each peer's choice written here in NumPy as that peer
computes it, and the option that reproduces it checked against it. The defaults follow the
papers; these options are how a result from another codebase is reproduced here."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages
from jaxrl_llm import objectives as O
from jaxrl_llm import testing
from tests import reference as R

DOC = "docs/objectives.md"


def _batch(seed=0, drift=0.3):
    s = testing.random_batch(seed, drift=drift)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    return s, f(s.policy.logp), f(s.batch.behav_logp), f(s.batch.prox_logp), f(s.batch.advantages), \
        f(s.batch.loss_mask)


def _loss(s, **cfg):
    cfg = O.make_config(**cfg)
    return float(O.get(cfg.name)(s.policy, s.batch, cfg)[0])


def _seq_mean(v, m):
    return (v * m).sum(-1) / np.maximum(m.sum(-1), 1)


def test_gspo_sequence_mean_is_the_default_and_token_mean_is_areals():
    """GSPO Eq. 5: (1/G) sum_i of each sequence's clipped term (verl's GSPO loss aggregates
    seq-mean-token-mean); AReaL's token mean weights each sequence by its length."""
    s, x, behav, _, adv, m = _batch(1)
    sr = np.exp(_seq_mean(x - behav, m))
    a = _seq_mean(adv, m)
    per_seq = -np.minimum(sr * a, np.clip(sr, 1 - 3e-4, 1 + 4e-4) * a)
    valid = m.sum(-1) > 0
    paper = per_seq[valid].mean()
    areal = (per_seq[:, None] * m).sum() / m.sum()
    assert abs(paper - areal) > 1e-4  # the two definitions differ on this batch
    np.testing.assert_allclose(_loss(s, name="gspo"), paper, rtol=1e-5)
    np.testing.assert_allclose(_loss(s, name="gspo", gspo__loss_agg="token_mean"), areal, rtol=1e-5)
    with pytest.raises(ValueError, match="gspo.loss_agg"):
        O.make_config(name="gspo", loss_agg="seq_mean_token_sum")  # the shared option would be ignored


def test_dr_grpo_divisor_and_verls():
    """Dr. GRPO divides the token sum by G x a constant length (ours: B x L); verl's
    seq-mean-token-sum-norm divides the minibatch's sum by L only: token_sum_norm."""
    s, x, behav, _, adv, m = _batch(2)
    r = np.exp(x - behav)
    tok = -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv) * m
    b, length = m.shape
    verl = tok.sum(-1).sum() / length  # verl agg_loss: torch.sum(seq_losses) / loss_mask.shape[-1]
    np.testing.assert_allclose(_loss(s, name="ppo", loss_agg="seq_mean_token_sum_norm"), tok.sum() / (b * length),
                               rtol=1e-5)
    np.testing.assert_allclose(_loss(s, name="ppo", loss_agg="token_sum_norm"), verl, rtol=1e-5)


def test_icepop_rejected_tokens_count_here_and_in_areal_but_leave_verls_denominator():
    s, x, behav, prox, adv, m = _batch(3, drift=0.5)
    w = np.exp(prox - behav)
    keep = (w >= 0.8) & (w <= 1.25)
    assert ((m > 0) & ~keep).any()
    r = np.exp(x - prox)
    tok = np.where(keep, w, 0.0) * -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv)
    areal = (tok * m).sum() / m.sum()  # AReaL token_mask: the loss is masked, loss_mask is not
    verl = (tok * m * keep).sum() / (m * keep).sum()  # verl: rejected tokens leave response_mask
    cfg = dict(name="decoupled_ppo", is_correction__kind="icepop", is_correction__low=0.8, is_correction__high=1.25)
    np.testing.assert_allclose(_loss(s, **cfg), areal, rtol=1e-5)
    np.testing.assert_allclose(_loss(s, **cfg, loss_agg_rejected="drop"), verl, rtol=1e-5)
    with pytest.raises(ValueError, match="loss_agg_rejected"):
        O.make_config(name="ppo", loss_agg_rejected="drop")  # ppo rejects no token


def test_dual_clip_is_off_by_default_as_in_areal_and_verls_c3_is_an_option():
    s, _, behav, _, adv, m = _batch(4)
    x = behav + 1.5 * np.random.default_rng(4).normal(size=behav.shape)  # ratios beyond c = 3 on some tokens
    s = s._replace(policy=s.policy.replace(logp=jnp.asarray(x, jnp.float32)))
    r = np.exp(x - behav)
    l1 = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.2))
    verl = np.where(adv < 0, np.minimum(-adv * 3.0, l1), l1)  # verl: clip_ratio_c = 3.0 by default
    assert ((verl != l1) & (m > 0)).any()
    assert O.make_config(name="ppo").clip.dual_clip == 0.0
    np.testing.assert_allclose(_loss(s, name="ppo"), (l1 * m).sum() / m.sum(), rtol=1e-5)
    np.testing.assert_allclose(_loss(s, name="ppo", clip__dual_clip=3.0), (verl * m).sum() / m.sum(), rtol=1e-5)


def _verl_grpo(scores, ids, eps):
    """verl compute_grpo_outcome_advantage: a group of one gets mean 0 and std 1."""
    out = np.zeros_like(scores)
    for g in np.unique(ids):
        idx = ids == g
        mean, std = (0.0, 1.0) if idx.sum() == 1 else (scores[idx].mean(), scores[idx].std(ddof=1))
        out[idx] = (scores[idx] - mean) / (std + eps)
    return out


def test_grpo_singleton_groups_and_epsilon_of_each_peer():
    rng = np.random.default_rng(0)
    rewards = rng.random(9).astype(np.float32)
    ids = np.array([0, 0, 0, 1, 2, 2, 2, 3, 4], np.int32)  # groups 1, 3 and 4 are singletons
    mask = np.ones((9, 3), np.float32)

    def ours(**kw):
        return np.asarray(advantages.compute("grpo", jnp.asarray(rewards), jnp.asarray(ids), jnp.asarray(mask),
                                             **kw))[:, 0]

    verl = _verl_grpo(rewards.astype(np.float64), ids, 1e-6)
    np.testing.assert_allclose(ours(singleton="reward"), verl, rtol=1e-5)
    default = ours()
    assert np.all(default[[3, 7, 8]] == 0) and np.allclose(default[[0, 1, 2]], verl[[0, 1, 2]], rtol=1e-5)
    # AReaL's group normalisation: NormConfig eps 1e-5, unbiased std (groups of one do not occur there)
    big = ids != 1
    areal = _verl_grpo(rewards.astype(np.float64), ids, 1e-5)
    np.testing.assert_allclose(ours(eps=1e-5)[[0, 1, 2, 4, 5, 6]], areal[[0, 1, 2, 4, 5, 6]], rtol=1e-6)
    assert big.any()


def test_a3po_areal_config_is_areals_loglinear_decoupled_loss():
    """configs/a3po_areal.py: AReaL's loglinear pi_prox, eps_clip 0.4, tokens with
    pi_prox/pi_behav > 5 masked (behav_imp_weight_cap 5.0, kept in the denominator)."""
    from configs.a3po_areal import get_config

    c = get_config()
    cfg = O.make_config(c.objective)
    s = testing.random_batch(5, max_staleness=8, learner_version=8)
    behav, adv, m = (np.asarray(a, np.float64) for a in (s.batch.behav_logp, s.batch.advantages, s.batch.loss_mask))
    x = behav + 2.5 * np.random.default_rng(5).normal(size=behav.shape)  # some pi_prox/pi_behav beyond 5
    s = s._replace(policy=s.policy.replace(logp=jnp.asarray(x, jnp.float32)))
    v_theta, v_behav = int(s.policy.version), np.asarray(s.batch.versions)
    # AReaL compute_prox_logp_approximations: alpha = (v_prox - v_behav)/(v_theta - v_behav), v_prox = v_theta - 1
    frac = np.where((v_theta - v_behav > 0) & (v_behav >= 0), (v_theta - 1 - v_behav) / np.maximum(v_theta - v_behav, 1),
                    0.0)
    prox = behav + np.clip(frac, 0, 1) * (x - behav)
    w = np.exp(prox - behav)
    assert ((w > 5) & (m > 0)).any()
    r = np.exp(x - prox)
    tok = np.where(w <= 5.0, w, 0.0) * np.maximum(-adv * r, -adv * np.clip(r, 0.6, 1.4))
    ours = float(O.get("a3po")(s.policy, s.batch, cfg)[0])
    np.testing.assert_allclose(ours, (tok * m).sum() / m.sum(), rtol=1e-5)
    assert c.learner.num_minibatches == 1 and c.runtime.advantage_eps == 1e-5 and cfg.kl.coef == 0


def test_m2po_denominator_docs_and_areal():
    """M2PO: the docs' 1/sum|o_i| counts masked tokens (default); AReaL's code replaces
    loss_mask with the mask (loss_agg_rejected=drop)."""
    s, x, behav, prox, adv, m = _batch(6, drift=0.4)
    keep = R.m2po_keep(behav, prox, m, 0.04)
    tok = np.exp(prox - behav) * -(np.exp(x - prox) * adv) * keep
    assert 0 < keep.sum() < m.sum()
    np.testing.assert_allclose(_loss(s, name="m2po"), (tok * m).sum() / m.sum(), rtol=1e-5)
    np.testing.assert_allclose(_loss(s, name="m2po", loss_agg_rejected="drop"), (tok * m).sum() / (keep * m).sum(),
                               rtol=1e-5)


def test_m2po_areal_config_caps_a_kept_behaviour_weight_at_5_as_areal_does():
    """configs/m2po_areal.py: a token the second-moment mask keeps although pi_prox/pi_behav = 6
    (one outlier among many tokens with none: the kept mean stays below 0.04) is masked by
    AReaL's cap and stays in the denominator; configs/m2po.py trains it at full weight."""
    from configs.m2po import get_config as m2po_config
    from configs.m2po_areal import get_config

    s = testing.random_batch(7, num_prompts=6, length=24, drift=0.2)  # enough loss tokens to keep one outlier
    x, behav, adv, m = (np.asarray(a, np.float64) for a in (s.policy.logp, s.batch.behav_logp, s.batch.advantages,
                                                             s.batch.loss_mask))
    prox = behav.copy()
    t = tuple(np.argwhere((m > 0) & (np.abs(adv) > 0.1))[0])  # a token whose weight moves the loss
    prox[t] += np.log(6.0)
    s = s._replace(batch=s.batch.replace(prox_logp=jnp.asarray(prox, jnp.float32)))
    keep = R.m2po_keep(behav, prox, m, 0.04)
    assert keep[t] == 1 and (keep * m).sum() == m.sum()  # the outlier is kept
    w = np.exp(prox - behav)
    tok = lambda weight: (weight * -(np.exp(x - prox) * adv) * keep * m).sum() / (keep * m).sum()  # noqa: E731
    assert abs(tok(np.where(w <= 5.0, w, 0.0)) - tok(w)) > 1e-4  # the cap changes this step's loss
    areal, ours = (O.make_config(get_config().objective), O.make_config(m2po_config().objective))
    np.testing.assert_allclose(float(O.get("m2po")(s.policy, s.batch, areal)[0]), tok(np.where(w <= 5.0, w, 0.0)),
                               rtol=1e-5)
    np.testing.assert_allclose(float(O.get("m2po")(s.policy, s.batch, ours)[0]), tok(w), rtol=1e-5)
    c = get_config()
    assert c.learner.num_minibatches == 1 and c.runtime.max_staleness == 2 and c.runtime.advantage_eps == 1e-5


def test_every_difference_is_named_in_the_table():
    import os

    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), DOC)).read()
    table = text.split("## Where this project and verl / AReaL differ")[1].split("\n## ")[0]
    for option in ("gspo.loss_agg", "token_sum_norm", "loss_agg_rejected", "clip.dual_clip",
                   "runtime.singleton_groups", "runtime.advantage_eps", "configs/a3po_areal.py", "M2PO",
                   "configs/m2po_areal.py", "rejection_sampling", "m2po.scope"):
        assert option in table, option
