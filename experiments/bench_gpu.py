"""Ready for the first accelerator: the checks a GPU run needs, in one command (not a test).

    python experiments/bench_gpu.py [--json experiments/results/bench_gpu.json] [--wheels DIR]
    python experiments/bench_gpu.py --dry [--tiny]      # what CPU can check (a test runs this)

On a GPU, at Qwen2.5-0.5B shapes (random weights, nothing downloaded):
  * attention parity: `jax.nn.dot_product_attention` with cuDNN (`implementation="cudnn"`) and
    with the platform's default, each against the einsum path (`models.attention`), bf16, on
    the masks the learner uses (left padding + causal); the max abs difference and each one's time;
  * a bf16 learner step (PPO on GRPO advantages, AdamW, packing off): trained tokens/s and MFU
    (6 x matmul FLOPs per token + attention, over the device's dense bf16 peak);
  * decode: generated tokens/s of the static sampler against the HBM roofline (each decode
    step reads the bf16 weights once plus every row's KV cache);
  * the memory plan (`jaxrl_llm/run/memory.py`) of that learner step and sampler call against the
    device's `bytes_limit`, and the compiled programs' own peaks.
`--dry` (the default off an accelerator) runs the same code at tiny shapes on CPU — parity of
XLA's kernel with the einsums, one learner step, one decode call — and the 0.5B plan against
host RAM; no MFU or roofline figure is reported there.

A GPU image may lack this project's pure-Python dependencies (ml_collections) and have no
package registry: `--wheels DIR` installs what is missing from local wheels first
(`pip download ml-collections -d DIR` on a machine with one).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_scale import QWEN25_05B, TINY, compiled_peak  # noqa: E402  (the shapes bench_scale measures)

# Dense bf16 FLOP/s and HBM bytes/s by device kind (vendor data sheets; SXM parts).
DEVICES = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.04e12),
           "L4": (121e12, 0.3e12), "TPU v5 lite": (197e12, 0.82e12), "TPU v5p": (459e12, 2.76e12)}
# What the project imports that the lent GPUs' image lacked (2026-11; docs/accelerators.md lists
# the wheels, their dependencies included).
NEEDS = {"ml_collections": "ml-collections", "absl": "absl-py", "crc32c": "crc32c", "fastapi": "fastapi",
         "uvicorn": "uvicorn", "openai": "openai", "tensorboardX": "tensorboardX"}


def install_missing(wheels: str) -> list:
    missing = [pkg for mod, pkg in NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        if not wheels:
            raise SystemExit(f"missing {', '.join(missing)}: pass --wheels DIR with their wheels")
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", wheels, *missing])
    return missing


def best_time(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def parity(cfg, rows: int, length: int, repeats: int, accelerator: bool) -> dict:
    """Each kernel against the einsum path on the learner's mask (left padding + causal)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import attention as attn

    keys = jax.random.split(jax.random.key(0), 3)
    hd, n, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = jax.random.normal(keys[0], (rows, length, n, hd), jnp.bfloat16)
    k = jax.random.normal(keys[1], (rows, kv, hd, length), jnp.bfloat16)  # the cache layout [B, KVH, hd, S]
    v = jax.random.normal(keys[2], (rows, kv, length, hd), jnp.bfloat16)
    pad = jnp.arange(rows)[:, None] * (length // (2 * rows))  # row r has r * L / 2B left-padding tokens
    pos = jnp.arange(length)
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] >= pad[:, :, None])
    mask = mask & (pos[None, :, None] >= pad[:, :, None])
    einsum, dpa = (jax.jit(lambda q, k, v, m, c=cfg.replace(attention=impl): attn.attention(q, k, v, m, c))
                   for impl in ("einsum", "dot_product_attention"))
    want = einsum(q, k, v, mask).astype(jnp.float32)
    valid = mask.any(-1)[..., None, None]  # padding queries' outputs are unused
    diff = lambda got: float(jnp.max(jnp.where(valid, jnp.abs(got.astype(jnp.float32) - want), 0)))
    out = {"attention_shape": f"{rows}x{length}x{n}/{kv}x{hd}", "attention_valid_queries": int(valid.sum()),
           "einsum_vs_float32_reference": diff(_reference(q, k, v, mask)),
           "einsum_ms": best_time(lambda: einsum(q, k, v, mask), repeats) * 1e3,
           "default_kernel_max_abs_diff": diff(dpa(q, k, v, mask)),
           "default_kernel_ms": best_time(lambda: dpa(q, k, v, mask), repeats) * 1e3}
    if accelerator:
        kt, vt = k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3)
        cudnn = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m[:, None],
                                                                        implementation="cudnn"))
        try:
            out["cudnn_max_abs_diff"] = diff(cudnn(q, kt, vt, mask))
            out["cudnn_ms"] = best_time(lambda: cudnn(q, kt, vt, mask), repeats) * 1e3
        except Exception as e:  # recorded: which masks cuDNN takes is what this run is for
            out["cudnn_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return out


def _reference(q, k, v, mask):
    """Attention in float32 from its definition (GQA: query head i reads KV head i // groups)."""
    import jax.numpy as jnp

    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    groups = q.shape[2] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)  # [B, N, hd, S], [B, N, S, hd]
    scores = jnp.einsum("btnd,bnds->bnts", q, k) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jnp.exp(scores - scores.max(-1, keepdims=True))
    probs = jnp.where(mask[:, None], probs, 0) / jnp.where(mask[:, None], probs, 0).sum(-1, keepdims=True)
    return jnp.einsum("bnts,bnsd->btnd", jnp.nan_to_num(probs), v)


