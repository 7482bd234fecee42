"""`models/moe.py`: Qwen3-MoE and Qwen2-MoE layers against transformers (logits, greedy generation,
export round trip), both dispatches alike in values and gradients, the router's gradient under
replay against a NumPy layer, the load-balancing loss against transformers', and the parameter
counts (total vs active)."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm import models
from jaxrl_llm.models import decoder, experts, moe
from jaxrl_llm.rollout import Sampler, SamplerConfig
from tests import hf_fixtures as F

ARCHS = {
    # top-2 of 4 renormalised, q/k norms, layer 1 dense (mlp_only_layers)
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                    norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
                                                    head_dim=12, tie_word_embeddings=False)),
    # top-2 of 6 not renormalised, a sigmoid-gated shared expert, q/k/v biases
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                                    shared_expert_intermediate_size=40, norm_topk_prob=False,
                                                    num_hidden_layers=2, tie_word_embeddings=False)),
}


def _hf_model(arch):
    cls, kw = ARCHS[arch]
    base = dict(vocab_size=104, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**base, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = F.save(model, str(tmp_path_factory.mktemp(request.param)))
    params, cfg = models.load_params(path)
    return request.param, model, path, params, cfg


def test_config_and_parameter_counts(pair):
    arch, _, _, params, cfg = pair
    assert cfg.model_type == arch and cfg.num_experts == ARCHS[arch][1]["num_experts"]
    assert [cfg.sparse(i) for i in range(cfg.num_layers)] == ([True, False, True] if arch == "qwen3_moe" else [True] * 2)
    assert cfg.qk_norm == (arch == "qwen3_moe") and cfg.qkv_bias == (arch == "qwen2_moe") and not cfg.o_bias
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
    e, k, d, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    sparse = sum(cfg.sparse(i) for i in range(cfg.num_layers))
    assert cfg.num_params - cfg.active_params == sparse * (e - k) * 3 * d * f


@pytest.mark.parametrize("dispatch", ["dense", "grouped", "blocked"])
def test_logits_match_transformers(pair, dispatch):
    _, model, _, params, cfg = pair
    cfg = cfg.replace(moe_dispatch=dispatch)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 24))
    mask = np.ones_like(tokens)
    mask[1, :5] = 0  # left padding
    ours = np.asarray(models.full_logits(params, cfg, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = F.hf_logits(model, tokens, mask)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours[mask > 0], ref[mask > 0], atol=1e-5, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    _, model, _, params, cfg = pair
    prompt = [5, 17, 33, 2, 91, 40]
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=12, temperature=0.0, prompt_buckets=(8,), decode_segment=4,
                                         num_samples=1, capture_topk=0))
    batch = sampler.generate(params, [prompt], jax.random.key(0))
    ours = np.asarray(batch.tokens)[0, 8:].tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref


def test_export_round_trip_loads_in_transformers(pair, tmp_path):
    _, model, _, params, cfg = pair
    models.save_params(str(tmp_path), params, cfg)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 20))
    np.testing.assert_allclose(F.hf_logits(reloaded, tokens), F.hf_logits(model, tokens), atol=1e-5, rtol=0)
    params2, cfg2 = models.load_params(str(tmp_path))
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def test_a_checkpoint_with_its_experts_fused_loads_as_the_hub_layout_does(pair, tmp_path):
    """transformers v5 writes a mixture's experts fused (`experts.gate_up_proj`, `down_proj`:
    `save_original_format=False`, offloaded models): the same params as the hub's per-expert
    layout; a fused tensor of another shape is named before anything is loaded, and so is an
    expert count the weights do not hold."""
    from safetensors.numpy import load_file, save_file

    _, model, hub, params, cfg = pair
    more = cfg.replace(num_experts=cfg.num_experts + 2)  # counted before the model's shapes are traced
    with pytest.raises(ValueError, match=re.escape(f"it gives num_experts={more.num_experts}, they hold "
                                                   f"{cfg.num_experts} (indices 0..{cfg.num_experts - 1})")):
        models.check_weights(hub, more)
    fused = F.save(model, str(tmp_path), save_original_format=False)
    tensors = load_file(f"{fused}/model.safetensors")
    gate_up = sorted(n for n in tensors if n.endswith("mlp.experts.gate_up_proj"))
    assert gate_up and not any(".experts.0." in n for n in tensors)
    models.check_weights(fused, cfg)
    got, _ = models.load_params(fused)
    jax.tree.map(np.testing.assert_array_equal, got, params)
    tensors[gate_up[0]] = tensors[gate_up[0]][:, 1:]  # an odd number of rows: no gate / up halves
    save_file(tensors, f"{fused}/model.safetensors", metadata={"format": "pt"})
    shape = [cfg.num_experts, 2 * cfg.moe_intermediate_size - 1, cfg.hidden_size]
    with pytest.raises(ValueError, match=re.escape(f"{gate_up[0]} in {fused}/model.safetensors has shape {shape}, ")):
        models.check_weights(fused, cfg)
    missing = f"lacks {2 * cfg.num_experts} tensor(s), e.g. model.layers.0.mlp.experts.0.gate_proj"
    with pytest.raises(ValueError, match=re.escape(missing)):
        models.load_params(fused)  # (loaded without the check: that layer's experts are missing)


def test_dispatches_agree_in_values_and_gradients_and_the_router_learns():
    rng = np.random.default_rng(3)
    n, d, f, e, k = 40, 8, 6, 5, 2  # blocked: 80 pairs in blocks of 16, every expert's run padded
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((d, e), (e, d, f), (e, d, f), (e, f, d))]

    def out(dispatch, router, gate, up, down):
        weights, ids = moe.route(x @ router, k, True)
        run = {"dense": experts.dense_experts, "grouped": experts.grouped_experts, "blocked": experts.blocked_experts}
        return run[dispatch](x, gate, up, down, weights, ids, jnp.float32)

    dense = out("dense", *w)
    loss = lambda dispatch: lambda *p: jnp.sum(out(dispatch, *p) ** 2)  # noqa: E731
    g_dense = jax.grad(loss("dense"), argnums=(0, 1, 2, 3))(*w)
    for other in ("grouped", "blocked"):
        np.testing.assert_allclose(out(other, *w), dense, atol=1e-5)
        for a, b in zip(g_dense, jax.grad(loss(other), argnums=(0, 1, 2, 3))(*w)):
            np.testing.assert_allclose(b, a, atol=1e-4)
    assert float(jnp.abs(g_dense[0]).max()) > 1e-3  # the router gets a gradient through the chosen weights
    # the router's gradient by central differences (the top-k set does not change at this step size)
    i, j, h = 2, 3, 1e-3
    bump = jnp.zeros((d, e)).at[i, j].set(h)
    fd = (loss("dense")(w[0] + bump, *w[1:]) - loss("dense")(w[0] - bump, *w[1:])) / (2 * h)
    assert float(g_dense[0][i, j]) == pytest.approx(float(fd), rel=2e-2)


def test_load_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(4)
    layers = [rng.normal(size=(2 * 7, 6)).astype(np.float32) for _ in range(3)]
    mask = (rng.random((2, 7)) > 0.3).astype(np.int64)
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in layers), 6, 2,
                                       None if m is None else torch.tensor(m)).item()
        ours = float(moe.load_balancing_loss(layers, 2, None if m is None else m.reshape(-1)))
        assert ours == pytest.approx(ref, rel=1e-5)
    uniform = [np.zeros((10, 4), np.float32)]  # uniform router: f_e = k / E... the minimum, k
    assert float(moe.load_balancing_loss(uniform, 2)) == pytest.approx(2.0, rel=1e-5)


def test_the_forwards_load_balancing_loss_is_transformers_aux_loss_and_reaches_the_router(pair):
    """`balance=True`: the forward's load-balancing loss over the real tokens of a left-padded
    batch equals transformers' `aux_loss` (`output_router_logits=True`), and its gradient reaches
    the routers alike under every remat mode (remat=full's custom VJP carries the logits' cotangent)."""
    from jaxrl_llm.models import heads

    arch, model, _, params, cfg = pair
    rng = np.random.default_rng(9)
    tokens = rng.integers(1, cfg.vocab_size, (3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[0, :4] = mask[2, :7] = 0
    t, m = torch.as_tensor(tokens), torch.as_tensor(mask)
    with torch.no_grad():
        want = model(t, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0), output_router_logits=True).aux_loss
    ours = heads.sequence_logprobs(params, cfg, jnp.asarray(tokens), jnp.asarray(mask), balance=True)["moe_aux_loss"]
    assert float(ours) == pytest.approx(float(want), rel=1e-5)
    grads = {}
    for remat in ("none", "dots", "full"):
        c = cfg.replace(remat=remat)
        aux = lambda p: heads.sequence_logprobs(p, c, jnp.asarray(tokens), jnp.asarray(mask), balance=True)["moe_aux_loss"]  # noqa: E731
        grads[remat] = jax.grad(aux)(params)
    router = lambda g: g["layers_0"]["moe"]["router"]  # noqa: E731
    assert float(jnp.abs(router(grads["none"])).max()) > 1e-4
    for remat in ("dots", "full"):
        np.testing.assert_allclose(router(grads[remat]), router(grads["none"]), atol=1e-6)


def test_a_run_trains_a_mixture_of_experts_on_a_sharded_mesh(pair, tmp_path):
    """An MoE checkpoint as the policy of a run (embedded task, its ids inside the vocabulary):
    its weights checked, sharded over fsdp x expert x tensor (each device holds half the experts),
    its steps run with the sampler's log-probs (one device, every expert) equal to the learner's;
    for qwen2_moe with LoRA on its experts too (their adapters split over expert), for qwen3_moe
    with the tokens exchanged by all-to-all (`model.moe.exchange`)."""
    from jaxrl_llm.run import experiment
    from tests.test_experiment import _tiny

    arch, _, path, _, cfg = pair
    models.check_weights(path, cfg)
    c = _tiny("ppo")
    c.model.hf_path = path
    c.mesh.update(data=1, fsdp=2, expert=2, tensor=2)
    if arch == "qwen2_moe":  # LoRA on its attention and experts (the shared expert stays frozen)
        c.model.lora.update(rank=4, targets="q,v,gate,up,down")
    else:
        c.model.moe.exchange = "all_to_all"
    c.train.update(steps=2, eval_every=2, save_every=2)
    lines = []
    summary = experiment.run(c, str(tmp_path), log=lines.append)
    assert summary["version"] == 2
    total, active = cfg.num_params / 1e6, cfg.active_params / 1e6
    assert f"mixture of experts: {cfg.num_experts} experts, top 2; {total:.1f}M parameters, {active:.1f}M active" \
        in "\n".join(lines)
    steps = [__import__("json").loads(x) for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert all(np.isfinite(s["loss"]) for s in steps)
    # the sampler's behaviour log-probs are the learner's (same routing, float32 throughout)
    assert max(s["mismatch/abs_logp_max"] for s in steps) < 1e-4
    assert all(0 <= s["moe/routing_differs_tokens"] <= 1 for s in steps)  # the sampler's routing, on the mesh


def test_every_expert_weight_gets_a_gradient(pair):
    from jaxrl_llm.models import heads

    _, _, _, params, cfg = pair
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (4, 32)))
    grads = jax.grad(lambda p: jnp.sum(heads.sequence_logprobs(p, cfg, tokens, jnp.ones_like(tokens),
                                                               entropy=False)["logp"]))(params)
    layer = grads["layers_0"]["moe"]
    assert set(layer) >= {"router", "gate", "up", "down"}
    for name, g in layer.items():
        per_expert = jnp.abs(g).reshape(g.shape[0], -1).max(1) if name in ("gate", "up", "down") else jnp.abs(g).max()
        assert bool(jnp.all(per_expert > 0)), name  # 128 tokens reach every one of the experts


def test_auto_dispatch_by_platform_and_expert_count():
    cfg = models.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=4, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2,
                             moe_intermediate_size=4)
    assert moe.dispatch(cfg, "cpu") == "blocked" and moe.dispatch(cfg, "gpu") == "grouped"
    assert moe.dispatch(cfg.replace(num_experts=4), "cpu") == "dense"
    assert moe.dispatch(cfg.replace(num_experts=8), "tpu") == "dense"
    assert moe.dispatch(cfg.replace(moe_dispatch="grouped"), "cpu") == "grouped"


def _layer_on(mesh_sizes, dispatch, rows=8, length=16, lora_rank=0, exchange="gather", platform=None):
    """A 16-expert top-4 layer's output and gradients (parameters, input), on one device or on a mesh of 8 (with
    `lora_rank`, random adapters on its experts; `exchange`: `ModelConfig.moe_exchange`).
    `platform`: the step on the mesh exported for it (`jax.export`) instead of run."""
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxrl_llm.models import attention
    from jaxrl_llm.parallel import sharding

    cfg = models.ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=2,
                             num_kv_heads=2, head_dim=16, model_type="qwen3_moe", num_experts=16,
                             num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                             moe_dispatch=dispatch, lora_rank=lora_rank, lora_alpha=2.0 * lora_rank,
                             lora_targets=("gate", "up", "down") if lora_rank else (), moe_exchange=exchange)
    layer = moe.MoE(cfg)
    x = jax.random.normal(jax.random.key(1), (rows, length, 32))
    params = layer.init(jax.random.key(0), x)
    keys = iter(jax.random.split(jax.random.key(2), 8))
    params = jax.tree_util.tree_map_with_path(  # B != 0: the adapters act and A gets a gradient
        lambda p, v: v + 0.2 * jax.random.normal(next(keys), v.shape) if "lora_b" in jax.tree_util.keystr(p) else v,
        params)
    out = lambda p, x: layer.apply(p, x)[0]  # noqa: E731  (the layer's output; [1]: its router logits)
    step = jax.jit(lambda p, x: (out(p, x), jax.grad(lambda p, x: jnp.sum(out(p, x) ** 2), (0, 1))(p, x)))
    if mesh_sizes is None:
        return step(params, x), step.lower(params, x).compile(), params
    c = sharding.default_config()
    c.update(**{**dict(data=1, fsdp=1, expert=1, tensor=1), **mesh_sizes})
    mesh = sharding.make_mesh(c)
    params = jax.device_put(params, sharding.param_shardings(nn.get_partition_spec(params), mesh))
    x = jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH_AXES) if rows % mesh.size == 0 else P()))
    with attention.on_mesh(cfg, mesh):
        if platform:
            unchecked = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
            return jax.export.export(step, platforms=[platform], disabled_checks=unchecked)(params, x).mlir_module()
        compiled = step.lower(params, x).compile()
    return compiled(params, x), compiled, params


@pytest.mark.parametrize("dispatch", ["dense", "blocked", "grouped"])
def test_expert_parallel_on_8_devices_equals_one_device(dispatch):
    """Experts split over `expert` (each device holds 16 / expert of them and runs its group's
    tokens through them), with fsdp and tensor splits beside it: values and every gradient equal
    one device's. And each device sorts only its own tokens: before `experts.on_devices`, XLA gathered
    every token of a data-parallel batch onto every device for the sort-based dispatches (each
    device's FLOPs 0.74x (blocked) and 1.0x (grouped) of the whole batch's on one device)."""
    (y1, g1), one, _ = _layer_on(None, dispatch)
    for sizes in (dict(data=2, expert=4), dict(fsdp=2, expert=2, tensor=2), dict(data=8)):
        (y8, g8), compiled, params = _layer_on(sizes, dispatch)
        np.testing.assert_allclose(y8, y1, atol=1e-5 * float(jnp.abs(y1).max()))
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
            np.testing.assert_allclose(b, a, atol=1e-5 * float(jnp.abs(a).max()))
        held = params["params"]["gate"].unbox().addressable_shards[0].data.shape[0]
        assert held == 16 // sizes.get("expert", 1)
        if sizes == dict(data=8):
            ratio = compiled.cost_analysis()["flops"] / one.cost_analysis()["flops"]
            assert ratio < 0.4, ratio
    (y1, g1), _, _ = _layer_on(None, dispatch, rows=3, length=7)  # 21 tokens: padded to 24 with no expert
    (y8, g8), _, _ = _layer_on(dict(data=2, expert=4), dispatch, rows=3, length=7)
    np.testing.assert_allclose(y8, y1, atol=1e-5 * float(jnp.abs(y1).max()))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
        np.testing.assert_allclose(b, a, atol=1e-5 * float(jnp.abs(a).max()))


@pytest.mark.parametrize("dispatch", ["dense", "blocked", "grouped"])
def test_expert_adapters_on_8_devices_equal_one_device(dispatch):
    """LoRA on the experts under expert parallelism: each device holds its experts' adapters,
    their B split over tensor with the MLP; values and every gradient equal one device's."""
    (y1, g1), _, _ = _layer_on(None, dispatch, lora_rank=2)
    for sizes in (dict(data=2, expert=4), dict(fsdp=2, expert=2, tensor=2)):
        (y8, g8), _, params = _layer_on(sizes, dispatch, lora_rank=2)
        np.testing.assert_allclose(y8, y1, atol=1e-5 * float(jnp.abs(y1).max()))
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
            np.testing.assert_allclose(b, a, atol=1e-5 * float(jnp.abs(a).max()))
        assert float(jnp.abs(g1[0]["params"]["down_lora_a"].unbox()).max()) > 1e-4
        held = params["params"]["gate_up_lora_a"].unbox().addressable_shards[0].data.shape[0]
        assert held == 16 // sizes["expert"]


