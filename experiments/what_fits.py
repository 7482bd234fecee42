"""The "What fits" table of docs/memory.md, from the memory plan (`jaxrl_llm/memory.py`; no model is
built). Learner and one sampler on the same memory, as on a CPU host or one accelerator:
float32 master weights, AdamW, `remat=full`, bfloat16 compute, sampler weights and KV cache.

    python experiments/what_fits.py [--rows 8] [--minibatches 4] [--sample_rows 64]
"""

from __future__ import annotations

import argparse

from jaxrl_llm import memory
from jaxrl_llm.models.config import ModelConfig

V = 151936
QWEN25 = {  # (layers, hidden, mlp, heads, kv heads, head_dim, tied)
    "0.5B": (24, 896, 4864, 14, 2, 64, True),
    "1.5B": (28, 1536, 8960, 12, 2, 128, True),
    "3B": (36, 2048, 11008, 16, 2, 128, True),
    "7B": (28, 3584, 18944, 28, 4, 128, False),
}
MACHINES = {"24 GiB CPU": (24, "cpu"), "80 GB GPU": (80e9 / memory.GB, "gpu")}  # XLA:CPU adds a layer's f32 weight copy


def plan_gb(shape, rows, seq_len, minibatches, sample_rows, platform, prompt=256):
    layers, d, f, h, k, hd, tied = shape
    cfg = ModelConfig(vocab_size=V, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=h,
                      num_kv_heads=k, head_dim=hd, tie_word_embeddings=tied, dtype="bfloat16", remat="full")
    learner = memory.total(memory.learner(cfg, rows, seq_len, minibatches))
    sampler = memory.total(memory.sampler(cfg, sample_rows, prompt, seq_len - prompt, "bfloat16", "bfloat16", platform))
    return (learner + sampler) / memory.GB


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--sample_rows", type=int, default=64)
    a = ap.parse_args()
    lengths = (1024, 4096, 16384)
    print("| model (plan CPU / GPU) | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name, shape in QWEN25.items():
        cells = []
        for n in lengths:
            gb = {m: plan_gb(shape, a.rows, n, a.minibatches, a.sample_rows, platform)
                  for m, (_, platform) in MACHINES.items()}
            fits = [m for m, (cap, _) in MACHINES.items() if gb[m] <= cap]
            cells.append(f"{gb['24 GiB CPU']:.0f} / {gb['80 GB GPU']:.0f} GiB: {', '.join(fits) if fits else 'neither'}")
        print(f"| Qwen2.5-{name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
