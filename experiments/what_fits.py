"""The "What fits" page (experiments/results/what_fits.md), from the memory plan
(`jaxrl_llm/run/memory.py`; no model is built), per device: the learner and one sampler share
each device (a CPU host's RAM, one accelerator, or every device of a node with the learner's
parameter states split by `mesh.fsdp` and the sampler rows split over the devices), each machine's
budget the per-device memory a run checks against: `remat=full`, bfloat16 compute, sampler weights and KV cache; full
weights (float32 master weights and AdamW moments) and LoRA (rank 16 on attention + MLP: the
frozen base once in bfloat16, float32 adapters and their moments, the sampler's merged copy).

    python experiments/what_fits.py [--rows 8] [--minibatches 4] [--sample_rows 64] [--out PAGE.md]
"""

from __future__ import annotations

import argparse
import os

from jaxrl_llm.run import memory
from jaxrl_llm.models import experts, lora
from jaxrl_llm.models.config import ModelConfig

V = 151936
QWEN25 = {  # (layers, hidden, mlp, heads, kv heads, head_dim, tied)
    "0.5B": (24, 896, 4864, 14, 2, 64, True),
    "1.5B": (28, 1536, 8960, 12, 2, 128, True),
    "3B": (36, 2048, 11008, 16, 2, 128, True),
    "7B": (28, 3584, 18944, 28, 4, 128, False),
}
# name: (budget per device in GiB, platform, layout). An H100's `bytes_limit` is 75% of its 79.6 GiB
# (JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION); TPU budgets assume 95% of 16 GiB (v5e) / 32 GiB
# (v6e) HBM per chip. XLA:CPU adds a layer's f32 weight copy.
NODE = dict(fsdp=8, samplers=8)
MACHINES = {"24 GiB CPU": (24, "cpu", memory.Layout(platform="cpu")),
            "1xH100": (59.7, "gpu", memory.Layout(platform="gpu")),
            "8xH100 fsdp=8": (59.7, "gpu", memory.Layout(**NODE, platform="gpu")),
            "TPU v5e-8 fsdp=8": (15.2, "tpu", memory.Layout(**NODE, platform="tpu")),
            "TPU v6e-8 fsdp=8": (30.4, "tpu", memory.Layout(**NODE, platform="tpu"))}
LENGTHS = (1024, 4096, 16384)
LORA_RANK = 16


def qwen25(shape, lora_rank=0) -> ModelConfig:
    """A Qwen2.5 model of `shape` (layers, hidden, mlp, heads, kv heads, head_dim, tied), bf16,
    `remat=full`; with `lora_rank`, LoRA on attention + MLP."""
    layers, d, f, h, k, hd, tied = shape
    cfg = ModelConfig(vocab_size=V, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=h,
                      num_kv_heads=k, head_dim=hd, tie_word_embeddings=tied, dtype="bfloat16", remat="full")
    if lora_rank:
        cfg = cfg.replace(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank, lora_targets=tuple(lora.TARGETS))
    return cfg


def plan_gb(shape, rows, seq_len, minibatches, sample_rows, layout, prompt=256, lora_rank=0):
    return sum(parts_gb(qwen25(shape, lora_rank), rows, seq_len, minibatches, sample_rows, layout, prompt))


