"""Trained tokens/s of 2 processes x 1 device against 1 process x 2 devices (not a test).

    python experiments/bench_multihost.py [--json out.json] [--repeats 2] [--steps 40] [--mode sync]
        [--minibatches 4] [--cpu_batch_scheduling 1] [--cpu_bind 1]

The embedded default (configs/default.py) with the same global batch either way: one process
draws 32 prompts per step on a 2-device learner mesh; two processes (jax.distributed over
127.0.0.1, gloo collectives, started by `python -m jaxrl_llm.launch`) draw 16 each on one device
each, so the learner step spans both processes (under SCHED_BATCH unless
`--cpu_batch_scheduling 0`: `distributed.batch_scheduling`; each bound to its own core by the
launcher unless `--cpu_bind 0`: `launch.core_sets`). Two figures per run, both over the steps after
the 5th (compilation excluded): `learner` = median over steps of trained tokens / learner step
time, and `trained` = all trained (loss-mask) tokens / wall-clock time, sampling included. The
runs alternate within every repeat.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_kind, parse_args, report  # noqa: E402


def tokens_per_s(workdir: str) -> tuple:
    """(learner-step tokens/s, end-to-end trained tokens/s) after step 5."""
    recs = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    steps = sorted((r for r in recs if "tokens_per_s" in r), key=lambda r: r["step"])
    start = next(r for r in steps if r["step"] == 5)
    later = [r for r in steps if r["step"] > 5]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in later)
    return float(np.median([r["tokens_per_s"] for r in later])), tokens / (later[-1]["time_s"] - start["time_s"])


def run(processes: int, steps: int, mode: str, minibatches: int, batch_scheduling: bool, bind: bool) -> tuple:
    workdir = tempfile.mkdtemp(prefix=f"bench_mh{processes}_")
    args = ["--config=configs/default.py", f"--workdir={workdir}", f"--config.train.steps={steps}",
            f"--config.train.eval_every={steps}", "--config.train.progress=False", f"--config.runtime.mode={mode}",
            f"--config.runtime.prompts_per_batch={32 // processes}", f"--config.learner.num_minibatches={minibatches}"]
    if processes == 1:
        cmd = [sys.executable, "-m", "jaxrl_llm.main", *args, "--config.cpu_devices=2"]
    else:
        cmd = [sys.executable, "-m", "jaxrl_llm.launch", f"--processes={processes}", "--devices_per_process=1",
               f"--cpu_bind={bind}", "--", *args, f"--config.distributed.cpu_batch_scheduling={batch_scheduling}"]
    env = dict(os.environ)  # devices come from cpu_devices; other XLA flags (e.g. the ISA) pass through
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return tokens_per_s(workdir)


def main():
    args = parse_args(__doc__.split("\n\n")[0], extra=lambda ap: (
        ap.add_argument("--steps", type=int, default=40), ap.add_argument("--mode", default="sync"),
        ap.add_argument("--minibatches", type=int, default=4, help="learner updates per step (collectives per step)"),
        ap.add_argument("--cpu_batch_scheduling", type=int, default=1, help="0: the 2 processes under the default policy"),
        ap.add_argument("--cpu_bind", type=int, default=1, help="0: the 2 processes share both cores")))
    one, two = [], []
    for _ in range(args.repeats):
        one.append(run(1, args.steps, args.mode, args.minibatches, False, False))
        two.append(run(2, args.steps, args.mode, args.minibatches, bool(args.cpu_batch_scheduling), bool(args.cpu_bind)))
    out = {"mode": args.mode, "steps": args.steps, "minibatches": args.minibatches,
           "cpu_batch_scheduling": bool(args.cpu_batch_scheduling), "cpu_bind": bool(args.cpu_bind), **cpu_kind()}
    for i, name in enumerate(("learner", "trained")):
        a, b = [x[i] for x in one], [x[i] for x in two]
        out.update({f"{name}_tokens_per_s_1proc_2dev": a, f"{name}_tokens_per_s_2proc_1dev": b,
                    f"{name}_ratio_median": float(np.median(b) / np.median(a)),
                    f"{name}_ratio_best": float(max(b) / max(a))})
    report(out, args.json)


if __name__ == "__main__":
    main()