def test_the_expert_axis_must_divide_the_experts(pair):
    from jaxrl_llm.parallel import sharding

    arch, _, _, params, cfg = pair
    c = sharding.default_config()
    c.update(data=2, expert=4)
    problems = sharding.check_divisible(models.logical_axes(cfg), params, sharding.make_mesh(c), rows=8)
    if arch == "qwen3_moe":  # 4 experts
        assert problems == []
    else:
        assert len(problems) == 1 and "mesh.expert=4 does not divide the model's expert [6]" in problems[0]
        assert "--config.mesh.expert to one of [1, 2]" in problems[0]


def _sampled(params, cfg, seed=1):
    from jaxrl_llm.models import decoder

    s = Sampler(cfg, SamplerConfig(max_new_tokens=10, temperature=1.0, prompt_buckets=(8,), num_samples=2,
                                   capture_topk=0, record_routing=True))
    b = s.generate(params, [[5, 6, 7], [9, 10, 11, 12, 13]], jax.random.key(seed)).validate()
    return b, decoder


def test_the_sampler_records_each_positions_experts_and_replaying_them_is_recomputing(pair):
    """Routing capture (prefill and decode, every sparse layer) equals the learner's own top-k at
    the same weights, and replaying it gives exactly the recomputed log-probs (R3 changes
    nothing when nothing is perturbed); the sampler's behaviour log-probs are reproduced."""
    from jaxrl_llm.models import heads

    _, _, _, params, cfg = pair
    b, decoder = _sampled(params, cfg)
    sparse = sum(cfg.sparse(i) for i in range(cfg.num_layers))
    assert b.routing.shape == (4, 18, sparse, cfg.num_experts_per_tok) and b.routing.dtype == np.int16
    _, var = decoder.Decoder(cfg).apply({"params": params}, b.tokens, decoder.padding_positions(b.input_mask),
                                        decoder.causal_mask(b.input_mask), mutable=["intermediates"])
    real = np.asarray(b.input_mask) > 0
    mine = np.sort(np.asarray(decoder.routing_of(var, cfg, *b.tokens.shape)), -1)
    np.testing.assert_array_equal(mine[real], np.sort(np.asarray(b.routing), -1)[real])
    seen = heads.sequence_logprobs(params, cfg, b.tokens, b.input_mask, routing_BxLxMxK=b.routing)
    again = seen["logp"]
    replay = heads.sequence_logprobs(params, cfg.replace(moe_routing="replay"), b.tokens, b.input_mask,
                                     routing_BxLxMxK=b.routing)["logp"]
    loss = np.asarray(b.loss_mask) > 0  # (a prompt's first token is predicted from padding, never trained)
    np.testing.assert_array_equal(np.asarray(replay)[loss], np.asarray(again)[loss])
    np.testing.assert_allclose(np.asarray(replay)[loss], np.asarray(b.behav_logp)[loss], atol=1e-5)
    assert float(np.asarray(seen["routing_differs"])[loss].max()) == 0.0  # recompute saw the same experts


