"""Sampler throughput vs Hugging Face `generate` on the same random-init model (not a test).

    python experiments/bench_sampler.py [--json out.json] [--repeats 3] [--devices N]

Model: Qwen2 architecture, 4 layers, hidden 256, 8 query / 2 KV heads, MLP 1024, vocab 512 and
a 32k-vocab variant. Workload: B = 64 prompts of 32 tokens, 96 new tokens each (no EOS), T = 1,
our top-k capture K = 8. PyTorch uses every core. Prints tokens/s of both, their ratio, our
fraction of the measured float32 matmul peak, and the cost of top-k capture at vocab 32k.
Ours and transformers take turns within every repeat (best of `--repeats` each), so drifts in
machine speed, large on shared CPUs, hit both alike.

On CPU, JAX is given one device per core (`--devices`, default os.cpu_count()) and our sampler
splits the rows over them (`Sampler(mesh=...)`, data parallel, as it would over GPUs; each
device decodes its own rows, and the replicas share one host copy of the weights): the decode
GEMMs (64 x 256 x 1024) are too small for XLA to spread over cores within one op.
The one-device figure is reported too (`ours_tokens_per_s_1dev`).

Heavy tail (`--cases heavy`): 512 rows (an RL batch of 64 prompts x 8 samples) whose
completion lengths are drawn log-normal (median 64, sigma 1, capped at 512) and imposed as
per-row budgets (`generate(limits=...)`), so the case does not depend on a trained model's EOS.
Static batching decodes them as batches of 32 rows, each until its longest row ends;
continuous batching through 32 slots refilled every `decode_segment` = 32 steps. Reported:
`continuous_vs_static_heavy_tail`, the ratio of useful (generated, non-padding) tokens per
second, median and range over repeats that take turns, and the slot occupancy of both (useful
tokens / slot-steps run). The same with 128 rows (`..._128rows`): the last rows' drain, when
few slots are still busy, weighs more in a short run.

Multi-turn (`--cases multiturn`): 128 episodes of up to 3 model turns on one device. A turn ends
when the model draws one of 8 stop ids (1/64 of the random model's vocabulary: geometric turn
lengths, mean ~64); a tool then answers with 4 observation tokens after a latency drawn
log-normal (median 0.3 s, sigma 1: a sandboxed code run or a search call; fixed per row and
turn), and the third answer ends the episode (budget 384 tokens). Static batching runs batches of 32 rows, a waiting row holding its
slot; continuous batching runs every row through 32 slots, a waiting row parked and its slot
refilled. Reported: `multiturn_continuous_vs_static` (drawn tokens/s ratio, median over
repeats), both rates, and both slot occupancies (drawn tokens / slot-steps run); the same with
a 50 ms median (`..._50ms`), shorter than one decode segment here, so both wait for a segment
boundary anyway and the gain is the refill of slots whose rows still wait. At 0.3 s also
`sampler.turn_cache="recompute"` (parked caches dropped, rebuilt on resume):
`multiturn_recompute_vs_keep` (its tokens/s over keeping them), the rebuilt log-probs' gap to the
recorded ones, and the cache bytes a parked row would otherwise hold.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import Future

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm import models
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.rollout.turns import Turns
from jaxrl_llm.tasks.envs import Reply

from common import across_isas, cpu_kind, flops_per_token, hf_model, matmul_peak_flops, parse_args, report  # noqa: E402  (experiments/ is on sys.path when run as a script)

B, PROMPT, NEW, K = 64, 32, 96, 8
SLOTS, HEAVY_MAX, SEG = 32, 512, 32
TURN_STOPS, TURNS, EPISODE_MAX, LATENCY_S = tuple(range(1, 9)), 3, 384, 0.3


def ours(params, cfg, topk: int, devices=None):
    """One timed run of our sampler (compiled here): rows split over `devices` (default: all)."""
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, PROMPT)).tolist()
    mesh = Mesh(np.asarray(devices or jax.devices()), ("data",))
    s = Sampler(cfg, SamplerConfig(max_new_tokens=NEW, temperature=1.0, capture_topk=topk,
                                   prompt_buckets=(PROMPT,), eos_token_id=None, num_samples=1), mesh=mesh)
    keys = iter(range(1 << 30))
    run = lambda: jax.block_until_ready(s.generate(params, prompts, jax.random.key(next(keys))).tokens)
    run()  # compile
    return run


def hf(model, vocab: int):
    """One timed run of transformers `generate` (sampling, T = 1, exactly NEW tokens), all cores."""
    import torch

    torch.set_num_threads(os.cpu_count())
    prompts = torch.randint(0, vocab, (B, PROMPT))
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0, eos_token_id=None)

    def run():
        with torch.no_grad():
            model.generate(prompts, **kw)

    run()  # warm-up
    return run


def tokens_per_s(runs: dict, repeats: int) -> dict:
    """Best-of-`repeats` tokens/s of each run; all runs take turns within every repeat, so drifts
    in machine speed (large on shared CPUs) hit ours and the peer alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: B * NEW / t for name, t in best.items()}


