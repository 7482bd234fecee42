"""The memory plan at real size: a Qwen2.5-0.5B-shaped model's learner step and sampler call
against the budget of `jaxrl_llm/memory.py` (not a test).

    python experiments/bench_scale.py [--json out.json] [--remat full] [--dtype bfloat16]
                                      [--cache_dtype bfloat16] [--tiny]

Shapes of Qwen2.5-0.5B (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocab
151,936, tied embeddings), randomly initialised (nothing is downloaded). The learner trains
`--rows` sequences of `--seq_len` tokens in `--minibatches` updates (PPO clipped loss on GRPO advantages, AdamW); the
sampler generates `--sample_rows` rows of `--new_tokens` tokens after a `--prompt_len` prompt.
Each part runs in its own process so that its peak RSS is its own. Reported per part: peak
from the compiled executables' memory analysis (arguments + temporaries + outputs - aliased),
the process's peak RSS, the plan's budget, and tokens per second. `--tiny` runs the same code
on a small model (the test does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                  num_kv_heads=2, head_dim=64, tie_word_embeddings=True, rope_theta=1000000.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, tie_word_embeddings=True)


def _args():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--part", choices=("learner", "sampler"), default=None, help="(internal) run one part")
    ap.add_argument("--tiny", action="store_true", help="a small model, same code path (tests)")
    ap.add_argument("--remat", default="full", choices=("none", "full", "dots"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    ap.add_argument("--cache_dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--sample_rows", type=int, default=16)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=256)
    return ap.parse_args()


def _cfg(a):
    from jaxrl_llm.models.config import ModelConfig

    return ModelConfig(**(TINY if a.tiny else QWEN25_05B), dtype=a.dtype, remat=a.remat)


def compiled_peak(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def run_learner(a) -> dict:
    import jax

    from jaxrl_llm import learner as L
    from jaxrl_llm import memory, sharding, testing

    cfg = _cfg(a)
    c = L.default_config()
    c.lr, c.num_minibatches, c.packing = 1e-5, a.minibatches, "off"
    lrn = L.Learner(cfg, {"name": "ppo"}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))  # one device's plan
    state = lrn.init(jax.random.key(0))
    batch = testing.model_batch(state.params, cfg, num_prompts=a.rows // 2, group_size=2, length=a.seq_len,
                                prompt=a.prompt_len, topk=0, version=1, max_staleness=0)
    batch = jax.block_until_ready(batch)
    t = time.perf_counter()
    state, _ = lrn.train_step(state, batch)
    jax.block_until_ready(state.params)
    compile_and_step = time.perf_counter() - t
    t = time.perf_counter()
    state, _ = lrn.train_step(state, batch)
    jax.block_until_ready(state.params)
    step = time.perf_counter() - t
    peak = compiled_peak(lrn.lower_step(state, batch).compile())
    plan = memory.learner(cfg, a.rows, a.seq_len, a.minibatches, c.logprob_chunk)
    return dict(learner_peak_gb=peak / memory.GB, learner_rss_gb=memory.peak_rss() / memory.GB,
                learner_budget_gb=memory.total(plan) / memory.GB,
                learner_plan={k: v / memory.GB for k, v in plan.items()},
                learner_tokens_per_s=a.rows * a.seq_len / step, learner_step_s=step,
                learner_compile_and_first_step_s=compile_and_step, params=cfg.num_params)


def run_sampler(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm import memory
    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout import Sampler, SamplerConfig

    cfg = _cfg(a)
    weights = "bfloat16" if a.dtype == "bfloat16" else "float32"
    params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(weights), decoder.init_params(cfg, k)))(
        jax.random.key(0))
    scfg = SamplerConfig(max_new_tokens=a.new_tokens, num_samples=1, prompt_buckets=(a.prompt_len,),
                         cache_dtype=a.cache_dtype, top_k=20, eos_token_id=None)
    sampler = Sampler(cfg, scfg)
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (a.sample_rows, a.prompt_len)).tolist()
    t = time.perf_counter()
    out = sampler.generate(params, prompts, jax.random.key(1))
    jax.block_until_ready(out.tokens)
    compile_and_call = time.perf_counter() - t
    t = time.perf_counter()
    out = sampler.generate(params, prompts, jax.random.key(2))
    jax.block_until_ready(out.tokens)
    call = time.perf_counter() - t
    generated = float(jnp.sum(out.loss_mask))
    peak = compiled_peak(sampler.lower_generate(params, prompts, jax.random.key(2)).compile())
    plan = memory.sampler(cfg, a.sample_rows, a.prompt_len, a.new_tokens, a.cache_dtype, weights)
    return dict(sampler_peak_gb=peak / memory.GB, sampler_rss_gb=memory.peak_rss() / memory.GB,
                sampler_budget_gb=memory.total(plan) / memory.GB,
                sampler_plan={k: v / memory.GB for k, v in plan.items()},
                sampler_tokens_per_s=generated / call, sampler_call_s=call,
                sampler_compile_and_first_call_s=compile_and_call)


def main():
    a = _args()
    if a.part:
        out = (run_learner if a.part == "learner" else run_sampler)(a)
        with open(a.json, "w") as f:
            json.dump(out, f)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import cpu_kind, report

    results = dict(model="tiny" if a.tiny else "Qwen2.5-0.5B-shaped", remat=a.remat, dtype=a.dtype,
                   cache_dtype=a.cache_dtype, rows=a.rows, seq_len=a.seq_len, minibatches=a.minibatches,
                   sample_rows=a.sample_rows, prompt_len=a.prompt_len, new_tokens=a.new_tokens)
    flags = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("json", "part", "tiny")]
    for part in ("learner", "sampler"):
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), f"--part={part}", f"--json={tmp.name}", *flags]
            subprocess.run(cmd + (["--tiny"] if a.tiny else []), check=True)
            results.update(json.load(open(tmp.name)))
    for part in ("learner", "sampler"):
        results[f"{part}_peak_over_budget"] = results[f"{part}_peak_gb"] / results[f"{part}_budget_gb"]
        results[f"{part}_rss_over_budget"] = results[f"{part}_rss_gb"] / results[f"{part}_budget_gb"]
    results.update(cpu_kind())
    report({k: v for k, v in results.items() if not isinstance(v, dict)}, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
