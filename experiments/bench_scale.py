"""The memory plan at real size: a Qwen2.5-0.5B-shaped model's learner step and sampler call
against the budget of `jaxrl_llm/run/memory.py` (not a test).

    python experiments/bench_scale.py [--json out.json] [--remat full] [--dtype bfloat16]
                                      [--cache_dtype bfloat16] [--tiny]
    python experiments/bench_scale.py --end-to-end [--json out.json] [--dtypes float32,bfloat16]

Shapes of Qwen2.5-0.5B (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocab
151,936, tied embeddings), randomly initialised (nothing is downloaded). The learner trains
`--rows` sequences of `--seq_len` tokens in `--minibatches` updates (PPO clipped loss on GRPO advantages, AdamW); the
sampler generates `--sample_rows` rows of `--new_tokens` tokens after a `--prompt_len` prompt.
Each part runs in its own process so that its peak RSS is its own. Reported per part: peak
from the compiled executables' memory analysis (arguments + temporaries + outputs - aliased),
the process's peak RSS, the plan's budget, and tokens per second. `--tiny` runs the same code
on a small model (the test does).

`--lora` adds LoRA (rank `--lora_rank`, attention + MLP): the learner step trains adapters over a
frozen base held in the compute dtype, measured beside the full-weight step in the same run;
each version's publication carries the adapters only; and the sampler decodes with the base
merged with that version's adapters (the weight store's path) and, for comparison, with the
low-rank side path in the decode step. Keys: `lora_learner_peak_vs_full`,
`lora_learner_peak_vs_plan`, `lora_publish_bytes_frac`, `lora_decode_vs_base` (merged weights),
`lora_sidepath_decode_vs_base`, `lora_merge_s` (one version's merge).

`--end-to-end` checks a whole run against the plan it prints at start-up: it writes a
Qwen2.5-0.5B-shaped Hugging Face directory (random weights in bf16 safetensors, a tokenizer
trained here) and a small GSM8K-style jsonl dataset, then runs the main CLI on them for 2 steps
(math task, `--rows` rows, `--new_tokens` new tokens, async A-3PO as in configs/default.py) once
per `--dtypes` entry, each in its own process. Reported per dtype: `run_peak_rss_gb` (the
process's peak RSS from wait4) and `run_budget_gb` (the plan's total from the run's log).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time

from jaxrl_llm.research.cost import QWEN25_05B  # the shapes the A-3PO cost claim is measured at

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, tie_word_embeddings=True)


def _args():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--part", choices=("learner", "sampler", "learner_lora"), default=None, help="(internal) run one part")
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
    ap.add_argument("--lora", action="store_true", help="LoRA learner, publication and decode beside the full ones")
    ap.add_argument("--lora_rank", type=int, default=16)
    ap.add_argument("--weights", default="base", choices=("base", "merged", "sidepath"),
                    help="(internal) the sampler part's weights")
    ap.add_argument("--end-to-end", dest="end_to_end", action="store_true",
                    help="the main CLI on a written 0.5B-shaped checkpoint (see the docstring)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="--end-to-end: model.dtype of each run")
    return ap.parse_args()


def _cfg(a, lora: bool = False):
    from jaxrl_llm.models import lora as lora_lib
    from jaxrl_llm.models.config import ModelConfig

    cfg = ModelConfig(**(TINY if a.tiny else QWEN25_05B), dtype=a.dtype, remat=a.remat)
    if lora:  # alpha = 2 r, as in many RL recipes; the scale does not change memory or speed
        cfg = cfg.replace(lora_rank=a.lora_rank, lora_alpha=2.0 * a.lora_rank, lora_targets=tuple(lora_lib.TARGETS))
    return cfg


def _adapters(cfg, seed: int = 1):
    """Random adapters (B not zero, so a merge or side path does real work)."""
    import jax

    from jaxrl_llm.models import decoder, lora

    like = jax.eval_shape(lambda: lora.split(decoder.init_params(cfg, jax.random.key(0)))[1])
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(like))))
    return jax.tree.map(lambda x: 0.01 * jax.random.normal(next(keys), x.shape, x.dtype), like)


def compiled_peak(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def run_learner(a, lora: bool = False) -> dict:
    import jax

    from jaxrl_llm.learner import learner as L
    from jaxrl_llm import testing
    from jaxrl_llm.parallel import sharding
    from jaxrl_llm.run import memory
    from jaxrl_llm.models import decoder
    from jaxrl_llm.runtime.weights import WeightStore

    cfg = _cfg(a, lora)
    c = L.default_config()
    c.lr, c.num_minibatches, c.packing = 1e-5, a.minibatches, "off"
    lrn = L.Learner(cfg, {"name": "ppo"}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))  # one device's plan
    extra = {}
    if lora:  # the base made in the compute dtype: no float32 copy of it ever exists
        plain = cfg.without_lora().replace(param_dtype=cfg.dtype)
        state = lrn.init(jax.random.key(0), params=jax.jit(lambda k: decoder.init_params(plain, k))(jax.random.key(0)),
                         adapters=_adapters(cfg))
        store = WeightStore(dtype=cfg.dtype, lora_scale=cfg.lora_scale)
        t = time.perf_counter()
        store.publish(1, lrn.rollout_params(state), base=lrn.rollout_base)
        jax.block_until_ready(store.latest()[1])
        extra = dict(publish_bytes=store.published_bytes, full_publish_bytes=4 * cfg.num_params,
                     publish_and_merge_s=time.perf_counter() - t)
        del store
    else:
        state = lrn.init(jax.random.key(0))
    batch = testing.model_batch(lrn.policy_params(state), cfg.without_lora(), num_prompts=a.rows // 2, group_size=2,
                                length=a.seq_len, prompt=a.prompt_len, topk=0, version=1, max_staleness=0)
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
    out = dict(learner_peak_gb=peak / memory.GB, learner_rss_gb=memory.peak_rss() / memory.GB,
               learner_budget_gb=memory.total(plan) / memory.GB,
               learner_plan={k: v / memory.GB for k, v in plan.items()},
               learner_tokens_per_s=a.rows * a.seq_len / step, learner_step_s=step,
               learner_compile_and_first_step_s=compile_and_step, params=cfg.num_params, **extra)
    return {f"lora_{k}": v for k, v in out.items()} if lora else out


def run_sampler(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.run import memory
    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout import Sampler, SamplerConfig

    from jaxrl_llm.models import lora

    cfg = _cfg(a)
    weights = "bfloat16" if a.dtype == "bfloat16" else "float32"
    # Initialised in the weights' dtype: nothing float32 to cast.
    params = jax.jit(lambda k: decoder.init_params(cfg.replace(param_dtype=weights), k))(jax.random.key(0))
    extra, weights_kind = {}, getattr(a, "weights", "base")
    if weights_kind != "base":
        lcfg = _cfg(a, lora=True)
        adapters = _adapters(lcfg)
        if weights_kind == "merged":  # the weight store's per-version copy: the base's own decode program
            merge = jax.jit(lambda b, ad: lora.merge(b, ad, lcfg.lora_scale, weights))
            jax.block_until_ready(merge(params, adapters))
            t = time.perf_counter()
            params = jax.block_until_ready(merge(params, adapters))
            extra["merge_s"] = time.perf_counter() - t
        else:  # the low-rank side path inside every decode step
            cfg, params = lcfg, lora.combine(params, adapters)
    scfg = SamplerConfig(max_new_tokens=a.new_tokens, num_samples=1, prompt_buckets=(a.prompt_len,),
                         cache_dtype=a.cache_dtype, top_k=20, eos_token_id=None, capture_topk=0)
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
    out = dict(sampler_peak_gb=peak / memory.GB, sampler_rss_gb=memory.peak_rss() / memory.GB,
               sampler_budget_gb=memory.total(plan) / memory.GB,
               sampler_plan={k: v / memory.GB for k, v in plan.items()},
               sampler_tokens_per_s=generated / call, sampler_call_s=call,
               sampler_compile_and_first_call_s=compile_and_call, **extra)
    return out if weights_kind == "base" else {f"{weights_kind}_{k}": v for k, v in out.items()}


# ------------------------------------------------------------------ the whole run
def write_checkpoint(path: str, tiny: bool) -> None:
    """A random Hugging Face Qwen2 directory of the benchmark's shapes (bf16 safetensors, as
    Qwen2.5 ships), a byte-level BPE tokenizer with a chat template and a GSM8K-style dataset."""
    import torch
    import transformers

    from jaxrl_llm.testing import make_tokenizer

    rng = random.Random(0)
    rows = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(32)]
    with open(os.path.join(path, "train.jsonl"), "w") as f:
        for a, b in rows:
            f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                                "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"}) + "\n")
    make_tokenizer(path, corpus=[json.dumps(r) for r in rows] + ["apples buys more How many does he have"],
                   vocab_size=400)
    shapes = TINY if tiny else QWEN25_05B
    cfg = transformers.Qwen2Config(
        vocab_size=shapes["vocab_size"], hidden_size=shapes["hidden_size"],
        intermediate_size=shapes["intermediate_size"], num_hidden_layers=shapes["num_layers"],
        num_attention_heads=shapes["num_heads"], num_key_value_heads=shapes["num_kv_heads"],
        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def run_end_to_end(a) -> dict:
    """The main CLI for 2 steps per dtype, in a child process whose peak RSS is its own."""
    import re

    from jaxrl_llm.run import memory

    out = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        os.makedirs(ckpt)
        write_checkpoint(ckpt, a.tiny)
        for dtype in a.dtypes.split(","):
            cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py",
                   f"--workdir={os.path.join(d, 'run_' + dtype)}", f"--config.model.hf_path={ckpt}",
                   "--config.task.name=math", f"--config.task.path={ckpt}/train.jsonl",
                   "--config.task.eval_size=2", "--config.task.eval_holdout=0.1",
                   f"--config.task.max_answer_len={a.new_tokens}",
                   f"--config.runtime.prompts_per_batch={a.rows // 2}", "--config.sampler.num_samples=2",
                   f"--config.learner.num_minibatches={a.minibatches}", f"--config.model.dtype={dtype}",
                   f"--config.model.remat={a.remat}", "--config.train.steps=2", "--config.train.eval_every=2",
                   "--config.train.save_every=1000", "--config.train.tensorboard=False",
                   "--config.warm_start.steps=0", "--config.learner.lr=1e-6"]
            t = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            log = proc.stdout.read()
            _, status, usage = os.wait4(proc.pid, 0)
            if status:
                raise RuntimeError(f"the {dtype} run failed ({status}):\n{log[-4000:]}")
            plan = re.search(r"memory plan \(GiB per device\): (.*)\(total [\d.]+ GiB\); needs ([\d.]+)", log)
            out[dtype] = dict(run_peak_rss_gb=usage.ru_maxrss * 1024 / memory.GB, run_budget_gb=float(plan.group(2)),
                              run_plan=plan.group(1).rstrip(" "), run_s=time.perf_counter() - t)
            out[dtype]["run_rss_over_budget"] = out[dtype]["run_peak_rss_gb"] / out[dtype]["run_budget_gb"]
    return out


def main():
    a = _args()
    if a.end_to_end:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import cpu_kind

        results = dict(model="tiny" if a.tiny else "Qwen2.5-0.5B-shaped", end_to_end=True, remat=a.remat,
                       rows=a.rows, new_tokens=a.new_tokens, minibatches=a.minibatches, **run_end_to_end(a))
        results.update(cpu_kind())
        print(json.dumps(results, indent=2))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    if a.part:
        out = {"learner": run_learner, "sampler": run_sampler, "learner_lora": lambda a: run_learner(a, True)}[a.part](a)
        with open(a.json, "w") as f:
            json.dump(out, f)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import cpu_kind, report

    results = dict(model="tiny" if a.tiny else "Qwen2.5-0.5B-shaped", remat=a.remat, dtype=a.dtype,
                   cache_dtype=a.cache_dtype, rows=a.rows, seq_len=a.seq_len, minibatches=a.minibatches,
                   sample_rows=a.sample_rows, prompt_len=a.prompt_len, new_tokens=a.new_tokens)
    flags = [f"--{k}={v}" for k, v in vars(a).items()
             if k not in ("json", "part", "tiny", "end_to_end", "dtypes", "lora", "weights")]
    parts = [("learner", "base"), ("sampler", "base")]
    if a.lora:
        results["lora_rank"] = a.lora_rank
        parts += [("learner_lora", "base"), ("sampler", "merged"), ("sampler", "sidepath")]
    for part, weights in parts:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), f"--part={part}", f"--weights={weights}",
                   f"--json={tmp.name}", *flags]
            subprocess.run(cmd + (["--tiny"] if a.tiny else []), check=True)
            results.update(json.load(open(tmp.name)))
    for part in ("learner", "sampler") + (("lora_learner",) if a.lora else ()):
        results[f"{part}_peak_over_budget"] = results[f"{part}_peak_gb"] / results[f"{part}_budget_gb"]
        results[f"{part}_rss_over_budget"] = results[f"{part}_rss_gb"] / results[f"{part}_budget_gb"]
    if a.lora:
        results.update(
            lora_learner_peak_vs_full=results["lora_learner_peak_gb"] / results["learner_peak_gb"],
            lora_learner_peak_vs_plan=results["lora_learner_peak_over_budget"],
            lora_learner_step_vs_full=results["lora_learner_step_s"] / results["learner_step_s"],
            lora_publish_bytes_frac=results["lora_publish_bytes"] / results["lora_full_publish_bytes"],
            lora_decode_vs_base=results["merged_sampler_tokens_per_s"] / results["sampler_tokens_per_s"],
            lora_sidepath_decode_vs_base=results["sidepath_sampler_tokens_per_s"] / results["sampler_tokens_per_s"],
            lora_merge_s=results["merged_merge_s"])
    results.update(cpu_kind())
    report({k: v for k, v in results.items() if not isinstance(v, dict)}, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
