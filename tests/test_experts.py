"""`models/experts.py` with LoRA on the stacked experts (`lora.expert_side`): in every dispatch the
side path equals the merged weights and its gradients are the chain rule of the merged experts'
gradient, contracted in NumPy; fresh adapters leave the model unchanged bit for bit (remat:
`tests/test_lora.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import decoder, lora
from jaxrl_llm.models.config import ModelConfig
from tests.test_lora import _random_adapters

MOE = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=8, model_type="qwen3_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                  norm_topk_prob=True, lora_rank=3, lora_alpha=6.0, lora_targets=tuple(lora.TARGETS))


@pytest.mark.parametrize("dispatch", ["dense", "grouped", "blocked"])
def test_expert_adapters_are_the_merged_experts_and_their_gradients_the_chain_rule(dispatch):
    cfg = MOE.replace(moe_dispatch=dispatch)
    plain = cfg.without_lora()
    full = decoder.init_params(cfg, jax.random.key(0))
    base, fresh = lora.split(full)
    moe = fresh["layers_0"]["moe"]
    assert sorted(moe) == ["down_lora_a", "down_lora_b", "gate_lora_b", "gate_up_lora_a", "up_lora_b"]
    assert sum(x.size for x in jax.tree.leaves(fresh)) == lora.num_params(cfg)
    assert sum(x.size for x in jax.tree.leaves({k: v["moe"] for k, v in fresh.items()})) == lora.expert_params(cfg)
    # PEFT's kaiming-uniform bound over each expert's input (its lora_A [r E, in]), not E x in
    assert 0.5 / np.sqrt(16) < float(jnp.abs(moe["gate_up_lora_a"]).max()) <= 1 / np.sqrt(16)
    assert 0.5 / np.sqrt(12) < float(jnp.abs(moe["down_lora_a"]).max()) <= 1 / np.sqrt(12)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, (3, 11)))
    np.testing.assert_array_equal(models.full_logits(full, cfg, tokens), models.full_logits(base, plain, tokens))

    ad, s = _random_adapters(cfg, seed=1, scale=0.3), cfg.lora_scale
    tuned = models.full_logits(lora.combine(base, ad), cfg, tokens)
    merged = lora.merge(base, ad, s)
    assert float(jnp.abs(tuned - models.full_logits(base, plain, tokens)).max()) > 0.1
    np.testing.assert_allclose(tuned, models.full_logits(merged, plain, tokens), atol=2e-5, rtol=0)
    m, b0 = {k: np.asarray(v) for k, v in ad["layers_1"]["moe"].items()}, base["layers_1"]["moe"]
    np.testing.assert_allclose(merged["layers_1"]["moe"]["up"][3], np.asarray(b0["up"][3]) + s * m["gate_up_lora_a"][3]
                               @ m["up_lora_b"][3], atol=1e-6)

    def loss(logits):
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

    g_ad = jax.grad(lambda a: loss(models.full_logits(lora.combine(base, a), cfg, tokens)))(ad)
    g_w = jax.grad(lambda p: loss(models.full_logits(p, plain, tokens)))(merged)
    for layer in ("layers_0", "layers_1"):
        a, g = {k: np.asarray(v) for k, v in ad[layer]["moe"].items()}, g_w[layer]["moe"]
        got = {k: np.asarray(v) for k, v in g_ad[layer]["moe"].items()}
        gg, gu, gd = (np.asarray(g[t]) for t in ("gate", "up", "down"))  # [E, in, out]
        t = lambda x: x.transpose(0, 2, 1)  # noqa: E731
        # gate and up share A: its gradient sums both projections' chain rules
        want_a = s * (gg @ t(a["gate_lora_b"]) + gu @ t(a["up_lora_b"]))
        for name, want in (("gate_up_lora_a", want_a), ("gate_lora_b", s * t(a["gate_up_lora_a"]) @ gg),
                           ("up_lora_b", s * t(a["gate_up_lora_a"]) @ gu),
                           ("down_lora_a", s * gd @ t(a["down_lora_b"])),
                           ("down_lora_b", s * t(a["down_lora_a"]) @ gd)):
            np.testing.assert_allclose(got[name], want, atol=1e-6, rtol=1e-4, err_msg=f"{layer} {name}")
        assert float(np.abs(got["down_lora_a"]).max()) > 1e-5


def test_gate_and_up_are_adapted_together_on_a_mixture_of_experts():
    with pytest.raises(ValueError, match="gate and up projections are one weight.*target both or neither"):
        MOE.replace(lora_targets=("q", "gate", "down"))
    dense = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=8, lora_rank=2, lora_alpha=2.0, lora_targets=("gate",))
    assert dense.adapts("gate")  # a dense MLP's gate alone is fine


def test_blocked_dispatch_batched_and_looped_equal_dense_with_adapters():
    """Enough pairs per expert (a learner's batch) run the blocks as one batched matmul, fewer
    (decode) as a loop: both equal the dense dispatch in values and every gradient, adapters too."""
    from jaxrl_llm.models import experts, moe

    rng = np.random.default_rng(4)
    n, d, f, e, k, r = 300, 8, 6, 4, 2, 2  # 600 pairs: 150 an expert, past BATCHED_BLOCK / 2
    assert 2 * n * k >= experts.BATCHED_BLOCK * e
    arr = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)  # noqa: E731
    x, router = arr(n, d), arr(d, e)
    proj = [(arr(e, d, f), arr(e, d, r), arr(e, r, f)), (arr(e, d, f), arr(e, d, r), arr(e, r, f)),
            (arr(e, f, d), arr(e, f, r), arr(e, r, d))]

    def loss(run):
        def f(router, proj, x):
            weights, ids = moe.route(x @ router, k, True)
            return jnp.sum(run(x, *proj, weights, ids, jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    want = loss(experts.dense_experts)(router, proj, x)
    for run in (experts.blocked_experts, lambda *a: experts.blocked_experts(*a, block=16)):
        got = loss(run)(router, proj, x)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(jnp.abs(a).max()))
    def hlo(**kw):
        return jax.jit(lambda *a: experts.blocked_experts(*a, jnp.float32, **kw)).lower(
            x, *proj, *moe.route(x @ router, k, True)).as_text()

    assert "batching_dims = [0] x [0]" in hlo()  # the blocks as one batched matmul ...
    assert "batching_dims" not in hlo(block=16)  # ... or a loop of plain ones


def test_few_pairs_run_in_the_fewest_slots_that_hold_them_exact_for_any_load_with_adapters():
    """Decode-sized calls run each expert's pairs in [E, slots] (`slotted_experts`): with the
    load spread, piled on two experts (the ladder's top: every token), or left to the router,
    values and every gradient equal the dense dispatch; one switch over the ladder, no loop."""
    from jaxrl_llm.models import experts, moe

    rng = np.random.default_rng(5)
    n, d, f, e, k, r = 12, 8, 6, 4, 2, 2  # 24 pairs, 6 an expert: slots 8 or 12
    assert experts.slot_ladder(n, k, e) == [8, 12] and experts.slot_ladder(64, 4, 16) == [16, 24, 32, 40, 56, 64]
    arr = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)  # noqa: E731
    x, router = arr(n, d), arr(d, e)
    proj = [(arr(e, d, f), arr(e, d, r), arr(e, r, f)), (arr(e, d, f), arr(e, d, r), arr(e, r, f)),
            (arr(e, f, d), arr(e, f, r), arr(e, r, d))]
    spread = jnp.asarray(np.stack([np.arange(n) % e, (np.arange(n) + 1) % e], 1))  # 6 each: 8 slots
    piled = jnp.asarray(np.tile([[2, 0]], (n, 1)))  # 12 on experts 0 and 2: 12 slots

    def loss(run, ids):
        def f(router, proj, x):
            weights, routed = moe.route(x @ router, k, True)
            chosen = routed if ids is None else ids
            weights = weights if ids is None else moe.replay(x @ router, ids, True)[0]
            return jnp.sum(jnp.sin(run(x, *proj, weights, chosen, jnp.float32)))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    for ids in (spread, piled, None):
        want = loss(experts.dense_experts, ids)(router, proj, x)
        got = loss(experts.blocked_experts, ids)(router, proj, x)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))
    # too few slots leave pairs out: what the switch's choice guards against
    weights, _ = moe.replay(x @ router, piled, True)
    short = experts.capacity_experts(x, *proj, weights, piled, jnp.float32, 8)
    assert float(jnp.abs(short - experts.dense_experts(x, *proj, weights, piled, jnp.float32)).max()) > 1e-2
    hlo = jax.jit(lambda *a: experts.blocked_experts(*a, jnp.float32)).lower(x, *proj, weights, piled).as_text()
    assert hlo.count("stablehlo.case") == 1 and "stablehlo.while" not in hlo