def test_replay_narrows_the_mismatch_of_a_perturbed_sampler_router(pair):
    """A sampler whose routers differ from the learner's (noise on its router weights, standing in
    for other numerics): the learner replaying the recorded experts is far closer to the
    behaviour log-probs than the learner recomputing its own routing."""
    from jaxrl_llm.models import heads

    _, _, _, params, cfg = pair
    noisy = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.01 * jax.random.normal(jax.random.key(7), x.shape)
        if "router" in jax.tree_util.keystr(path) else x, params)
    b, _ = _sampled(noisy, cfg, seed=2)
    loss = np.asarray(b.loss_mask) > 0
    gap = {}
    for mode in ("recompute", "replay"):
        logp = heads.sequence_logprobs(params, cfg.replace(moe_routing=mode), b.tokens, b.input_mask,
                                       routing_BxLxMxK=b.routing if mode == "replay" else None)["logp"]
        gap[mode] = float(np.abs(np.asarray(logp) - np.asarray(b.behav_logp))[loss].mean())
    differs = heads.sequence_logprobs(params, cfg, b.tokens, b.input_mask, routing_BxLxMxK=b.routing)["routing_differs"]
    assert 0 < float((np.asarray(differs)[loss] > 0).mean()) < 1  # some tokens were routed elsewhere
    assert gap["replay"] < 0.5 * gap["recompute"], gap


