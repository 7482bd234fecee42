"""The accelerator audit: what a GPU or TPU run would meet, measured on CPU (not a test).

    python experiments/accelerator_audit.py [--out experiments/results/accelerator_audit_cpu.json]

Eight fake CPU devices stand in for a node; programs are lowered for CUDA where the question is
what a GPU would run (JAX lowers for another platform without its device), and compiled on CPU
where the question is memory (`memory_analysis()`). Each figure below, in the JSON:

  decode_while_ops_{256,1024}  `stablehlo.while` ops in a static batch's sampler program lowered
                               for CUDA at 256 and 1,024 new tokens (each while reads its
                               predicate back to the host per trip unless its trip count is known)
  vocab_sorts_in_{sample,learner}_topk50_topp09
                               sort ops over a 152,064-wide axis in one decode step's sampling and
                               in the learner's log-prob head (its backward too), top-k 50, top-p 0.9
  plan_qwen7b_fsdp8_gib_per_device
                               the memory plan of the default config at Qwen2.5-7B shapes in bf16
                               on 8 devices with mesh.fsdp=8 (also: fp32, and data=8), against an
                               H100's 59 GiB (`bytes_limit` at JAX's 75% default)
  prox_pass_temp_vs_plan       compiled temporaries of the prox (recompute) pass at V = 152,064,
                               B = 64, 8 minibatches, over the plan's step temporaries (activations
                               + head); `..._whole_batch` is the pass over the whole batch at once
  tensor8_kvheads4             what start-up says to mesh.tensor=8 on 28 heads / 4 KV heads
  attention_auto               the kernel `model.attention=auto` picks per platform and dtype
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import common  # noqa: E402

from jaxrl_llm import models, testing  # noqa: E402
from jaxrl_llm.models import attention as attn, heads  # noqa: E402
from jaxrl_llm.models.config import ModelConfig  # noqa: E402
from jaxrl_llm.models.policy_dist import PolicyDist  # noqa: E402
from jaxrl_llm.run import memory  # noqa: E402

V = 152064
QWEN7B = ModelConfig(vocab_size=V, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                     num_kv_heads=4, head_dim=128, tie_word_embeddings=False, dtype="bfloat16")
H100_LIMIT_GIB = 59.0
DIST = PolicyDist(1.0, 50, 0.9)


def _tiny(vocab: int, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, **kw)


def vocab_sorts(text: str, v: int = V) -> int:
    """Sort ops (a call to a sort function or the op itself) with a `v`-wide operand."""
    shaped = lambda line: re.search(rf"[<x]{v}x", line.replace("tensor<", "<"))  # noqa: E731
    return sum(1 for line in text.splitlines() if re.search(r"\bsort\b|stablehlo\.sort|@sort", line) and shaped(line))


def decode_whiles() -> dict:
    from jaxrl_llm.rollout import Sampler, SamplerConfig
    from jaxrl_llm.rollout.sampler import row_limits

    cfg = _tiny(V)
    params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    out = {}
    for n in (256, 1024):
        s = Sampler(cfg, SamplerConfig(max_new_tokens=n, top_k=DIST.top_k, top_p=DIST.top_p, prompt_buckets=(16,),
                                       num_samples=1, capture_topk=4))
        toks, mask, _ = s.pad_prompts([[1, 2, 3]] * 4)
        low = s._generate.trace(params, toks, mask, row_limits(None, 4, n), jax.random.key(0), 0, mcfg=cfg,
                                scfg=s.cfg).lower(lowering_platforms=("cuda",))
        text = low.as_text()
        out[f"decode_while_ops_{n}"] = text.count("stablehlo.while")
        out[f"decode_hlo_lines_{n}"] = len(text.splitlines())
        if n == 256:
            out["vocab_sorts_in_sample_topk50_topp09"] = vocab_sorts(text)
    return out


def learner_sorts() -> int:
    """The learner's head with the sampler's kept counts and without (the rule re-applied), and
    both backward passes: sorts over the vocabulary in the CUDA lowering."""
    h = jax.ShapeDtypeStruct((2, 8, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, V), jnp.float32)
    t = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    total = 0
    for kept in (jax.ShapeDtypeStruct((2, 8), jnp.int32), None):
        def loss(h, w, t, kept=kept):
            s = heads.logprob_stats(h, w, t, dist=DIST, kept_BxL=kept, chunk=4)
            return s["logp"].sum() + s["entropy"].sum()
        f = jax.jit(jax.grad(loss, argnums=(0, 1)))
        args = (h, w, t) if kept is None else (h, w, t, kept)
        total += vocab_sorts(f.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    return total


def plans() -> dict:
    from configs.default import get_config
    from jaxrl_llm import tasks

    c = get_config("a3po")
    task = tasks.make(c.task, "")
    out = {}
    for name, cfg, layout in (
            ("plan_qwen7b_fsdp8_gib_per_device", QWEN7B, memory.Layout(fsdp=8, samplers=8, platform="gpu")),
            ("plan_qwen7b_fsdp8_fp32_gib_per_device", QWEN7B.replace(dtype="float32"),
             memory.Layout(fsdp=8, samplers=8, platform="gpu")),
            ("plan_qwen7b_data8_gib_per_device", QWEN7B, memory.Layout(data=8, samplers=8, platform="gpu"))):
        c.model.dtype = cfg.dtype
        out[name] = memory.need(memory.estimate(c, task, cfg, layout=layout), layout) / memory.GB
    out["plan_h100_limit_gib"] = H100_LIMIT_GIB
    out["plan_qwen7b_fsdp8_fits_h100"] = out["plan_qwen7b_fsdp8_gib_per_device"] <= H100_LIMIT_GIB
    return out


def prox_pass(rows: int = 64, seq_len: int = 256, minibatches: int = 8) -> dict:
    from jaxrl_llm.learner import forward
    from jaxrl_llm.learner import learner as L
    from jaxrl_llm.parallel import sharding

    cfg = _tiny(V, tie_word_embeddings=False)
    c = L.default_config()
    c.num_minibatches, c.packing = minibatches, "off"
    lrn = L.Learner(cfg, {"name": "decoupled_ppo"}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    params = lrn.policy_params(lrn.init(jax.random.key(0)))
    small = _tiny(64)
    batch = testing.model_batch(models.init_params(small, jax.random.key(1)), small, num_prompts=rows // 2,
                                group_size=2, length=seq_len, prompt=32, topk=0)
    fwd = forward.Forward(cfg, PolicyDist(), c.logprob_chunk, lrn.mesh)
    temp = {}
    for m in (minibatches, 1):
        f = jax.jit(lambda p, b, m=m: forward.batch_stats(fwd, p, b, None, m, gather=False)["logp"])
        temp[m] = f.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    plan = memory.learner(cfg, rows, seq_len, minibatches, c.logprob_chunk)
    step_temps = plan["activations"] + plan["head"]
    return {"prox_pass_temp_gib": temp[minibatches] / memory.GB, "prox_pass_plan_gib": step_temps / memory.GB,
            "prox_pass_temp_vs_plan": temp[minibatches] / step_temps,
            "prox_pass_temp_whole_batch_vs_plan": temp[1] / step_temps}


def tensor8() -> str:
    from jaxrl_llm.parallel import sharding
    import ml_collections

    mc = ml_collections.ConfigDict({**sharding.default_config().to_dict(), "data": 1, "tensor": 8})
    cfg = QWEN7B.replace(num_layers=1)
    shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    problems = sharding.check_divisible(models.logical_axes(cfg), shapes, sharding.make_mesh(mc), 512, cfg=mc,
                                        kv_heads=cfg.num_kv_heads)
    return "; ".join(problems) or "runs"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/results/accelerator_audit_cpu.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    out = {**common.cpu_kind(), "devices": jax.device_count(), "backend": jax.default_backend()}
    out.update(decode_whiles())
    out["vocab_sorts_in_learner_topk50_topp09"] = learner_sorts()
    out.update(plans())
    out.update(prox_pass())
    out["tensor8_kvheads4"] = tensor8()
    out["attention_auto"] = {f"{p}_{d}": attn.kernel(_tiny(64, dtype=d), p)
                             for p in ("cpu", "gpu", "tpu") for d in ("float32", "bfloat16")}
    out["seconds"] = time.perf_counter() - t0
    common.report(out, a.out or None)


if __name__ == "__main__":
    main()