def parts_gb(cfg, rows, seq_len, minibatches, sample_rows, layout, prompt=256) -> tuple:
    """(learner, sampler) GiB per device of `cfg`'s plan; their sum is what the device needs
    when both share it."""
    learner = memory.learner(cfg, rows, seq_len, minibatches, layout=layout)
    split = layout.samplers if experts.splits(cfg.num_experts, layout.samplers) else 1  # sampler.expert_parallel
    sampler = memory.sampler(cfg.without_lora(), -(-sample_rows // layout.samplers), prompt, seq_len - prompt,
                             "bfloat16", "bfloat16", layout.platform, split)
    plan = {**{f"learner_{k}": v for k, v in learner.items()}, **{f"sampler_{k}": v for k, v in sampler.items()}}
    assert memory.need(plan, layout) == memory.total(learner) + memory.total(sampler)  # accelerators, shared
    return memory.total(learner) / memory.GB, memory.total(sampler) / memory.GB


# Qwen3-30B-A3B (its config.json): 48 layers, 128 experts, top 8; 30.5B parameters, 3.3B active
QWEN3_30B_A3B = ModelConfig(vocab_size=V, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                            num_kv_heads=4, head_dim=128, tie_word_embeddings=False, model_type="qwen3_moe",
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                            qk_norm=True, dtype="bfloat16", remat="full")
MOE_MACHINES = {"8xH100 fsdp=8": (59.7, memory.Layout(fsdp=8, samplers=8, platform="gpu")),
                "8xH100 fsdp=2 expert=4": (59.7, memory.Layout(fsdp=2, expert=4, samplers=8, platform="gpu")),
                "8xH100 expert=8": (59.7, memory.Layout(expert=8, samplers=8, platform="gpu")),
                "8xH200 fsdp=8": (104.2, memory.Layout(fsdp=8, samplers=8, platform="gpu"))}


def moe_table(a) -> list[str]:
    """Qwen3-30B-A3B, full weights and LoRA (on attention; on attention and every expert), per
    device as learner + sampler = total."""
    attention_lora = QWEN3_30B_A3B.replace(lora_rank=LORA_RANK, lora_alpha=2.0 * LORA_RANK,
                                           lora_targets=("q", "k", "v", "o"))
    expert_lora = attention_lora.replace(lora_targets=tuple(lora.TARGETS))
    lines = ["## A mixture of experts: Qwen3-30B-A3B", "",
             f"{QWEN3_30B_A3B.num_params / 1e9:.1f}B parameters, {QWEN3_30B_A3B.active_params / 1e9:.2f}B active "
             "per token. Each cell: learner + sampler = GiB per device (8xH200: 75% of its HBM, assumed). "
             "The learner's stacked experts split over fsdp x expert; LoRA's adapters are replicated, those on "
             "the experts split as the experts; each sampler device holds a bf16 "
             "copy of the weights with the experts split over the 8 devices (`sampler.expert_parallel`): "
             "a whole copy (61 GB) leaves no room on an H100 for anything else.", ""]
    for n in LENGTHS[:2]:
        lines += [f"### {n} tokens", "", "| model | " + " | ".join(MOE_MACHINES) + " |",
                  "|---|" + "---|" * len(MOE_MACHINES)]
        for label, cfg in (("Qwen3-30B-A3B", QWEN3_30B_A3B),
                           (f"Qwen3-30B-A3B, LoRA r={LORA_RANK} (q,k,v,o)", attention_lora),
                           (f"Qwen3-30B-A3B, LoRA r={LORA_RANK} (q,k,v,o + experts)", expert_lora)):
            cells = []
            for cap, layout in MOE_MACHINES.values():
                learner, sampler = parts_gb(cfg, a.rows, n, a.minibatches, a.sample_rows, layout)
                total = learner + sampler
                cells.append(f"{learner:.1f} + {sampler:.1f} = {total:.1f} {'fits' if total <= cap else '**no**'}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


# Qwen2.5-32B and -72B (their config.json): too large for a whole bf16 sampler copy on one H100
QWEN25_LARGE = {"32B": (64, 5120, 27648, 40, 8, 128, False), "72B": (80, 8192, 29568, 64, 8, 128, False)}
TP_MACHINES = {"8xH100 fsdp=8": (59.7, memory.Layout(fsdp=8, samplers=8, platform="gpu")),
               "8xH200 fsdp=8": (104.2, memory.Layout(fsdp=8, samplers=8, platform="gpu"))}


def tp_table(a) -> list[str]:
    """Dense models whose sampler copy does not fit one device, with tensor-parallel samplers
    (`sampler.tensor` = T: each sampler device holds 1/T of the weights and of its rows' KV cache,
    the rows split over 8 / T groups): learner + sampler = GiB per device."""
    n, sizes = LENGTHS[0], (1, 2, 4, 8)
    lines = ["## Tensor-parallel samplers: Qwen2.5-32B and -72B", "",
             "Each cell: learner + sampler = GiB per device at " + f"{n} tokens, for `sampler.tensor` = "
             + ", ".join(map(str, sizes)) + " (each sampler device holds 1/T of the bf16 weights, the rows' KV "
             "cache and logits; the rows split over 8 / T groups).", "",
             "| model | machine | " + " | ".join(f"tensor={t}" for t in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for name, shape in QWEN25_LARGE.items():
        for label, cfg in ((f"Qwen2.5-{name}", qwen25(shape)), (f"Qwen2.5-{name}, LoRA r={LORA_RANK}",
                                                                 qwen25(shape, LORA_RANK))):
            for machine, (cap, layout) in TP_MACHINES.items():
                learner = memory.total(memory.learner(cfg, a.rows, n, a.minibatches, layout=layout)) / memory.GB
                cells = []
                for t in sizes:
                    groups = layout.samplers // t
                    sampler = memory.total(memory.sampler(cfg.without_lora(), -(-a.sample_rows // groups), 256,
                                                          n - 256, "bfloat16", "bfloat16", "gpu", tensor=t)) / memory.GB
                    total = learner + sampler
                    cells.append(f"{learner:.1f} + {sampler:.1f} = {total:.1f} {'fits' if total <= cap else '**no**'}")
                lines.append(f"| {label} | {machine} | " + " | ".join(cells) + " |")
    return lines + [""]


def table(a) -> list[str]:
    lines = []
    for n in LENGTHS:
        lines += [f"### {n} tokens", "", "| model | " + " | ".join(MACHINES) + " |", "|---|" + "---|" * len(MACHINES)]
        for rank in (0, LORA_RANK):
            for name, shape in QWEN25.items():
                cells = []
                for cap, _, layout in MACHINES.values():
                    gb = plan_gb(shape, a.rows, n, a.minibatches, a.sample_rows, layout, lora_rank=rank)
                    cells.append(f"{gb:.1f} {'fits' if gb <= cap else '**no**'}")
                label = f"Qwen2.5-{name}" + (f", LoRA r={rank}" if rank else "")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--sample_rows", type=int, default=64)
    ap.add_argument("--out", default="", help="write the page here (e.g. experiments/results/what_fits.md)")
    a = ap.parse_args()
    lines = table(a) + moe_table(a) + tp_table(a)
    print("\n".join(lines))
    if a.out:
        head = ["# What fits", "", "Generated by `python experiments/what_fits.py --out " + a.out + "` from the memory",
                "plan (`jaxrl_llm/run/memory.py`), in GiB per device against each machine's budget per device "
                f"({', '.join(f'{m}: {c[0]} GiB' for m, c in MACHINES.items())}; GPU and TPU budgets are "
                "JAX's default fraction of HBM, TPU's assumed 95%): learner and one sampler sharing each device, "
                f"{a.rows} rows in {a.minibatches} minibatches,",
                f"{a.sample_rows} sampler rows, a 256-token prompt, bf16 compute and cache, `remat=full`. Full weights keep",
                "float32 master weights and AdamW moments; LoRA (rank 16, attention + MLP) keeps the frozen base",
                "once in bf16, float32 adapters with their moments, and the sampler's merged copy. The CPU figure",
                "adds one layer's float32 weight copy for XLA:CPU's bf16 matmuls. Measured points:",
                "`bench_scale_cpu.md` and `bench_scale_lora_cpu.md` beside this page.", ""]
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