def heavy_tail(params, cfg, repeats: int, rows: int) -> dict:
    """Static vs continuous batching on log-normal completion lengths at the same slot count."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (rows, PROMPT)).tolist()
    lengths = np.clip(np.round(rng.lognormal(np.log(64), 1.0, rows)), 1, HEAVY_MAX).astype(np.int32)
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    make = lambda batching: Sampler(cfg, SamplerConfig(
        max_new_tokens=HEAVY_MAX, temperature=1.0, capture_topk=K, prompt_buckets=(PROMPT,), decode_segment=SEG,
        batching=batching, slots=SLOTS, num_samples=1), mesh=mesh)
    static, continuous = make("static"), make("continuous")

    def run_static():
        for i in range(0, rows, SLOTS):
            jax.block_until_ready(static.generate(params, prompts[i:i + SLOTS], jax.random.key(i),
                                                  limits=lengths[i:i + SLOTS]).tokens)

    def run_continuous():
        jax.block_until_ready(continuous.generate(params, prompts, jax.random.key(0), limits=lengths).tokens)

    runs = {"static": run_static, "continuous": run_continuous}
    for run in runs.values():
        run()  # compile
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    ratios = np.array(times["static"]) / np.array(times["continuous"])  # same useful tokens in both
    useful = int(lengths.sum())
    static_steps = sum(int(lengths[i:i + SLOTS].max()) for i in range(0, rows, SLOTS))
    return dict(continuous_vs_static_heavy_tail=float(np.median(ratios)),
                continuous_vs_static_heavy_tail_min=float(ratios.min()),
                continuous_vs_static_heavy_tail_max=float(ratios.max()),
                heavy_tail_static_tokens_per_s=useful / float(np.median(times["static"])),
                heavy_tail_continuous_tokens_per_s=useful / float(np.median(times["continuous"])),
                heavy_tail_static_occupancy=useful / (SLOTS * static_steps),
                heavy_tail_continuous_occupancy=float(continuous.slots(SLOTS).occupancy[-1]),
                heavy_tail_mean_length=float(lengths.mean()), heavy_tail_max_length=int(lengths.max()))


class ToolLatency:
    """An environment whose every answer (4 tokens) comes after a log-normal latency, fixed per
    (row, turn); the `TURNS`-th answer ends the episode."""

    def __init__(self, seed: int = 0, latency_s: float = LATENCY_S):
        self.seed, self.latency_s, self.calls = seed, latency_s, 0

    def respond(self, row, tokens, obs) -> Future:
        turn = 1 + int(np.sum(np.diff(np.concatenate([[0], np.asarray(obs, np.int8)])) == 1))
        latency = float(np.random.default_rng([self.seed, int(row), turn]).lognormal(np.log(self.latency_s), 1.0))
        f: Future = Future()
        timer = threading.Timer(latency, f.set_result, [Reply(obs_ids=(20, 21, 22, 23), done=turn >= TURNS)])
        timer.daemon = True
        timer.start()
        self.calls += 1
        return f


def multiturn(params, cfg, repeats: int, rows: int = 128, latency_s: float = LATENCY_S, recompute: bool = False) -> dict:
    """Static (a waiting row holds its slot) vs continuous (it frees it) on tool-latency episodes;
    with `recompute`, also continuous with parked caches dropped and rebuilt on resume."""
    prompts = np.random.default_rng(1).integers(30, cfg.vocab_size, (rows, PROMPT)).tolist()
    make = lambda batching, cache="keep": Sampler(cfg, SamplerConfig(
        max_new_tokens=EPISODE_MAX, temperature=1.0, capture_topk=K, prompt_buckets=(PROMPT,), decode_segment=SEG,
        batching=batching, slots=SLOTS, num_samples=1, turn_stop_ids=TURN_STOPS, turn_cache=cache))
    static, continuous, rebuilt = make("static"), make("continuous"), make("continuous", "recompute")

    def drawn(batch):
        return int(np.asarray(batch.loss_mask).sum())

    def run_static():
        return sum(drawn(static.generate(params, prompts[i:i + SLOTS], jax.random.key(i),
                                         turns=Turns(ToolLatency(i, latency_s).respond))) for i in range(0, rows, SLOTS))

    def run_continuous():
        return drawn(continuous.generate(params, prompts, jax.random.key(0),
                                         turns=Turns(ToolLatency(0, latency_s).respond)))

    def run_recompute():
        return drawn(rebuilt.generate(params, prompts, jax.random.key(0),
                                      turns=Turns(ToolLatency(0, latency_s).respond)))

    runs = {"static": run_static, "continuous": run_continuous, **({"recompute": run_recompute} if recompute else {})}
    for _ in range(2):  # compile: slot fills and attention widths vary from run to run at first
        for run in runs.values():
            run()
    rates = {name: [] for name in runs}
    occupancy = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            engines = {"continuous": [continuous.slots(SLOTS)], "recompute": [rebuilt.slots(SLOTS)]}.get(
                name, list(static._static_slots.values()))
            before = [len(e.occupancy) for e in engines]
            t = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - t))
            occupancy[name].append(np.mean([o for e, b in zip(engines, before) for o in e.occupancy[b:]]))
    ratios = np.array(rates["continuous"]) / np.array(rates["static"])
    extra = {}
    if recompute:  # the cost of rebuilding against keeping a parked row's cache, and its log-prob gap
        r = rebuilt.reprefill
        cache_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (PROMPT + EPISODE_MAX) * 4
        extra = dict(multiturn_recompute_vs_keep=float(np.median(np.array(rates["recompute"])
                                                                 / np.array(rates["continuous"]))),
                     multiturn_recompute_tokens_per_s=float(np.median(rates["recompute"])),
                     multiturn_recompute_logp_gap_mean=r["abs_sum"] / max(r["tokens"], 1),
                     multiturn_recompute_logp_gap_max=r["abs_max"],
                     multiturn_parked_cache_bytes_per_row=cache_bytes)
    return dict(**extra,multiturn_continuous_vs_static=float(np.median(ratios)),
                multiturn_continuous_vs_static_min=float(ratios.min()),
                multiturn_continuous_vs_static_max=float(ratios.max()),
                multiturn_static_tokens_per_s=float(np.median(rates["static"])),
                multiturn_continuous_tokens_per_s=float(np.median(rates["continuous"])),
                multiturn_static_occupancy=float(np.median(occupancy["static"])),
                multiturn_continuous_occupancy=float(np.median(occupancy["continuous"])),
                multiturn_tool_latency_median_s=latency_s)


def main():
    args = parse_args(__doc__, extra=lambda ap: (
        ap.add_argument("--devices", type=int, default=os.cpu_count(),
                        help="CPU devices JAX exposes (one per core by default)"),
        ap.add_argument("--cases", default="even,v32k,heavy,multiturn",
                        help="comma-separated subset of even,v32k,heavy,multiturn")))
    if across_isas(args):  # each ISA in its own processes
        return
    cases = set(args.cases.split(","))
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts; GPUs unaffected
    peak = matmul_peak_flops()
    res = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "matmul_peak_gflops": peak / 1e9,
           **cpu_kind()}
    if "heavy" in cases:
        with tempfile.TemporaryDirectory() as d:
            hf_model(512, d)
            params, cfg = models.load_params(d)
            res.update(heavy_tail(params, cfg, args.repeats, 512))
            res.update({f"{k}_128rows": v for k, v in heavy_tail(params, cfg, args.repeats, 128).items()
                        if k.startswith("continuous_vs") or k.endswith("occupancy")})
    if "multiturn" in cases:
        with tempfile.TemporaryDirectory() as d:
            hf_model(512, d)
            params, cfg = models.load_params(d)
            res.update(multiturn(params, cfg, args.repeats, recompute=True))
            res.update({f"{k}_50ms": v for k, v in multiturn(params, cfg, args.repeats, latency_s=0.05).items()})
    if "even" in cases:
        with tempfile.TemporaryDirectory() as d:
            model = hf_model(512, d)
            params, cfg = models.load_params(d)
            r = tokens_per_s({"ours": ours(params, cfg, K), "ours_1dev": ours(params, cfg, K, jax.devices()[:1]),
                              "hf": hf(model, 512)}, args.repeats)
        res.update(ours_tokens_per_s=r["ours"], ours_tokens_per_s_1dev=r["ours_1dev"], hf_tokens_per_s=r["hf"],
                   ratio_vs_hf=r["ours"] / r["hf"], ratio_vs_hf_1dev=r["ours_1dev"] / r["hf"],
                   peak_fraction=r["ours"] * flops_per_token(cfg, PROMPT + NEW / 2) / peak,
                   hf_peak_fraction=r["hf"] * flops_per_token(cfg, PROMPT + NEW / 2) / peak)
    if "v32k" in cases:
        with tempfile.TemporaryDirectory() as d:
            model = hf_model(32768, d)
            params, cfg = models.load_params(d)
            r = tokens_per_s({"k": ours(params, cfg, K), "no_k": ours(params, cfg, 0), "hf": hf(model, 32768)},
                             args.repeats)
        res.update(ours_tokens_per_s_v32k=r["k"], ours_tokens_per_s_v32k_no_topk=r["no_k"],
                   hf_tokens_per_s_v32k=r["hf"], ratio_vs_hf_v32k=r["k"] / r["hf"],
                   topk_cost_fraction_v32k=1.0 - r["k"] / r["no_k"])
    report(res, args.json)


if __name__ == "__main__":
    main()
