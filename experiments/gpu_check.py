"""The GPU check: one command for a lent H100 / H200 (about 9 minutes before `moe`), not a test.

    python experiments/gpu_check.py [--out experiments/results/gpu_check_<kind>.json] [--wheels DIR]
    python experiments/gpu_check.py --dry          # every stage at tiny shapes on CPU (a test runs this)

Stages run in order and each writes the JSON as it finishes (a crash or a timeout keeps the
earlier ones; a stage that raises records its error and the next one runs):

  backend      device kind, count, `bytes_limit`, JAX version
  init         seconds to compile the 0.5B-shaped `init_params` (a minute on an H200 while each
               layer was drawn on its own) and to run it
  vocab        ms per call at a 152k vocabulary, 64 rows: a full sort (what top-p cost before),
               top-p 0.9 by bisection, top-k 50 + top-p 0.9, the blockwise top-k
  attention    each kernel `model.attention` offers here (xla, cudnn on GPU, chunked, einsum):
               ms, compiled temporaries, max |difference| from the einsums, bf16, left padding
  head         the log-prob head's matmul at Qwen2.5-0.5B's D x V in float32 at default precision
               (TF32 on an H100) against HIGHEST: ms each and the largest log-prob difference
  decode       0.5B-shaped static decode: compile seconds, ms per step, tokens/s, fraction of the
               HBM roofline (bf16 weights read once per step + each row's cache)
  logp_gap     sampler vs learner log-probs of the same tokens at unchanged weights, bf16 and fp32
  learner      0.5B-shaped bf16 learner step: tokens/s, MFU, compiled peak vs the memory plan,
               whether two identical steps from one state give bitwise-equal weights
  determinism  the same two steps in a child process with `--xla_gpu_deterministic_ops`
               (`train.deterministic=True`), which must start before the backend does
  prox_pass    the prox pass's compiled temporaries vs the plan's step temporaries (V = 152k)
  end_to_end   the default config (embedded task, no downloads), 20 steps, static and continuous
               batching: wall seconds, trained tokens/s, last reward
  moe          a Qwen3-30B-A3B-shaped mixture (128 experts of width 768, top 8; 2 layers, vocab
               32k) per dispatch (grouped: `auto`'s choice on GPU; blocked): learner and decode
               tokens/s, compiled peaks, and the largest float32 log-prob difference from
               grouped on one batch

`--dry` (the default off an accelerator) runs the same code at tiny shapes on CPU; no MFU or
roofline figure is reported there. `--wheels DIR` installs what the device image lacks first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import bench_gpu  # noqa: E402  (install_missing, parity's masks, learner_step, decode, roofline, DEVICES)


def _timed(fn, repeats: int = 3) -> float:
    """Best seconds of `fn()` after one warm-up call."""
    return bench_gpu.best_time(fn, repeats)


def backend(s) -> dict:
    import jax

    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "devices": jax.device_count(), "jax": jax.__version__,
            "bytes_limit_gib": ((dev.memory_stats() or {}).get("bytes_limit") or 0) / 2**30}


def init(s) -> dict:
    import jax

    from jaxrl_llm.models import decoder

    f = jax.jit(lambda k: decoder.init_params(s.cfg, k))
    t = time.perf_counter()
    compiled = f.lower(jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t
    return {"compile_s": compile_s, "run_ms": _timed(lambda: compiled(jax.random.key(0)), 1) * 1e3}


def vocab(s) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import policy_dist
    from jaxrl_llm.models.policy_dist import PolicyDist

    x = jax.random.normal(jax.random.key(0), (64, s.vocab), jnp.float32) * 3
    calls = {"full_sort": lambda x: jnp.sort(x, -1),
             "top_p09_bisection": lambda x: policy_dist.truncate(x, PolicyDist(1.0, 0, 0.9)),
             "top_k50_top_p09": lambda x: policy_dist.truncate(x, PolicyDist(1.0, 50, 0.9)),
             "top_k50_blockwise": lambda x: policy_dist.top_k(x, 50)}
    return {f"{k}_ms": _timed(lambda f=jax.jit(f): f(x)) * 1e3 for k, f in calls.items()} | {"vocab": s.vocab}


def attention(s) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import attention as attn

    cfg = s.cfg
    rows, length = 4, s.seq_len
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, length, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (rows, cfg.num_kv_heads, cfg.head_dim, length), jnp.bfloat16)
    v = jax.random.normal(keys[2], (rows, cfg.num_kv_heads, length, cfg.head_dim), jnp.bfloat16)
    pos = jnp.arange(length)
    pad = jnp.arange(rows)[:, None] * (length // (2 * rows))
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] >= pad[:, :, None])
    valid = mask.any(-1)[..., None, None]
    run = lambda impl: jax.jit(lambda q, k, v, m, c=cfg.replace(attention=impl): attn.attention(q, k, v, m, c))  # noqa: E731
    want = run("einsum")(q, k, v, mask).astype(jnp.float32)
    out = {"shape": f"{rows}x{length}x{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}",
           "auto": attn.kernel(cfg)}
    for impl in ("xla", "cudnn", "chunked", "einsum") if s.accelerator else ("xla", "chunked", "einsum"):
        try:
            f = run(impl)
            got = f(q, k, v, mask).astype(jnp.float32)
            out[f"{impl}_max_abs_diff"] = float(jnp.max(jnp.where(valid, jnp.abs(got - want), 0)))
            out[f"{impl}_ms"] = _timed(lambda: f(q, k, v, mask)) * 1e3
            out[f"{impl}_temp_mib"] = f.lower(q, k, v, mask).compile().memory_analysis().temp_size_in_bytes / 2**20
        except Exception as e:  # recorded: which kernels run here is what this stage is for
            out[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return out


def head(s) -> dict:
    import jax
    import jax.numpy as jnp

    d, vocab = s.cfg.hidden_size, s.cfg.vocab_size
    h = jax.random.normal(jax.random.key(0), (s.rows * 128, d), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (d, vocab), jnp.float32) / d**0.5
    logp = {p: jax.jit(lambda h, w, p=p: jax.nn.log_softmax(jnp.dot(h, w, precision=p), -1))
            for p in (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST)}
    a, b = (f(h, w) for f in logp.values())
    return {"default_ms": _timed(lambda: logp[jax.lax.Precision.DEFAULT](h, w)) * 1e3,
            "highest_ms": _timed(lambda: logp[jax.lax.Precision.HIGHEST](h, w)) * 1e3,
            "logp_max_abs_diff": float(jnp.max(jnp.abs(a - b))), "shape": f"{h.shape[0]}x{d}x{vocab}"}


def decode(s) -> dict:
    import jax
    import numpy as np

    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout import Sampler, SamplerConfig

    cfg = s.cfg
    params = jax.jit(lambda k: decoder.init_params(cfg.replace(param_dtype=cfg.dtype), k))(jax.random.key(0))
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=s.new_tokens, num_samples=1, prompt_buckets=(s.prompt_len,),
                                         cache_dtype=cfg.dtype, eos_token_id=None, capture_topk=0))
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (s.sample_rows, s.prompt_len)).tolist()
    t = time.perf_counter()
    sampler.generate(params, prompts, jax.random.key(1)).tokens.block_until_ready()
    first = time.perf_counter() - t
    out = bench_gpu.decode(cfg, s.sample_rows, s.prompt_len, s.new_tokens, s.repeats)
    out.update(compile_and_first_call_s=first, ms_per_step=out["decode_call_s"] / s.new_tokens * 1e3)
    if s.kind:
        roof = bench_gpu.roofline(cfg, s.sample_rows, s.prompt_len, s.new_tokens, bench_gpu.DEVICES[s.kind][1])
        out.update(roofline_tokens_per_s=roof, fraction_of_roofline=out["decode_tokens_per_s"] / roof)
    return out


def logp_gap(s) -> dict:
    import jax
    import numpy as np

    from jaxrl_llm.models import decoder, heads
    from jaxrl_llm.rollout import Sampler, SamplerConfig

    out = {}
    for dtype in ("bfloat16", "float32"):
        cfg = s.cfg.replace(dtype=dtype)
        params = decoder.init_params(cfg, jax.random.key(0))
        sampler = Sampler(cfg, SamplerConfig(max_new_tokens=32, num_samples=1, prompt_buckets=(16,), capture_topk=0,
                                             cache_dtype=dtype, eos_token_id=None))
        prompts = np.random.default_rng(1).integers(1, cfg.vocab_size, (8, 16)).tolist()
        b = sampler.generate(params, prompts, jax.random.key(2))
        learner = heads.sequence_logprobs(params, cfg, b.tokens, b.input_mask)["logp"]
        gen = np.asarray(b.loss_mask) > 0
        gap = np.abs(np.asarray(learner) - np.asarray(b.behav_logp))[gen]
        out[f"{dtype}_max_abs"], out[f"{dtype}_mean_abs"] = float(gap.max()), float(gap.mean())
    return out


def learner(s) -> dict:
    from jaxrl_llm.run import memory

    cfg = s.cfg
    out, lc = bench_gpu.learner_step(cfg, s.rows, s.seq_len, s.repeats)
    plan = memory.total(memory.learner(cfg, s.rows, s.seq_len, 1, lc.logprob_chunk))
    out.update(plan_gib=plan / 2**30, compiled_peak_vs_plan=out["learner_compiled_peak_gb"] * 2**30 / plan)
    if s.kind:
        from common import flops_per_token

        flops = 3 * flops_per_token(cfg, s.seq_len / 2)
        out["mfu"] = out["learner_tokens_per_s"] * flops / bench_gpu.DEVICES[s.kind][0]
    out["two_steps_bitwise_equal"] = two_steps_equal(s, lc)
    return out


def two_steps_equal(s, lc=None) -> bool:
    """Two PPO steps from one state on one batch: bitwise-equal weights?"""
    import jax
    import numpy as np

    from jaxrl_llm import testing
    from jaxrl_llm.learner import learner as L
    from jaxrl_llm.parallel import sharding

    lc = lc or bench_gpu.learner_config()
    lrn = L.Learner(s.cfg, {"name": "ppo"}, lc, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    state = lrn.init(jax.random.key(0))
    batch = testing.model_batch(state.params, s.cfg, num_prompts=max(1, s.rows // 2), group_size=2,
                                length=s.seq_len, prompt=s.seq_len // 4, topk=0, version=1, max_staleness=0)
    fresh = lambda: jax.tree.map(lambda x: x.copy(), state)  # noqa: E731  (a step donates its state)
    a, b = (jax.device_get(lrn.train_step(fresh(), batch)[0].params) for _ in range(2))
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def determinism(s) -> dict:
    """`two_steps_equal` in a child process whose XLA starts with deterministic GPU ops."""
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "child.json")
        argv = [sys.executable, os.path.abspath(__file__), "--only", "two_steps", "--out", out]
        proc = subprocess.run(argv + ([] if s.accelerator else ["--dry"]), env=dict(os.environ, XLA_FLAGS=flags),
                              capture_output=True, text=True, timeout=600)
        child = json.load(open(out)) if os.path.exists(out) else {}
    if "two_steps" not in child or "error" in child["two_steps"]:
        raise RuntimeError(f"the child failed (rc {proc.returncode}): {proc.stderr[-400:]}")
    return {"two_steps_bitwise_equal": child["two_steps"]["bitwise_equal"], "xla_flags": flags}


def prox_pass(s) -> dict:
    import accelerator_audit

    return accelerator_audit.prox_pass(rows=s.rows * 4, seq_len=s.seq_len // 4, minibatches=8) if s.accelerator \
        else accelerator_audit.prox_pass(rows=16, seq_len=64, minibatches=8)


def end_to_end(s) -> dict:
    from configs.default import get_config
    from jaxrl_llm.run import experiment

    out = {}
    for batching in ("static", "continuous"):
        c = get_config()
        c.train.steps, c.train.eval_every, c.train.progress = s.steps, s.steps, False
        c.sampler.batching = batching
        if not s.accelerator:  # the dry run: a tiny model, a short warm start
            c.model.update(dict(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
                                num_layers=1))
            c.warm_start.steps, c.task.eval_size = 5, 8
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            experiment.run(c, d, log=lambda *_: None)
            wall = time.perf_counter() - t
            rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
        steps = [r for r in rows if "loss" in r]
        out[batching] = {"wall_s": wall, "steps": len(steps), "tokens_per_s": steps[-1].get("tokens_per_s"),
                         "last_reward": steps[-1].get("reward/mean")}
    return out


def moe(s) -> dict:
    import jax
    import numpy as np

    from jaxrl_llm.models import decoder, heads, moe as moe_layer

    base = s.moe_cfg
    tokens = np.random.default_rng(3).integers(1, base.vocab_size, (2, 64))
    params32 = decoder.init_params(base.replace(dtype="float32"), jax.random.key(0))
    out, ref = {"auto": moe_layer.dispatch(base)}, None
    for d in ("grouped", "blocked"):  # dense: E / k = 16x the experts' FLOPs
        cfg, r = base.replace(moe_dispatch=d), {}
        r.update(bench_gpu.learner_step(cfg, s.rows, s.seq_len, s.repeats)[0])
        r.update(bench_gpu.decode(cfg, s.sample_rows, s.prompt_len, s.new_tokens, s.repeats))
        logp = np.asarray(heads.sequence_logprobs(params32, cfg.replace(dtype="float32"), tokens)["logp"])
        ref = logp if ref is None else ref
        out[d] = {**r, "logp_max_abs_diff_from_grouped": float(np.abs(logp - ref).max())}
    return out


def two_steps(s) -> dict:
    return {"bitwise_equal": two_steps_equal(s)}


STAGES = [backend, init, vocab, attention, head, decode, logp_gap, learner, determinism, prox_pass, end_to_end, moe]
CHILD_STAGES = [two_steps]  # run by `determinism` in its child process, never by default


def settings(a):
    import jax

    from bench_scale import QWEN25_05B, TINY
    from jaxrl_llm.models.config import ModelConfig

    dev = jax.devices()[0]
    accelerator = dev.platform != "cpu" and not a.dry
    big = accelerator and not a.tiny
    kind = next((k for k in bench_gpu.DEVICES if k.lower() in dev.device_kind.lower()), None) if accelerator else None
    shapes = QWEN25_05B if big else TINY
    sizes = dict(rows=16, seq_len=1024, sample_rows=256, prompt_len=256, new_tokens=256, vocab=152064, steps=20) if big \
        else dict(rows=4, seq_len=64, sample_rows=4, prompt_len=16, new_tokens=16, vocab=4096, steps=2)
    import types

    experts = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768) if big else \
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    moe_cfg = ModelConfig(**{**shapes, "num_layers": 2, "vocab_size": 32768 if big else shapes["vocab_size"]},
                          **experts, model_type="qwen3_moe", norm_topk_prob=True, qk_norm=True, dtype="bfloat16")
    return types.SimpleNamespace(cfg=ModelConfig(**shapes, dtype="bfloat16"), moe_cfg=moe_cfg, accelerator=accelerator,
                                 kind=kind, repeats=a.repeats, **sizes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="the JSON (default: experiments/results/gpu_check_<kind>.json)")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on CPU (the default off an accelerator)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on an accelerator too")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated stage names (default: all)")
    ap.add_argument("--wheels", default="", help="a directory of wheels for what the image lacks")
    a = ap.parse_args()
    installed = bench_gpu.install_missing(a.wheels)
    import jax

    s = settings(a)
    kind = jax.devices()[0].device_kind.lower().replace(" ", "_") if s.accelerator else "cpu_dry"
    path = a.out or os.path.join(HERE, "results", f"gpu_check_{kind}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    res = {"dry": not s.accelerator, "installed_from_wheels": ",".join(installed)}
    if s.accelerator:
        res["device"] = f"{jax.devices()[0].device_kind} · jax {jax.__version__}"
    else:
        import common

        res.update(common.cpu_kind())
    chosen = [f for f in STAGES + CHILD_STAGES if f.__name__ in a.only.split(",")] if a.only else STAGES
    for stage in chosen:
        t = time.perf_counter()
        try:
            res[stage.__name__] = stage(s)
        except Exception as e:
            res[stage.__name__] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
        res[stage.__name__]["stage_s"] = time.perf_counter() - t
        with open(path, "w") as f:  # after every stage: a crash keeps what finished
            json.dump(res, f, indent=1, default=str)
        print(f"{stage.__name__}: {json.dumps(res[stage.__name__], default=str)[:400]}", flush=True)
    import pages

    pages.write_page(path)
    return 0 if not any("error" in res[f.__name__] for f in chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
