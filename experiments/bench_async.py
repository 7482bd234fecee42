"""Trained tokens/s of `async` vs `sync` on the same config and machine (not a test).

    python experiments/bench_async.py [--json out.json] [--repeats 2] [--samplers 1]
                                      [--cpu-devices 2 --sampler-devices 1]

The embedded default (configs/default.py: 2-digit addition, tiny warm-started model, A-3PO,
32 prompts x 8 samples per batch, 4 minibatches); async: `--samplers` sampler threads, queue
of 2, max staleness 4. Both modes start from the same warm-started params; compilation is
excluded (a warm-up run precedes the timed one). Trained tokens are loss-mask tokens.

On a 2-core CPU the tiny model's ops gain nothing from XLA's intra-op threads, and with them
off (XLA_FLAGS=--xla_cpu_multi_thread_eigen=false) the sampler and learner programs each keep
one core busy instead of contending for both; docs/speed.md says how to run both settings.
`--cpu-devices 2 --sampler-devices 1` gives each program a device (core) of its own in both
modes (runtime.sampler_devices: disjoint learner / sampler devices).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from configs import default  # noqa: E402
from jaxrl_llm.run import experiment, xla  # noqa: E402

from common import across_isas, cpu_kind, parse_args, report  # noqa: E402

STEPS = 60


def run(mode, params, samplers, sampler_devices=0):
    c = default.get_config()
    c.runtime.mode, c.runtime.num_samplers, c.runtime.sampler_devices = mode, samplers, sampler_devices
    b = experiment.build(c)
    lrn, orch = b.learner, b.orchestrator
    state = lrn.init(jax.random.key(0), params=params)
    state, _ = orch.run(state, 3)  # compile everything
    t = time.perf_counter()
    state, hist = orch.run(state, STEPS)
    wall = time.perf_counter() - t
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in hist)
    return tokens / wall, float(hist[-1]["runtime/learner_idle"]), hist


def main():
    def extra(ap):
        ap.add_argument("--samplers", type=int, default=1)
        ap.add_argument("--cpu-devices", type=int, default=0, help="CPU devices to expose (0: JAX's default)")
        ap.add_argument("--sampler-devices", type=int, default=0, help="devices of the samplers' own (both modes)")

    args = parse_args(__doc__, extra=extra)
    if across_isas(args):  # each ISA in its own processes
        return
    xla.set_cpu_devices(args.cpu_devices)
    c = default.get_config()
    b = experiment.build(c)
    params = experiment.initial_params(c, None, b.model_cfg, b.task, jax.random.key(c.seed), b.greedy, [])
    best, all_tps = {}, {"sync": [], "async": []}
    for _ in range(args.repeats):  # modes alternate so drifts in machine load hit both
        for mode in ("sync", "async"):
            tps, idle, hist = run(mode, params, args.samplers, args.sampler_devices)
            print(f"{mode:5s} {tps:8.0f} trained tokens/s, learner idle {idle:.2f}")
            all_tps[mode].append(tps)
            if tps > best.get(mode, (0,))[0]:
                best[mode] = (tps, idle, hist)
    res = {
        "sync_trained_tokens_per_s": best["sync"][0],
        "async_trained_tokens_per_s": best["async"][0],
        "async_vs_sync": best["async"][0] / best["sync"][0],
        "async_vs_sync_median": float(np.median(all_tps["async"]) / np.median(all_tps["sync"])),
        "learner_idle_sync": best["sync"][1],
        "learner_idle_async": best["async"][1],
        "async_staleness_mean": float(np.mean([m["staleness/mean"] for m in best["async"][2]])),
        "samplers": args.samplers,
        "devices": len(jax.devices()),
        "sampler_devices": args.sampler_devices,
        "cores": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        **cpu_kind(),
    }
    report(res, args.json)


if __name__ == "__main__":
    main()
