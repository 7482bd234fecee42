"""The memory plan (`jaxrl_llm/run/memory.py`) against what is really allocated, through the code
of `experiments/bench_scale.py` on a tiny model (the benchmark runs it at 0.5B shapes)."""

import argparse
import os
import sys

import jax
import numpy as np

from jaxrl_llm.run import memory
from jaxrl_llm.models.config import ModelConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
import bench_scale  # noqa: E402


def test_bench_scale_runs_and_its_plan_matches_the_compiled_programs():
    a = argparse.Namespace(tiny=True, remat="full", dtype="float32", cache_dtype="bfloat16", rows=4, seq_len=256,
                           minibatches=2, sample_rows=8, prompt_len=16, new_tokens=32)
    out = {**bench_scale.run_learner(a), **bench_scale.run_sampler(a)}
    for part in ("learner", "sampler"):
        assert out[f"{part}_tokens_per_s"] > 0 and out[f"{part}_rss_gb"] >= out[f"{part}_peak_gb"] > 0
        ratio = out[f"{part}_peak_gb"] / out[f"{part}_budget_gb"]
        assert 0.5 < ratio < 2.0, (part, ratio)  # tiny shapes: fixed costs weigh more than at 0.5B
    cfg = bench_scale._cfg(a)
    n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: __import__(
        "jaxrl_llm.models.decoder", fromlist=["init_params"]).init_params(cfg, jax.random.key(0)))))
    assert out["learner_plan"]["params"] * memory.GB == 4 * n and out["learner_plan"]["optimizer"] * memory.GB == 8 * n


def test_lora_plan_matches_the_compiled_step_and_publishes_the_adapters_only():
    """LoRA through `bench_scale.run_learner(lora=True)`: master, moments and gradients are the
    adapters' (counted from the tree), the base is held once in the compute dtype, and the
    compiled step's peak is within the plan's tolerance (the benchmark compares it with the
    full-weight step's at 0.5B shapes)."""
    from jaxrl_llm.models import decoder, lora

    a = argparse.Namespace(tiny=True, remat="full", dtype="bfloat16", cache_dtype="bfloat16", rows=4, seq_len=128,
                           minibatches=2, sample_rows=8, prompt_len=16, new_tokens=32, lora_rank=8)
    low = bench_scale.run_learner(a, lora=True)
    cfg = bench_scale._cfg(a, lora=True)
    adapters = jax.eval_shape(lambda: lora.split(decoder.init_params(cfg, jax.random.key(0)))[1])
    n = sum(x.size for x in jax.tree.leaves(adapters))
    plan = {k: v * memory.GB for k, v in low["lora_learner_plan"].items()}
    assert n == lora.num_params(cfg) and plan["params"] == 4 * n and plan["optimizer"] == 8 * n
    assert plan["base"] == 2 * cfg.num_params  # bfloat16, one copy
    assert low["lora_publish_bytes"] == 4 * n < 0.5 * low["lora_full_publish_bytes"]
    assert 0.5 < low["lora_learner_peak_gb"] / low["lora_learner_budget_gb"] < 2.0


def test_kv_cache_term_is_the_sampler_cache():
    """The plan's cache term is twice (continuous batching copies a window) the cache the sampler allocates."""
    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout import SamplerConfig, decode

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    scfg = SamplerConfig(max_new_tokens=24, decode_segment=0, cache_dtype="bfloat16", prompt_buckets=(8,), num_samples=1, capture_topk=0)
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0)))
    st = jax.eval_shape(lambda p: decode.prefill(p, np.zeros((5, 8), np.int32), np.ones((5, 8), np.int32),
                                              np.full(5, 24, np.int32), jax.random.key(0), 0, cfg, scfg), params)
    cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st.cache))
    assert memory.sampler(cfg, 5, 8, 24, "bfloat16")["kv_cache"] == 2 * cache


def test_remat_and_chunks_shrink_the_planned_activations():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=8, num_heads=4, num_kv_heads=2,
                      head_dim=16, attention_chunk=0)
    acts = {r: memory.activations(cfg.replace(remat=r), 2, 1024) for r in ("none", "dots", "full")}
    assert acts["none"] > acts["dots"] > acts["full"]
    assert memory.activations(cfg.replace(attention_chunk=256), 2, 1024) < acts["none"]


