"""Trained tokens/s of `async` vs `sync` on the same config and machine (not a test).

    python experiments/bench_async.py [--json out.json] [--repeats 1]

Model as in bench_sampler (vocab 512); each batch: 8 prompts x 8 samples, 64 new tokens;
learner: A-3PO, 4 minibatches. Task: reward = fraction of completion tokens equal to a target
token (the embedded tasks arrive with issue #6). Async: one sampler thread feeding a queue of
2, max staleness 4. Compilation is excluded (a warm-up run precedes the timed one).
"""

from __future__ import annotations

import tempfile
import time

import jax
import numpy as np

from jaxrl_llm import learner as L
from jaxrl_llm import models
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.runtime import orchestrator as O

from common import hf_model, parse_args, report  # noqa: E402

STEPS = 8


class TargetTask:
    def prompts(self, rng, n):
        return [rng.integers(1, 512, 24).tolist() for _ in range(n)]

    def reward(self, prompt, completion):
        return float(np.mean(np.asarray(completion) == 7)) if completion else 0.0


def run(mode, params, cfg):
    lc = L.default_config()
    lc.num_minibatches = 4
    lrn = L.Learner(cfg, {"name": "a3po"}, lc)
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=64, num_samples=8, prompt_buckets=(32,)))
    rc = O.default_config()
    rc.mode, rc.prompts_per_batch, rc.max_staleness, rc.queue_size = mode, 8, 4, 2
    orch = O.Orchestrator(lrn, sampler, TargetTask(), rc)
    state = lrn.init(jax.random.key(0), params=params)
    state, _ = orch.run(state, 2)  # compile everything
    t = time.perf_counter()
    state, hist = orch.run(state, STEPS)
    wall = time.perf_counter() - t
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in hist)  # trained (loss-mask) tokens
    return tokens / wall, float(np.mean([m["runtime/learner_idle"] for m in hist])), hist


def main():
    args = parse_args(__doc__)
    with tempfile.TemporaryDirectory() as d:
        hf_model(512, d)
        params, cfg = models.load_params(d)
    best = {}
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            tps, idle, hist = run(mode, params, cfg)
            if tps > best.get(mode, (0,))[0]:
                best[mode] = (tps, idle, hist)
    res = {
        "sync_trained_tokens_per_s": best["sync"][0],
        "async_trained_tokens_per_s": best["async"][0],
        "async_vs_sync": best["async"][0] / best["sync"][0],
        "learner_idle_sync": best["sync"][1],
        "learner_idle_async": best["async"][1],
        "async_staleness_mean": float(np.mean([m["staleness/mean"] for m in best["async"][2]])),
    }
    report(res, args.json)


if __name__ == "__main__":
    main()