def test_a_run_replays_the_samplers_routing(pair, tmp_path):
    from jaxrl_llm.run import experiment, plan
    from tests.test_experiment import _tiny

    _, _, path, _, _ = pair
    c = _tiny("ppo", mode="sync")
    c.model.update(hf_path=path)
    c.model.moe.routing = "replay"
    c.train.update(steps=2, eval_every=2, save_every=2)
    assert experiment.run(c, str(tmp_path), log=lambda *_: None)["version"] == 2
    steps = [__import__("json").loads(x) for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert max(s["mismatch/abs_logp_max"] for s in steps) < 1e-4
    assert all(s["moe/routing_differs_pairs"] <= s["moe/routing_differs_tokens"] <= 1 for s in steps)
    assert all(1 <= s["moe/expert_load_max_over_mean"] <= s["moe/expert_load_worst_layer"] <= 4 for s in steps)
    c.sampler.batching = "continuous"  # the decode slots record routing too
    assert plan.resolve(c).sampler.record_routing
    c = _tiny("ppo")
    c.model.moe.routing = "replay"
    with pytest.raises(ValueError, match=r"routing=replay needs a mixture of experts \(here: the model is dense\)"):
        plan.resolve(c)


@pytest.mark.parametrize("normalise", [True, False])
def test_replayed_experts_pass_the_gradient_to_the_router_as_a_numpy_layer_does(normalise):
    """Under replay (R3) the recorded experts are used, not the router's top k, and the gate
    weights come from the learner's router logits at those experts: the layer's gradient in the
    router equals central differences of a float64 NumPy layer with the same experts fixed."""
    from jaxrl_llm.models.config import ModelConfig

    n, d, f, e, k = 6, 8, 5, 4, 2
    cfg = ModelConfig(vocab_size=8, hidden_size=d, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, model_type="qwen3_moe", num_experts=e, num_experts_per_tok=k,
                      moe_intermediate_size=f, norm_topk_prob=normalise, moe_routing="replay")
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, d))
    w = {"router": rng.normal(size=(d, e)), "gate": rng.normal(size=(e, d, f)) * 0.4,
         "up": rng.normal(size=(e, d, f)) * 0.4, "down": rng.normal(size=(e, f, d)) * 0.4}
    ids = np.argsort(x @ w["router"], -1)[:, :k]  # the router's bottom k: never its own choice

    def numpy_loss(router):
        logits = x @ router
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        g = np.take_along_axis(p, ids, -1)
        g = g / g.sum(-1, keepdims=True) if normalise else g
        y = np.zeros_like(x)
        for t in range(n):
            for j, ex in enumerate(ids[t]):
                a = x[t] @ w["gate"][ex]
                y[t] += g[t, j] * ((a / (1 + np.exp(-a)) * (x[t] @ w["up"][ex])) @ w["down"][ex])
        return np.sum(np.sin(y))

    h, fd = 1e-6, np.zeros((d, e))
    for i, j in np.ndindex(d, e):
        bump = np.zeros((d, e))
        bump[i, j] = h
        fd[i, j] = (numpy_loss(w["router"] + bump) - numpy_loss(w["router"] - bump)) / (2 * h)
    params = {key: jnp.asarray(v, jnp.float32) for key, v in w.items()}
    xs, given = jnp.asarray(x[None], jnp.float32), jnp.asarray(ids[None], jnp.int16)
    for dispatch in ("dense", "blocked"):
        layer = moe.MoE(cfg.replace(moe_dispatch=dispatch))
        loss = lambda p, c=None: jnp.sum(jnp.sin((layer if c is None else moe.MoE(c)).apply(  # noqa: E731
            {"params": p}, xs, given)[0]))
        grad = jax.grad(loss)(params)["router"]
        np.testing.assert_allclose(grad, fd, rtol=2e-3, atol=2e-5 * np.abs(fd).max(), err_msg=dispatch)
        assert float(loss(params)) == pytest.approx(numpy_loss(w["router"]), rel=1e-5, abs=1e-5)
        # recomputing (the router's own top k) is another layer: what replay must not fall back to
        assert abs(float(loss(params, cfg.replace(moe_routing="recompute", moe_dispatch=dispatch)))
                   - numpy_loss(w["router"])) > 1e-2
    assert np.abs(fd).max() > 1e-2


