"""LoRA: the side path against merged weights, PEFT export loaded by `peft`, adapters-only
training (base bit-identical, one update against a NumPy Adam), adapter-only publication."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.learner import learner as L
from jaxrl_llm import models, objectives, testing
from jaxrl_llm.parallel import sharding
from jaxrl_llm.models import adapters as peft_dir
from jaxrl_llm.models import decoder, lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.runtime.weights import WeightStore
from tests import hf_fixtures as F

ALL = tuple(lora.TARGETS)
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
PLAIN = CFG.replace(lora_rank=0, lora_alpha=0.0, lora_targets=())


def _random_adapters(cfg, seed=1, scale=0.1):
    _, ad = lora.split(decoder.init_params(cfg, jax.random.key(0)))
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree_util.tree_map(lambda x: scale * jax.random.normal(next(keys), x.shape), ad)


def test_side_path_equals_merged_weights_and_init_equals_base():
    full = decoder.init_params(CFG, jax.random.key(0))
    base, fresh = lora.split(full)
    assert lora.split(decoder.init_params(PLAIN, jax.random.key(0)))[1] == {}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    ref = models.full_logits(base, PLAIN, tokens)
    # Fresh adapters (B = 0) leave the base's function exactly: the same logits, bit for bit.
    np.testing.assert_array_equal(models.full_logits(full, CFG, tokens), ref)
    assert all(float(jnp.abs(x).sum()) == 0 for p, x in jax.tree_util.tree_leaves_with_path(fresh)
               if str(p[-1].key).endswith("_b"))
    a = fresh["layers_0"]["attn"]["q_lora_a"]
    assert 0 < float(jnp.abs(a).max()) <= 1 / np.sqrt(32)  # PEFT's kaiming-uniform bound 1/sqrt(in)
    ad = _random_adapters(CFG)
    tuned = models.full_logits(lora.combine(base, ad), CFG, tokens)
    merged = models.full_logits(lora.merge(base, ad, CFG.lora_scale), PLAIN, tokens)
    assert float(jnp.abs(tuned - ref).max()) > 0.1  # the adapters matter
    np.testing.assert_allclose(tuned, merged, atol=1e-5, rtol=0)
    # Independent merge in NumPy for one kernel of each layout: W + (alpha / r) A B.
    o = np.asarray(base["layers_1"]["attn"]["o"]["kernel"]) + 2.0 * np.einsum(
        "hdr,re->hde", ad["layers_1"]["attn"]["o_lora_a"], ad["layers_1"]["attn"]["o_lora_b"])
    np.testing.assert_allclose(lora.merge(base, ad, 2.0)["layers_1"]["attn"]["o"]["kernel"], o, atol=1e-6)


# adapters on attention and on every expert of a mixture of experts (`lora.expert_side`)
MOE = CFG.replace(model_type="qwen3_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                  norm_topk_prob=True)


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "experts"])
def test_remat_gives_the_same_adapter_gradients(cfg):
    base, _ = lora.split(decoder.init_params(cfg, jax.random.key(0)))
    ad = _random_adapters(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)))

    def f(a, cfg):
        return jnp.sum(jnp.square(models.full_logits(lora.combine(base, a), cfg, tokens)))

    g0 = jax.grad(f)(ad, cfg)
    for remat in ("full", "dots"):
        g1 = jax.grad(f)(ad, cfg.replace(remat=remat))
        jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), g0, g1)


def test_peft_loads_our_export_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    model = F.make_hf_model("qwen3")  # q/k norms, o bias: every projection layout
    path = F.save(model, str(tmp_path / "base"))
    params, cfg = models.load_params(path)
    cfg = cfg.replace(lora_rank=4, lora_alpha=16.0, lora_targets=ALL)
    ad = _random_adapters(cfg, seed=3, scale=0.2)
    peft_dir.save(str(tmp_path / "adapter"), ad, cfg, base_model=path)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 20))
    ours = np.asarray(models.full_logits(lora.combine(params, ad), cfg, jnp.asarray(tokens)))
    plain = F.hf_logits(model, tokens)
    tuned = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    theirs = F.hf_logits(tuned, tokens)
    assert np.abs(theirs - plain).max() > 0.1  # the adapters were applied
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # ... and the directory reads back into the same adapters; a different rank is refused by name.
    back = peft_dir.load(str(tmp_path / "adapter"), cfg)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32), y), ad, back)
    with pytest.raises(ValueError, match=r"r \(model.lora.rank\).*has 4, this run 8"):
        peft_dir.load(str(tmp_path / "adapter"), cfg.replace(lora_rank=8))


@pytest.mark.parametrize("arch,targets", [("qwen3_moe", ALL), ("qwen2_moe", ("v", "down"))])
def test_peft_loads_our_expert_adapters_with_the_same_logits(arch, targets, tmp_path):
    """Adapters on stacked experts export as PEFT `target_parameters` on transformers' fused
    experts (qwen3_moe: gate_up_proj and down_proj, nested, beside a dense layer PEFT leaves
    frozen; qwen2_moe: down_proj alone, beside a frozen shared expert)."""
    peft = pytest.importorskip("peft")
    from tests.test_moe import _hf_model

    model = _hf_model(arch)
    path = F.save(model, str(tmp_path / "base"))
    params, cfg = models.load_params(path)
    cfg = cfg.replace(lora_rank=3, lora_alpha=6.0, lora_targets=targets)
    ad = _random_adapters(cfg, seed=3, scale=0.2)
    assert "mlp" not in ad.get("layers_1", {})  # qwen3_moe's dense layer 1 has no adapters
    peft_dir.save(str(tmp_path / "adapter"), ad, cfg, base_model=path)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 20))
    ours = np.asarray(models.full_logits(lora.combine(params, ad), cfg, jnp.asarray(tokens)))
    plain = F.hf_logits(model, tokens)
    theirs = F.hf_logits(peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval(), tokens)
    assert np.abs(theirs - plain).max() > 1.0
    np.testing.assert_allclose(ours, theirs, atol=5e-5, rtol=0)
    back = peft_dir.load(str(tmp_path / "adapter"), cfg)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32), y), ad, back)
    other = ("v", "gate", "up") if arch == "qwen2_moe" else ("q", "k", "v", "o", "down")
    with pytest.raises(ValueError, match=r"target_parameters \(model.lora.targets\)"):
        peft_dir.load(str(tmp_path / "adapter"), cfg.replace(lora_targets=other))


def _learner(objective="ppo", cfg=CFG, **lc):
    c = L.default_config()
    c.update(dict(lr=3e-3, num_minibatches=2, packing="off"), **lc)
    return L.Learner(cfg, {"name": objective} if isinstance(objective, str) else objective, c,
                     mesh=sharding.make_mesh(None, jax.devices()[:1]))


def test_only_adapters_train_and_one_update_matches_numpy_adam():
    lrn = _learner(num_minibatches=1, max_grad_norm=1e9)
    st = lrn.init(jax.random.key(0))
    base0 = jax.device_get(lrn.base)
    batch = testing.model_batch(lrn.policy_params(st), PLAIN, seed=0, version=0)
    # The gradient the step will take, computed independently of the optimizer.
    prepared, _, _ = lrn.prepare(st, batch)
    from jaxrl_llm.learner import update

    (value, _), g = jax.value_and_grad(update.loss, has_aux=True)(
        st.params, prepared, st.version, jax.random.fold_in(st.rng, st.step), plan=lrn.plan, base=lrn.base)
    p0 = jax.device_get(st.params)
    st, m = lrn.train_step(st, batch)
    assert m["skipped_updates"] == 0 and m["loss"] == pytest.approx(float(value), abs=1e-6)
    # Adam's first step (bias-corrected m / sqrt(v) = g / (|g| + eps)) for each adapter leaf.
    for x0, gx, x1 in zip(jax.tree.leaves(p0), jax.tree.leaves(jax.device_get(g)), jax.tree.leaves(st.params)):
        gx = np.asarray(gx, np.float64)
        expect = x0 - 3e-3 * gx / (np.abs(gx) + 1e-8)
        np.testing.assert_allclose(np.asarray(x1), expect, atol=1e-6, rtol=1e-5)
    # Gradients reached adapters only: the frozen base is unchanged bit for bit after two steps,
    # and the optimizer holds moments for the adapters alone.
    st, _ = lrn.train_step(st, testing.model_batch(lrn.policy_params(st), PLAIN, seed=1, version=1))
    jax.tree_util.tree_map(np.testing.assert_array_equal, base0, jax.device_get(lrn.base))
    assert jax.tree.structure(st.opt_state[1][0].mu) == jax.tree.structure(st.params)
    assert m["param_norm"] == pytest.approx(float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(p0)))
                                                   ), rel=0.05)


def test_publication_carries_the_adapters_and_samplers_get_merged_weights():
    lrn = _learner()
    st = lrn.init(jax.random.key(0))
    st = st.replace(params=_random_adapters(CFG))
    store = WeightStore(dtype="float32", lora_scale=CFG.lora_scale)
    store.publish(1, lrn.rollout_params(st), base=lrn.rollout_base)
    assert store.published_bytes == lora.size_bytes(st.params) == 4 * lora.num_params(CFG)
    assert store.published_bytes < 0.2 * 4 * PLAIN.num_params
    _, sampled = store.latest()
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6),
                           sampled, lrn.policy_params(st))
    assert "q_lora_a" not in sampled["layers_0"]["attn"]  # plain decoder params: the base model's decode step
    # What sampler nodes fetch: the adapters of the version (a private copy: the learner donates
    # its state to the next step) and, once, the base.
    expect = jax.device_get(st.params)
    jax.tree.map(lambda x: x.delete(), st.params)
    v, published = store.publication()
    assert v == 1
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(published), expect)
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(store.base()), jax.device_get(lrn.base))


SMALL = CFG.replace(num_layers=1, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("name", sorted(objectives.registry()))
def test_one_lora_step_for_every_registered_objective(name):
    """Each objective trains adapters only, with a KL term against the base (adapters off)."""
    aux_cfg = SMALL.without_lora() if objectives.get(name).aux is not None else None
    c = L.default_config()
    c.update(dict(lr=1e-2, num_minibatches=2, packing="off"))
    lrn = L.Learner(SMALL, {"name": name, "kl": {"coef": 0.05}}, c, aux_model_cfg=aux_cfg,
                    mesh=sharding.make_mesh(None, jax.devices()[:1]))
    st = lrn.init(jax.random.key(0))
    base0, ad0 = jax.device_get(lrn.base), jax.device_get(st.params)
    st, m = lrn.train_step(st, testing.model_batch(lrn.policy_params(st), SMALL.without_lora(), seed=1))
    assert np.isfinite(m["loss"]) and m["skipped_updates"] == 0
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the base
    jax.tree_util.tree_map(np.testing.assert_array_equal, base0, jax.device_get(lrn.base))
    moved = [float(np.abs(np.asarray(x) - y).max()) for x, y in zip(jax.tree.leaves(st.params), jax.tree.leaves(ad0))]
    assert max(moved) > 0
    assert jax.tree.structure(st.ref_params) == jax.tree.structure(st.params)  # a reference at adapter size


def test_adapter_gradients_are_the_chain_rule_of_the_merged_kernels_gradient():
    """dL/dA = s G B^T and dL/dB = s A^T G, with G = dL/dW' the full-weight gradient of the
    merged model W' = W + s A B (a different program: no side path), contracted in NumPy."""
    base, _ = lora.split(decoder.init_params(CFG, jax.random.key(0)))
    ad = _random_adapters(CFG, seed=4)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)))
    s = CFG.lora_scale

    def loss(logits):
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

    g_ad = jax.grad(lambda a: loss(models.full_logits(lora.combine(base, a), CFG, tokens)))(ad)
    g_w = jax.grad(lambda p: loss(models.full_logits(p, PLAIN, tokens)))(lora.merge(base, ad, s))
    for layer in ("layers_0", "layers_1"):
        for mod, t in [("attn", t) for t in ("q", "k", "v", "o")] + [("mlp", t) for t in ("gate", "up", "down")]:
            a, b = np.asarray(ad[layer][mod][f"{t}_lora_a"]), np.asarray(ad[layer][mod][f"{t}_lora_b"])
            g = np.asarray(g_w[layer][mod][t]["kernel"])
            a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1)
            g2 = g.reshape(a2.shape[0], b2.shape[1])
            np.testing.assert_allclose(np.asarray(g_ad[layer][mod][f"{t}_lora_a"]).reshape(a2.shape),
                                       s * g2 @ b2.T, atol=1e-6, rtol=1e-4)
            np.testing.assert_allclose(np.asarray(g_ad[layer][mod][f"{t}_lora_b"]).reshape(b2.shape),
                                       s * a2.T @ g2, atol=1e-6, rtol=1e-4)
