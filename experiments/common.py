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
        import pages  # experiments/ is on sys.path when a benchmark runs as a script

        pages.write_page(json_path)


def parse_args(description: str, extra=None):
    """The flags every benchmark takes: --json PATH, --repeats N (best of N is reported);
    `extra(parser)` adds a benchmark's own."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions (best is kept)")
    ap.add_argument("--isa", choices=("both", "native", "avx2"), default="both",
                    help="both: rerun at the native ISA and under emulated AVX2, interleaved (see across_isas)")
    ap.add_argument("--rounds", type=int, default=2, help="--isa=both: runs per ISA, alternating")
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


RANGED = ("ratio", "_vs_", "speedup", "fraction", "idle")  # figures whose spread across runs is reported


def across_isas(args) -> bool:
    """`--isa=both`: run this benchmark again in fresh processes, `--rounds` times at the native
    ISA and under emulated AVX2 (`XLA_FLAGS=--xla_cpu_max_isa=AVX2`, `ATEN_CPU_CAPABILITY=avx2`
    for PyTorch), alternating so that drifts in machine load hit both; then report each figure's
    median (`key`, `key_avx2`) and, for ratios, its range over the rounds (`key_range`,
    `key_avx2_range`). Returns False when the caller should measure itself (one ISA)."""
    import json
    import subprocess
    import sys
    import tempfile

    import numpy as np

    if args.isa != "both":
        return False
    argv, skip = [], False
    for a in sys.argv[1:]:  # the caller's flags, less --json / --isa (and a separate value)
        if skip:
            skip = False
        elif a in ("--json", "--isa"):
            skip = True
        elif not a.startswith(("--json=", "--isa=")):
            argv.append(a)
    runs = {"native": [], "avx2": []}
    for _ in range(args.rounds):
        for isa in runs:
            env = dict(os.environ)
            if isa == "avx2":
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX2").strip()
                env["ATEN_CPU_CAPABILITY"] = "avx2"
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, sys.argv[0], *argv, f"--isa={isa}", f"--json={tmp.name}"],
                               env=env, check=True)
                runs[isa].append(json.load(open(tmp.name)))
    merged = {}
    for isa, results in runs.items():
        suffix = "" if isa == "native" else "_avx2"
        for k, v in results[0].items():
            values = [r[k] for r in results if k in r]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                merged[k + suffix] = float(np.median(values))
                if any(tag in k for tag in RANGED):
                    merged[k + suffix + "_range"] = [float(min(values)), float(max(values))]
            elif isa == "native" or k == "isa":
                merged[k + suffix] = v
    merged["rounds"] = args.rounds
    report({k: v for k, v in merged.items() if not isinstance(v, list)}, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=2)
    return True