def test_expert_load_by_hand():
    """The busiest expert's share over the mean share, per sparse layer, over trained tokens."""
    from jaxrl_llm.runtime.orchestrator import expert_load

    routing = np.zeros((1, 3, 2, 2), np.int16)
    routing[0, 0] = [[3, 3], [3, 3]]  # a prompt position: not counted
    routing[0, 1] = [[0, 1], [2, 3]]
    routing[0, 2] = [[0, 1], [0, 2]]
    batch = types.SimpleNamespace(routing=routing, loss_mask=np.array([[0.0, 1.0, 1.0]]))
    # layer 0: experts 0, 1 twice each -> counts 2, 2, 0, 0, max 2 / mean 1; layer 1: counts 1, 0, 2, 1 -> 2 / 1
    assert expert_load(batch, 4) == {"moe/expert_load_max_over_mean": 2.0, "moe/expert_load_worst_layer": 2.0}
    routing[0, 2, 1] = [2, 3]  # layer 1: counts 0, 0, 2, 2 -> 2 / 1; layer 0 unchanged
    routing[0, 1, 0] = [0, 2]  # layer 0: counts 2, 1, 1, 0 -> 2 / 1
    assert expert_load(batch, 4)["moe/expert_load_worst_layer"] == 2.0
    batch.loss_mask[0, 2] = 0.0  # one trained token: k = 2 experts of 4 busy in each layer, 1 / 0.5
    assert expert_load(batch, 4) == {"moe/expert_load_max_over_mean": 2.0, "moe/expert_load_worst_layer": 2.0}
    batch.loss_mask[0, :] = 0.0
    assert expert_load(batch, 4) == {}  # nothing trained here


