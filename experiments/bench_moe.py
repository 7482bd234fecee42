"""A mixture-of-experts policy: learner step and decode against transformers (PyTorch eager) on the
same random-init Qwen3-MoE-shaped model, and our two dispatches against each other (not a test).

    python experiments/bench_moe.py [--json experiments/results/bench_moe_cpu.json] [--repeats 3]

Model: Qwen3-MoE architecture, 4 layers, hidden 256, 8 query / 2 KV heads of 32, vocab 512, 16
experts of width 256 with the top 4 renormalised (Qwen3-30B-A3B's expert width / hidden ratio and a
quarter of its experts active instead of 8 of 128, so the tiny model keeps several experts per
token). Learner: bench_learner's GRPO step (B = 32 x L = 128, 4 minibatch updates, AdamW, clipping)
on both sides. Decode: bench_sampler's workload (64 prompts of 32 tokens, 96 new tokens, T = 1).
Each side of a comparison takes turns within every repeat (best of `--repeats`). Our learner runs
with its rows over every device (data parallel) and, for dense and blocked, on one device of the
same process (`*_one_device`), whose matmuls use every core: the faster layout on this CPU.

`moe_dispatch=dense` runs every expert on every token (E / k = 4x the expert FLOPs, no gather or
scatter); `grouped` sorts the (token, expert) pairs and runs one `jax.lax.ragged_dot` per
projection; `blocked` pads each expert's sorted pairs to whole blocks run as one batched matmul
(a learner's batch) or, in decode, runs them in the fewest per-expert slots that hold them all.
All three are reported with their ratios to dense; `auto` (what runs unless set) picks blocked on
CPU for this model. Decode splits the experts over the devices (`sampler.expert_parallel`;
`moe_decode_split_vs_replicated`: against every device holding all of them, blocked dispatch).
`moe_learner_vs_torch` and `moe_decode_vs_hf` take the fastest dispatch and layout. `routing_capture_cost`: the
decode time routing capture (R3, `record_routing`) adds, blocked dispatch; `routing_bytes_per_token`:
what it records (int16 expert ids, top-k per sparse layer).
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm import models, testing
from jaxrl_llm.rollout import Sampler, SamplerConfig

import bench_learner as BL  # noqa: E402  (experiments/ is on sys.path when run as a script)
import bench_sampler as BS  # noqa: E402
from common import across_isas, cpu_kind, parse_args, report  # noqa: E402

EXPERTS, TOP, WIDTH = 16, 4, 256
DISPATCHES = ("dense", "grouped", "blocked")


def hf_moe(path: str):
    import torch
    import transformers

    torch.manual_seed(0)
    hc = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                     num_experts=EXPERTS, num_experts_per_tok=TOP, moe_intermediate_size=WIDTH,
                                     norm_topk_prob=True, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(hc).eval()
    model.save_pretrained(path)
    return model


def learner_steps(cfg, params, batch, repeats: int) -> dict:
    """Best step time of each dispatch with the rows over every device (data parallel), and of
    the two fastest on one device (a single-device mesh of the same process: XLA's intra-op
    threads use every core), the steps interleaved."""
    from jaxrl_llm.parallel import sharding

    runs = {}
    for name, dispatch, devices in [(d, d, None) for d in DISPATCHES] + [
            (f"{d}_one_device", d, jax.devices()[:1]) for d in ("dense", "blocked")]:
        mesh = sharding.make_mesh(None, devices) if devices else None
        lrn = BL._learner(cfg.replace(moe_dispatch=dispatch), "ppo", mesh=mesh)
        state = lrn.init(jax.random.key(0), params=params)
        state, _ = lrn.train_step(state, batch)  # compile
        runs[name] = [lrn, state, float("inf")]
    for _ in range(repeats):
        for name, (lrn, state, best) in runs.items():
            t = time.perf_counter()
            state, _ = lrn.train_step(state, batch)
            jax.block_until_ready(state.params)
            runs[name] = [lrn, state, min(best, time.perf_counter() - t)]
    return {d: r[2] for d, r in runs.items()}


def decode_run(params, cfg, record: bool = False, split: bool = True):
    """bench_sampler's workload on every device (rows split, and the experts unless `split` is
    off), compiled here; `record`: with routing capture (R3)."""
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (BS.B, BS.PROMPT)).tolist()
    s = Sampler(cfg, SamplerConfig(max_new_tokens=BS.NEW, temperature=1.0, capture_topk=BS.K,
                                   prompt_buckets=(BS.PROMPT,), eos_token_id=None, num_samples=1,
                                   record_routing=record, expert_parallel=split),
                mesh=Mesh(np.asarray(jax.devices()), ("data",)))
    keys, placed = iter(range(1 << 30)), s.place_params(params)  # once, as the weight store publishes a version
    run = lambda: jax.block_until_ready(s.generate(placed, prompts, jax.random.key(next(keys))).tokens)  # noqa: E731
    run()
    return run


def main():
    args = parse_args(__doc__, extra=lambda ap: ap.add_argument(
        "--devices", type=int, default=os.cpu_count(), help="CPU devices JAX exposes (decode splits rows over them)"))
    if across_isas(args):
        return
    jax.config.update("jax_num_cpu_devices", args.devices)
    with tempfile.TemporaryDirectory() as d:
        hf = hf_moe(d)
        params, cfg = models.load_params(d)
    res = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "experts": EXPERTS, "top_k": TOP,
           "params_total_m": cfg.num_params / 1e6, "params_active_m": cfg.active_params / 1e6, **cpu_kind()}
    batch = testing.model_batch(params, cfg, seed=0, num_prompts=BL.B // 8, group_size=8, length=BL.LEN,
                                prompt=BL.PROMPT, topk=0, version=4, max_staleness=4)
    tokens = BL.B * BL.LEN
    steps = learner_steps(cfg, params, batch, args.repeats)
    t_torch = BL.time_torch(hf, batch, args.repeats)
    res.update({f"moe_learner_tokens_per_s_{d}": tokens / t for d, t in steps.items()},
               torch_learner_tokens_per_s=tokens / t_torch, moe_learner_vs_torch=t_torch / min(steps.values()),
               **{f"moe_learner_{d}_vs_dense": steps["dense"] / steps[d] for d in DISPATCHES[1:]})
    hf.eval()
    r = BS.tokens_per_s({**{d: decode_run(params, cfg.replace(moe_dispatch=d)) for d in DISPATCHES},
                         "recorded": decode_run(params, cfg.replace(moe_dispatch="blocked"), record=True),
                         "replicated": decode_run(params, cfg.replace(moe_dispatch="blocked"), split=False),
                         "hf": BS.hf(hf, cfg.vocab_size)}, args.repeats)
    sparse = sum(cfg.sparse(i) for i in range(cfg.num_layers))
    res.update(routing_capture_cost=1.0 - r["recorded"] / r["blocked"],
               routing_bytes_per_token=sparse * cfg.num_experts_per_tok * 2)  # int16 ids
    res.update({f"moe_decode_tokens_per_s_{d}": r[d] for d in DISPATCHES}, hf_decode_tokens_per_s=r["hf"],
               moe_decode_vs_hf=max(r[d] for d in (*DISPATCHES, "replicated")) / r["hf"],
               moe_decode_tokens_per_s_blocked_replicated=r["replicated"],
               moe_decode_split_vs_replicated=r["blocked"] / r["replicated"],
               **{f"moe_decode_{d}_vs_dense": r[d] / r["dense"] for d in DISPATCHES[1:]})
    report(res, args.json)


if __name__ == "__main__":
    main()