def test_bench_scale_end_to_end_runs_the_cli_on_a_written_checkpoint():
    """`bench_scale.py --end-to-end` on a tiny model: a Hugging Face directory (bf16 safetensors,
    a tokenizer trained here) and a jsonl dataset are written, the main CLI trains 2 steps on
    them in a child process, and the child's peak RSS and printed plan come back."""
    a = argparse.Namespace(tiny=True, remat="full", rows=8, new_tokens=16, minibatches=1, dtypes="bfloat16")
    out = bench_scale.run_end_to_end(a)["bfloat16"]
    assert 0 < out["run_budget_gb"] < out["run_peak_rss_gb"]  # tiny: the runtime outweighs the plan
    assert "sampler_cpu_f32_layer" in out["run_plan"] and "learner_params" in out["run_plan"]


def test_a_bfloat16_sampler_holds_no_float32_copy_of_its_weights(monkeypatch):
    """XLA:CPU multiplies bf16 weights in float32; hoisted out of the decode loop, those
    converts were a float32 copy of every weight for the whole call. The decode step keeps them
    inside (`decode._upcast_in_loop`): the compiled temp stays under the plan's one layer."""
    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout import Sampler, SamplerConfig, decode

    cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=8, num_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype("bfloat16"), decoder.init_params(cfg, jax.random.key(0)))
    scfg = SamplerConfig(max_new_tokens=8, num_samples=1, prompt_buckets=(8,), cache_dtype="bfloat16", capture_topk=0)
    prompts = [[1, 2, 3]] * 2

    def temp():
        compiled = Sampler(cfg, scfg).lower_generate(params, prompts, jax.random.key(1)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plan = memory.sampler(cfg, 2, 8, 8, "bfloat16", "bfloat16", platform="cpu")
    layers_f32 = 4 * cfg.num_layers * cfg.layer_params
    assert temp() < memory.total(plan) - plan["weights"] < layers_f32 / 2  # the weights are arguments
    monkeypatch.setattr(decode, "_upcast_in_loop", lambda params, _: params)  # the hoisted converts again
    assert temp() > layers_f32


QWEN7B = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                     num_kv_heads=4, head_dim=128, tie_word_embeddings=False, dtype="bfloat16")