def test_a_replay_run_on_an_expert_mesh_killed_with_sigkill_resumes_bit_identically(tmp_path):
    """kill -9 of a sync R3 run whose experts are split over `expert` = 2: the resumed run trains
    what an uninterrupted one does, to the bit (loss, weights' norm, rewards, routing mismatch)."""
    import sys

    from tests.test_distributed import TINY
    from tests.test_faults import resumes_like_uninterrupted

    path = F.save(_hf_model("qwen3_moe"), str(tmp_path / "qwen3_moe"))
    base = [sys.executable, "-m", "jaxrl_llm.main", *TINY, f"--config.model.hf_path={path}",
            "--config.model.moe.routing=replay", "--config.cpu_devices=2", "--config.mesh.data=1",
            "--config.mesh.expert=2",
            "--config.runtime.mode=sync", "--config.train.save_every=2", "--config.train.eval_every=1000",
            "--config.train.keep=100"]
    resumes_like_uninterrupted(base, tmp_path, ("loss", "param_norm", "reward/mean", "moe/routing_differs_pairs",
                                                "moe/expert_load_max_over_mean"))


@pytest.mark.serial
def test_a_sampler_node_records_routing_and_the_learner_replays_it(tmp_path):
    """`runtime.mode=remote` with replay: a node process samples with routing capture, its groups
    pass the hub's routing check (`wire.check_group`) and the learner replays their experts,
    reproducing the node's behaviour log-probs."""
    import json
    import os
    import sys

    from jaxrl_llm.parallel.launch import free_port
    from tests.test_distributed import TINY
    from tests.test_node import _Processes

    path = F.save(_hf_model("qwen3_moe"), str(tmp_path / "qwen3_moe"))
    port, wd = free_port(), str(tmp_path / "run")
    learner = [sys.executable, "-m", "jaxrl_llm.main", *TINY, f"--workdir={wd}", f"--config.model.hf_path={path}",
               "--config.model.moe.routing=replay", "--config.runtime.mode=remote", "--config.warm_start.steps=0",
               f"--config.runtime.remote.port={port}", "--config.train.steps=2", "--config.train.eval_every=100"]
    with _Processes(tmp_path, port, dict(os.environ, JAXRL_REMOTE_TOKEN="s3cret")) as run:
        first = run.start(learner, "learner")
        run.node("a")
        assert first.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    steps = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl")) if '"loss"' in x]
    assert [s["step"] for s in steps] == [1, 2] and all(s["remote/a/groups"] > 0 for s in steps[-1:])
    assert max(s["mismatch/abs_logp_max"] for s in steps) < 1e-4
    assert all(0 <= s["moe/routing_differs_pairs"] <= s["moe/routing_differs_tokens"] <= 1 for s in steps)


