"""Sampler throughput vs Hugging Face `generate` on the same random-init model (not a test).

    python experiments/bench_sampler.py [--json out.json] [--repeats 3] [--devices N]

Model: Qwen2 architecture, 4 layers, hidden 256, 8 query / 2 KV heads, MLP 1024, vocab 512 and
a 32k-vocab variant. Workload: B = 64 prompts of 32 tokens, 96 new tokens each (no EOS), T = 1,
our top-k capture K = 8. PyTorch uses every core. Prints tokens/s of both, their ratio, our
fraction of the measured float32 matmul peak, and the cost of top-k capture at vocab 32k.

On CPU, JAX is given one device per core (`--devices`, default os.cpu_count()) and our sampler
splits the rows over them (`Sampler(mesh=...)`, data parallel, as it would over GPUs): the
decode GEMMs (64 x 256 x 1024) are too small for XLA to spread over cores within one op.
The one-device figure is reported too (`ours_tokens_per_s_1dev`).
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm import models
from jaxrl_llm.rollout import Sampler, SamplerConfig

from common import flops_per_token, hf_model, matmul_peak_flops, parse_args, report  # noqa: E402  (experiments/ is on sys.path when run as a script)

B, PROMPT, NEW, K = 64, 32, 96, 8


def time_ours(params, cfg, variants, repeats: int) -> list:
    """tokens/s (best of `repeats`) for each (top-k K, devices) variant; the variants run in
    turn within every repeat, so drifts in machine speed hit them alike."""
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, PROMPT)).tolist()
    samplers = []
    for topk, devices in variants:
        mesh = Mesh(np.asarray(devices or jax.devices()), ("data",))
        s = Sampler(cfg, SamplerConfig(max_new_tokens=NEW, temperature=1.0, capture_topk=topk,
                                       prompt_buckets=(PROMPT,), eos_token_id=None), mesh=mesh)
        jax.block_until_ready(s.generate(params, prompts, jax.random.key(0)).tokens)  # compile
        samplers.append(s)
    best = [float("inf")] * len(samplers)
    for r in range(repeats):
        for i, s in enumerate(samplers):
            t = time.perf_counter()
            jax.block_until_ready(s.generate(params, prompts, jax.random.key(r + 1)).tokens)
            best[i] = min(best[i], time.perf_counter() - t)
    return [B * NEW / t for t in best]


def time_hf(model, vocab: int, repeats: int) -> float:
    import torch

    torch.set_num_threads(os.cpu_count())
    prompts = torch.randint(0, vocab, (B, PROMPT))
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(prompts, **kw)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(prompts, **kw)
            best = min(best, time.perf_counter() - t)
    return B * NEW / best


def main():
    args = parse_args(__doc__, extra=lambda ap: ap.add_argument(
        "--devices", type=int, default=os.cpu_count(), help="CPU devices JAX exposes (one per core by default)"))
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts; GPUs unaffected
    peak = matmul_peak_flops()
    res = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "matmul_peak_gflops": peak / 1e9}
    with tempfile.TemporaryDirectory() as d:
        hf = hf_model(512, d)
        params, cfg = models.load_params(d)
        ours, ours_1dev = time_ours(params, cfg, [(K, None), (K, jax.devices()[:1])], args.repeats)
        theirs = time_hf(hf, 512, args.repeats)
    res.update(ours_tokens_per_s=ours, ours_tokens_per_s_1dev=ours_1dev, hf_tokens_per_s=theirs,
               ratio_vs_hf=ours / theirs, ratio_vs_hf_1dev=ours_1dev / theirs,
               peak_fraction=ours * flops_per_token(cfg, PROMPT + NEW / 2) / peak,
               hf_peak_fraction=theirs * flops_per_token(cfg, PROMPT + NEW / 2) / peak)
    with tempfile.TemporaryDirectory() as d:
        hf = hf_model(32768, d)
        params, cfg = models.load_params(d)
        with_k, without_k = time_ours(params, cfg, [(K, None), (0, None)], args.repeats)
        theirs = time_hf(hf, 32768, args.repeats)
    res.update(ours_tokens_per_s_v32k=with_k, ours_tokens_per_s_v32k_no_topk=without_k,
               hf_tokens_per_s_v32k=theirs, ratio_vs_hf_v32k=with_k / theirs,
               topk_cost_fraction_v32k=1.0 - with_k / without_k)
    report(res, args.json)


if __name__ == "__main__":
    main()
