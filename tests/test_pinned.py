"""Behaviour pinned across refactors: every objective's loss and gradient on a fixed synthetic
batch, and two learner steps per objective on a tiny model (Jackpot also with a jointly
trained rollout actor), against numbers recorded in `pinned.json` before the core was
reorganised. Regenerate only for an intended change of behaviour:

    python -m tests.test_pinned                 # rewrites tests/pinned.json
    python -m tests.test_pinned objective/gspo  # rewrites the named cases only

Tolerances allow for another CPU kind's float rounding (AVX2 vs AVX-512), not for changes.
"""

import json
import os

import jax
import numpy as np
import pytest

from jaxrl_llm.learner import learner as L
from jaxrl_llm import objectives as O
from jaxrl_llm import testing
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models.config import ModelConfig

PATH = os.path.join(os.path.dirname(__file__), "pinned.json")
CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True)
ACTOR = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8)
OBJECTIVES = {
    "ppo": dict(name="ppo", clip=dict(eps_high=0.28, dual_clip=3.0)),
    "decoupled_ppo": dict(name="decoupled_ppo", is_correction=dict(kind="tis"), kl=dict(coef=0.1)),
    "a3po": dict(name="a3po", loss_agg="seq_mean_token_mean"),
    "gspo": dict(name="gspo"),
    "gspo_token": dict(name="gspo", gspo=dict(variant="token", loss_agg="seq_mean_token_sum")),
    "gepo": dict(name="gepo", gepo=dict(eps_mode="var")),
    "offpolicy_grpo": dict(name="offpolicy_grpo", offpolicy_grpo=dict(r_prime="prox")),
    "offpolicy_grpo_one": dict(name="offpolicy_grpo"),
    "jackpot": dict(name="jackpot"),
    "jackpot_ref": dict(name="jackpot", jackpot=dict(p_target="ref", lam=1.3)),
    "m2po": dict(name="m2po", m2po=dict(tau=0.002)),
    "cispo": dict(name="cispo"),
}
LEARNER_CASES = ("ppo", "decoupled_ppo", "a3po", "gepo", "offpolicy_grpo_one", "jackpot", "jackpot_ref", "m2po",
                 "cispo")


def objective_numbers(key):
    s = testing.random_batch(seed=3)
    cfg = O.make_config(OBJECTIVES[key])
    fn = O.get(cfg.name)

    def loss(logp):
        return fn(s.policy.replace(logp=logp), s.batch, cfg)[0]

    value, grad = jax.value_and_grad(loss)(s.policy.logp)
    return {"loss": float(value), "grad": np.asarray(grad).ravel().tolist()}


def _learner(key, actor):
    c = L.default_config()
    c.lr, c.num_minibatches = 3e-3, 2
    kw = dict(aux_model_cfg=ACTOR) if actor else {}
    return L.Learner(CFG, OBJECTIVES[key], c, mesh=sharding.make_mesh(None, jax.devices()[:1]), **kw)


def learner_numbers(key, actor=False):
    lrn = _learner(key, actor)
    state = lrn.init(jax.random.key(0))
    out = []
    for i in range(2):
        batch = testing.model_batch(state.params, CFG, seed=i, version=i + 1, max_staleness=1)
        state, m = lrn.train_step(state, batch)
        out.append({k: v for k, v in m.items() if not k.endswith("_time_s") and k not in ("tokens_per_s",)})
    return out


def _cases():
    cases = {f"objective/{k}": (objective_numbers, (k,)) for k in OBJECTIVES}
    cases.update({f"learner/{k}": (learner_numbers, (k,)) for k in LEARNER_CASES})
    cases["learner/jackpot_actor"] = (learner_numbers, ("jackpot", True))
    return cases


@pytest.fixture(scope="module")
def pinned():
    with open(PATH) as f:
        return json.load(f)


@pytest.mark.parametrize("case", [k for k in _cases() if k.startswith("objective/")])
def test_objective_loss_and_gradient_unchanged(case, pinned):
    fn, args = _cases()[case]
    got, want = fn(*args), pinned[case]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["grad"], want["grad"], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("case", [k for k in _cases() if k.startswith("learner/")])
def test_learner_steps_unchanged(case, pinned):
    fn, args = _cases()[case]
    got, want = fn(*args), pinned[case]
    for g, w in zip(got, want):
        assert set(w) <= set(g), set(w) - set(g)  # no pinned metric lost (new diagnostics may appear)
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=2e-4, atol=2e-6, err_msg=f"{case} {k}")


if __name__ == "__main__":  # python -m tests.test_pinned [case ...]: rewrite all cases, or only those named
    import sys

    names = sys.argv[1:] or list(_cases())
    data = json.load(open(PATH)) if sys.argv[1:] else {}
    data.update({name: _cases()[name][0](*_cases()[name][1]) for name in names})
    with open(PATH, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {len(names)} case(s) to {PATH}")