def test_a_random_mixture_of_experts_from_the_config_and_a_perturbed_sampler_router(tmp_path):
    """`model.moe.experts` > 0 without a checkpoint: a random Qwen3-MoE-style policy of the model
    section's sizes trains (here with LoRA on attention and experts, packed rows and replay),
    its samplers' log-probs equal to the learner's; with the samplers' router in bfloat16
    (`model.moe.sampler_router_dtype`, the learner's stays float32) they differ."""
    import json

    from jaxrl_llm.run import experiment, plan
    from tests.test_experiment import _tiny

    gaps = {}
    for dtype in ("float32", "bfloat16"):
        c = _tiny("ppo", mode="sync")
        c.model.moe.update(experts=4, top_k=2, intermediate_size=32, sampler_router_dtype=dtype,
                           aux_loss_coef=0.01 if dtype == "bfloat16" else 0.0)
        if dtype == "float32":
            c.model.moe.routing, c.task.reward = "replay", "digits"  # partial credit: advantages, gradients
            c.model.lora.rank = 4  # every target: attention and the experts
            c.learner.update(packing="auto", packing_min_len=0)
        c.train.update(steps=2, eval_every=2, save_every=2)
        lines = []
        assert experiment.run(c, str(tmp_path / dtype), log=lines.append)["version"] == 2
        assert "mixture of experts: 4 experts, top 2" in "\n".join(lines)
        steps = [json.loads(x) for x in open(tmp_path / dtype / "metrics.jsonl") if '"loss"' in x]
        gaps[dtype] = max(s["mismatch/abs_logp_max"] for s in steps)
        assert dtype == "bfloat16" or max(s["update_norm"] for s in steps) > 0  # the adapters train
        assert all("moe/expert_load_max_over_mean" in s for s in steps)
        # the load-balancing loss is logged when its coefficient is on (2, k, at an even load)
        assert all(1 < s["moe/aux_loss"] < 4 for s in steps) if dtype == "bfloat16" else "moe/aux_loss" not in steps[0]
    assert gaps["float32"] < 1e-4, gaps
    # Whether bf16 rounding flips a top-2 choice among a 1-layer, 16-wide model's few tokens is
    # chance (no flip in 2 of 6 seeds at 8x the rows), so the bf16 run's gap is not asserted: its
    # samplers' routers are, and those round the router logits as bf16 does.
    p = plan.resolve(c)
    sampler_cfg, learner_cfg = p.model.for_sampling(), p.model
    assert (sampler_cfg.router_dtype, learner_cfg.router_dtype) == ("bfloat16", "float32")
    params = models.init_params(learner_cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, learner_cfg.vocab_size)
    logits = [np.asarray(decoder.forward(params, cfg, tokens, jnp.ones_like(tokens), router_logits=True)[1]
                         ["router_logits"][0], np.float32) for cfg in (learner_cfg, sampler_cfg)]
    assert 0 < np.abs(logits[0] - logits[1]).max() <= 2**-7 * np.abs(logits[0]).max()
    c.model.hf_path = "/nonexistent"
    with pytest.raises(ValueError, match="model.moe.experts sizes a random mixture of experts"):
        plan.model_cfg(c.model, __import__("jaxrl_llm.tasks", fromlist=["make"]).make(c.task, ""))
    c.model.hf_path, c.model.moe.top_k = "", 8
    with pytest.raises(ValueError, match="model.moe.top_k=8 exceeds model.moe.experts=4"):
        plan.resolve(c)