def test_the_plan_is_per_device_over_the_mesh():
    """Parameter states divide over fsdp x tensor, rows over data x fsdp, the vocabulary over
    tensor; an accelerator's busiest device is compared with its own limit, a CPU host sums."""
    one = memory.learner(QWEN7B, 64, 1024, 4, 128)
    fsdp8 = memory.learner(QWEN7B, 64, 1024, 4, 128, memory.Layout(fsdp=8))
    n = QWEN7B.num_params
    assert one["params"] == 4 * n and fsdp8["params"] == 4 * -(-n // 8) and fsdp8["optimizer"] == 8 * -(-n // 8)
    assert fsdp8["head"] == one["head"] // 8 and fsdp8["stats"] == one["stats"] // 8  # 16 rows -> 2 per device
    tensor4 = memory.learner(QWEN7B, 64, 1024, 4, 128, memory.Layout(tensor=4))
    assert tensor4["head"] == 3 * 16 * 128 * (152064 // 4) * 4 and tensor4["activations"] < one["activations"]
    plan = {"learner_params": 10, "learner_head": 5, "sampler_weights": 7, "sampler_kv_cache": 3}
    gpu = dict(data=4, samplers=4, platform="gpu")
    assert memory.need(plan, memory.Layout(**gpu)) == 25  # shared devices hold both
    assert memory.need(plan, memory.Layout(**gpu, shared=False)) == 15  # the busier of the two kinds
    # A CPU host: the learner's share on each of its 4 devices, the aliased weights once, caches per device.
    assert memory.need(plan, memory.Layout(data=4, local=4, samplers=4, platform="cpu")) == 4 * 15 + 7 + 4 * 3


def test_qwen7b_on_8_h100s_is_refused_only_without_fsdp_which_the_message_names(monkeypatch):
    """The default config at Qwen2.5-7B shapes, bf16, on 8 devices of 59 GiB: the data-parallel
    plan is refused and names mesh.fsdp=8, whose plan fits."""
    import pytest

    from configs.default import get_config
    from jaxrl_llm import tasks

    c = get_config("a3po")
    c.model.dtype = "bfloat16"
    task = tasks.make(c.task, "")
    monkeypatch.setattr(memory, "available", lambda: (59 * memory.GB, "each H100's memory"))
    fsdp = memory.Layout(fsdp=8, samplers=8, platform="gpu")
    fits = memory.need(memory.estimate(c, task, QWEN7B, layout=fsdp), fsdp)
    assert fits < 59 * memory.GB
    data = memory.Layout(data=8, samplers=8, platform="gpu")
    with pytest.raises(MemoryError) as e:
        memory.check_run(c, task, QWEN7B, None, memory.estimate(c, task, QWEN7B, layout=data), data)
    assert f"--config.mesh.data=1 --config.mesh.fsdp=8 ({fits / memory.GB:.1f} GiB)" in str(e.value)
    assert "GiB per device" in str(e.value)


def test_a_mixture_of_experts_plan_holds_what_its_sharded_tree_holds():
    """Per device: the stacked experts split over fsdp x tensor x expert, every other weight over
    fsdp x tensor, counted against the shards of the real parameter tree on 8 devices; the
    activations grow with the expert group each device runs tokens for (`experts.on_devices`)."""
    import pytest

    from jaxrl_llm import models
    from jaxrl_llm.models import decoder
    from jaxrl_llm.parallel import sharding

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=16, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=32, mlp_only_layers=(1,), remat="full")
    shapes = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0)))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params
    assert cfg.expert_params == 2 * 16 * 3 * 64 * 32
    for sizes in (dict(data=2, expert=4), dict(fsdp=2, expert=4), dict(fsdp=2, expert=2, tensor=2)):
        c = sharding.default_config()
        c.update(**{**dict(data=1, fsdp=1, expert=1, tensor=1), **sizes})
        placed = sharding.param_shardings(models.logical_axes(cfg), sharding.make_mesh(c))
        held = sum(int(np.prod(s.shard_shape(x.shape)))
                   for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(placed)))
        layout = memory.Layout(**sizes)
        if "tensor" in sizes:  # norms and the router are not split over tensor; the plan splits everything
            assert memory.held_params(cfg, layout) == pytest.approx(held, rel=0.02)
        else:
            assert memory.held_params(cfg, layout) == held
            assert memory.learner(cfg, 16, 256, 2, layout=layout)["optimizer"] == 8 * held
    assert held < memory.held_params(cfg, memory.Layout(fsdp=2, tensor=2)) < cfg.num_params
    # LoRA's adapters as the learner places them: replicated, those on the experts split as the experts
    from jaxrl_llm import objectives
    from jaxrl_llm.learner import learner as L
    from jaxrl_llm.models import lora
    from jaxrl_llm.models.policy_dist import PolicyDist

    lcfg = cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(lora.TARGETS))
    adapters = jax.eval_shape(lambda: lora.split(decoder.init_params(lcfg, jax.random.key(0)))[1])
    for sizes in (dict(data=8), dict(fsdp=2, expert=2, tensor=2)):
        c = sharding.default_config()
        c.update(**{**dict(data=1, fsdp=1, expert=1, tensor=1), **sizes})
        mesh = sharding.make_mesh(c)
        _, layout = L._resolve(lcfg, L.default_config(), objectives.make_config({"name": "ppo"}), mesh, c, None,
                               PolicyDist(1.0))
        held = sum(int(np.prod(s.shard_shape(x.shape)))
                   for x, s in zip(jax.tree.leaves(adapters), jax.tree.leaves(layout.param_sh)))
        assert memory.held_adapters(lcfg, memory.Layout(**sizes)) == held, sizes
    assert memory.held_adapters(lcfg, memory.Layout(fsdp=2, expert=2, tensor=2)) < lora.num_params(lcfg) / 2
    acts = [memory.activations(cfg, 2, 256, expert=x) for x in (1, 2, 4)]
    assert acts[0] < acts[1] < acts[2]
    assert memory.activations(cfg.replace(num_experts_per_tok=2), 2, 256) < acts[0]
    # an all-to-all exchange's rows out and back: min(k, X) per token each, float32, one sparse
    # layer's (remat=full recomputes one layer at a time)
    a2a = cfg.replace(moe_exchange="all_to_all")
    assert memory.activations(a2a, 2, 256, expert=1) == acts[0]
    assert memory.activations(a2a, 2, 256, expert=2) - acts[1] == 2 * 256 * 2 * 4 * 64 * 2