def learner_config():
    """The measured learner's settings: one minibatch, no packing."""
    from jaxrl_llm.learner import learner as L

    c = L.default_config()
    c.lr, c.num_minibatches, c.packing = 1e-5, 1, "off"
    return c


def learner_step(cfg, rows: int, seq_len: int, repeats: int) -> tuple:
    import jax

    from jaxrl_llm.learner import learner as L
    from jaxrl_llm import testing
    from jaxrl_llm.parallel import sharding

    c = learner_config()
    lrn = L.Learner(cfg, {"name": "ppo"}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    state = lrn.init(jax.random.key(0))
    batch = jax.block_until_ready(testing.model_batch(state.params, cfg, num_prompts=max(1, rows // 2), group_size=2,
                                                      length=seq_len, prompt=seq_len // 4, topk=0, version=1,
                                                      max_staleness=0))
    holder = [state]

    def step():
        holder[0], _ = lrn.train_step(holder[0], batch)
        return holder[0].params

    t = best_time(step, repeats)
    peak = compiled_peak(lrn.lower_step(holder[0], batch).compile())
    return {"learner_tokens_per_s": rows * seq_len / t, "learner_step_s": t,
            "learner_compiled_peak_gb": peak / 2**30}, c


def decode(cfg, rows: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.models import decoder
    from jaxrl_llm.rollout import Sampler, SamplerConfig

    params = jax.jit(lambda k: decoder.init_params(cfg.replace(param_dtype=cfg.dtype), k))(jax.random.key(0))
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=new_tokens, num_samples=1, prompt_buckets=(prompt_len,),
                                         cache_dtype=cfg.dtype, eos_token_id=None, capture_topk=0))
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (rows, prompt_len)).tolist()
    out = {}
    t = best_time(lambda: out.setdefault("b", sampler.generate(params, prompts, jax.random.key(1))).tokens, repeats)
    generated = float(jnp.sum(out["b"].loss_mask))
    peak = compiled_peak(sampler.lower_generate(params, prompts, jax.random.key(2)).compile())
    return {"decode_tokens_per_s": generated / t, "decode_call_s": t, "sampler_compiled_peak_gb": peak / 2**30}


def roofline(cfg, rows: int, prompt_len: int, new_tokens: int, hbm: float) -> float:
    """Decode tokens/s if every step only read the bf16 weights once and each row's KV cache
    (mean context over the generation) at `hbm` bytes/s."""
    weights = 2 * cfg.num_params
    kv_per_token = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # k and v, bf16
    step_bytes = weights + rows * kv_per_token * (prompt_len + new_tokens / 2)
    return rows * hbm / step_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true", help="CPU checks only (the default off an accelerator)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes for every measured part (the test)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--sample_rows", type=int, default=64)
    ap.add_argument("--prompt_len", type=int, default=256)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wheels", default="", help="a directory of wheels for what the image lacks")
    a = ap.parse_args()
    installed = install_missing(a.wheels)

    import jax

    from jaxrl_llm.run import memory
    from jaxrl_llm.models.config import ModelConfig

    dev = jax.devices()[0]
    accelerator = dev.platform != "cpu" and not a.dry
    kind = next((k for k in DEVICES if k.lower() in dev.device_kind.lower()), None)
    big = ModelConfig(**QWEN25_05B, dtype="bfloat16")
    cfg = big if accelerator and not a.tiny else ModelConfig(**TINY, dtype="bfloat16")
    rows, seq, srows, plen, new = ((a.rows, a.seq_len, a.sample_rows, a.prompt_len, a.new_tokens) if cfg is big
                                   else (4, 64, 4, 16, 16))
    res = {"device": dev.device_kind, "platform": dev.platform, "dry": not accelerator, "jax": jax.__version__,
           "installed_from_wheels": ",".join(installed), "model": "Qwen2.5-0.5B-shaped" if cfg is big else "tiny"}
    if dev.platform == "cpu":
        import common

        res.update(common.cpu_kind())
    res.update(parity(cfg, min(rows, 4), seq, a.repeats, accelerator))
    part, lc = learner_step(cfg, rows, seq, a.repeats)
    res.update(part)
    res.update(decode(cfg, srows, plen, new, a.repeats))
    # The plan at 0.5B shapes, against what the device (or the host, dry) offers.
    plan = memory.total(memory.learner(big, a.rows, a.seq_len, 1, lc.logprob_chunk))
    plan_s = memory.total(memory.sampler(big, a.sample_rows, a.prompt_len, a.new_tokens, "bfloat16", "bfloat16"))
    limit = (dev.memory_stats() or {}).get("bytes_limit") if accelerator else memory.available()[0]
    res.update(plan_learner_gb=plan / 2**30, plan_sampler_gb=plan_s / 2**30, bytes_limit_gb=limit / 2**30,
               plan_fits=bool(plan + plan_s <= limit))
    if accelerator and kind and cfg is big:
        from common import flops_per_token

        peak_flops, hbm = DEVICES[kind]
        flops = 3 * flops_per_token(cfg, seq / 2)  # forward + backward (2x) per trained token
        res.update(learner_mfu=res["learner_tokens_per_s"] * flops / peak_flops, peak_bf16_flops=peak_flops,
                   decode_roofline_tokens_per_s=roofline(cfg, srows, plen, new, hbm), hbm_bytes_per_s=hbm)
        res["decode_fraction_of_roofline"] = res["decode_tokens_per_s"] / res["decode_roofline_tokens_per_s"]
    import common

    common.report(res, a.json)


if __name__ == "__main__":
    main()