def test_continuous_batching_and_multi_turn_episodes_record_each_positions_experts():
    """Routing capture in the decode slots: a continuous batch (3 slots for 10 rows, refilled)
    records the experts a static batch does, and multi-turn episodes (released slots, parked
    caches, observations forced; the cache kept or recomputed) record at every real position
    (prompt, drawn, observed) the learner's own top k at equal weights."""
    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout.turns import Turns
    from tests.test_turns import EOS, PROMPTS, STOP, Echo

    cfg = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, head_dim=8, model_type="qwen3_moe", num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    params = decoder.init_params(cfg, jax.random.key(0))
    base = dict(max_new_tokens=24, temperature=1.0, capture_topk=0, num_samples=2, prompt_buckets=(8,),
                decode_segment=4, eos_token_id=EOS, record_routing=True)

    def own_topk(b):  # the learner's routers over the whole sequence, teacher-forced
        _, var = decoder.Decoder(cfg).apply({"params": params}, b.tokens, decoder.padding_positions(b.input_mask),
                                            decoder.causal_mask(b.input_mask), mutable=["intermediates"])
        return np.sort(np.asarray(decoder.routing_of(var, cfg, *b.tokens.shape)), -1)

    batches = {}
    for batching, slots in (("static", 0), ("continuous", 3)):
        s = Sampler(cfg, SamplerConfig(**base, batching=batching, slots=slots))
        batches[batching] = jax.tree.map(np.asarray, s.generate(params, PROMPTS, jax.random.key(3)))
    static, cont = batches["static"], batches["continuous"]
    np.testing.assert_array_equal(cont.tokens, static.tokens)
    real = static.input_mask > 0
    np.testing.assert_array_equal(cont.routing[real], static.routing[real])
    np.testing.assert_array_equal(np.sort(static.routing, -1)[real], own_topk(static)[real])
    for cache in ("keep", "recompute"):
        s = Sampler(cfg, SamplerConfig(**base, batching="continuous", slots=3, turn_stop_ids=(STOP,), turn_cache=cache))
        env = Echo()
        b = jax.tree.map(np.asarray, s.generate(params, PROMPTS, jax.random.key(5), turns=Turns(env)))
        real = b.input_mask > 0
        observed = real & (b.loss_mask == 0) & (np.arange(b.tokens.shape[1]) >= 8)
        assert env.calls and observed.sum() > 0  # turns ended and observations were forced
        np.testing.assert_array_equal(np.sort(b.routing, -1)[real], own_topk(b)[real])
