"""Shared benchmark helpers: the measured matmul peak and model FLOP counts."""

from __future__ import annotations

import os
import platform
import time

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 GEMM rate XLA reaches on this machine (FLOP/s)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def flops_per_token(cfg: ModelConfig, context: float) -> float:
    """Forward FLOPs of one decoded token: matmuls (incl. unembedding) + attention over context."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = 2 * d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 6 * d * cfg.intermediate_size
    attn = 4 * context * cfg.num_heads * hd
    return cfg.num_layers * (per_layer + attn) + 2 * d * cfg.vocab_size


def hf_model(vocab: int, path: str):
    """The benchmark model (Qwen2 architecture, 4 layers, hidden 256, 8/2 heads, MLP 1024),
    random-initialised with a fixed seed and saved to `path` for our loader."""
    import torch
    import transformers

    torch.manual_seed(0)
    hc = transformers.Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(hc).eval()
    model.save_pretrained(path)
    return model


def report(results: dict, json_path=None) -> None:
    """Print the figures one per line and, with `json_path`, write them as one flat object."""
    import json

    width = max(len(k) for k in results) + 2
    for k, v in results.items():
        print(f"{k:{width}s} {v:.4g}" if isinstance(v, float) else f"{k:{width}s} {v}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


def parse_args(description: str, extra=None):
    """The flags every benchmark takes: --json PATH, --repeats N (best of N is reported);
    `extra(parser)` adds a benchmark's own."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions (best is kept)")
    if extra:
        extra(ap)
    return ap.parse_args()


def cpu_kind() -> dict:
    """The CPU model and the widest vector ISA XLA may use (results differ between kinds)."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = "AVX512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "other"
    if "xla_cpu_max_isa=AVX2" in os.environ.get("XLA_FLAGS", ""):
        isa = "AVX2 (emulated: --xla_cpu_max_isa=AVX2)"
    return {"cpu": model, "isa": isa}
