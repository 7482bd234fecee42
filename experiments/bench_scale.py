"""The memory plan at real size: a Qwen2.5-0.5B-shaped model's learner step and sampler call
against the budget of `jaxrl_llm/memory.py` (not a test).

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
    ap.add_argument("--end-to-end", dest="end_to_end", action="store_true",
                    help="the main CLI on a written 0.5B-shaped checkpoint (see the docstring)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="--end-to-end: model.dtype of each run")
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
    # Initialised in the weights' dtype: nothing float32 to cast.
    params = jax.jit(lambda k: decoder.init_params(cfg.replace(param_dtype=weights), k))(jax.random.key(0))
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
    return dict(sampler_peak_gb=peak / memory.GB, sampler_rss_gb=memory.peak_rss() / memory.GB,
                sampler_budget_gb=memory.total(plan) / memory.GB,
                sampler_plan={k: v / memory.GB for k, v in plan.items()},
                sampler_tokens_per_s=generated / call, sampler_call_s=call,
                sampler_compile_and_first_call_s=compile_and_call)


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

    from jaxrl_llm import memory

    out = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        os.makedirs(ckpt)
        write_checkpoint(ckpt, a.tiny)
        for dtype in a.dtypes.split(","):
            cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py",
                   f"--workdir={os.path.join(d, 'run_' + dtype)}", f"--config.model.hf_path={ckpt}",
                   "--config.task.name=math", f"--config.task.path={ckpt}/train.jsonl",
                   "--config.task.eval_size=2", f"--config.task.max_answer_len={a.new_tokens}",
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
            plan = re.search(r"memory plan \(GiB\): (.*)\(total ([\d.]+) GiB\)", log)
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
        out = (run_learner if a.part == "learner" else run_sampler)(a)
        with open(a.json, "w") as f:
            json.dump(out, f)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import cpu_kind, report

    results = dict(model="tiny" if a.tiny else "Qwen2.5-0.5B-shaped", remat=a.remat, dtype=a.dtype,
                   cache_dtype=a.cache_dtype, rows=a.rows, seq_len=a.seq_len, minibatches=a.minibatches,
                   sample_rows=a.sample_rows, prompt_len=a.prompt_len, new_tokens=a.new_tokens)
    flags = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("json", "part", "tiny", "end_to_end", "dtypes")]
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
