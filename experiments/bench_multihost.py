"""Trained tokens/s of 2 processes x 1 device against 1 process x 2 devices (not a test).

    python experiments/bench_multihost.py [--json out.json] [--repeats 2] [--steps 40] [--mode sync]

The embedded default (configs/default.py) with the same global batch either way: one process
draws 32 prompts per step on a 2-device learner mesh; two processes (jax.distributed over
127.0.0.1, gloo collectives, started by `python -m jaxrl_llm.launch`) draw 16 each on one device
each, so the learner step spans both processes. Tokens/s is the median of the training records
after the first 5 steps (compilation excluded); the runs alternate within every repeat.
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
from common import parse_args, report  # noqa: E402


def tokens_per_s(workdir: str) -> float:
    recs = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    steps = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r and r["step"] > 5]
    return float(np.median(steps))


def run(processes: int, steps: int, mode: str) -> float:
    workdir = tempfile.mkdtemp(prefix=f"bench_mh{processes}_")
    args = ["--config=configs/default.py", f"--workdir={workdir}", f"--config.train.steps={steps}",
            f"--config.train.eval_every={steps}", "--config.train.progress=False", f"--config.runtime.mode={mode}",
            f"--config.runtime.prompts_per_batch={32 // processes}"]
    if processes == 1:
        cmd = [sys.executable, "-m", "jaxrl_llm.main", *args, "--config.cpu_devices=2"]
    else:
        cmd = [sys.executable, "-m", "jaxrl_llm.launch", f"--processes={processes}", "--devices_per_process=1",
               "--", *args]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return tokens_per_s(workdir)


def main():
    args = parse_args(__doc__.split("\n\n")[0], extra=lambda ap: (
        ap.add_argument("--steps", type=int, default=40), ap.add_argument("--mode", default="sync")))
    one, two = [], []
    for _ in range(args.repeats):
        one.append(run(1, args.steps, args.mode))
        two.append(run(2, args.steps, args.mode))
    report({"mode": args.mode, "steps": args.steps, "one_process_2dev_tokens_per_s": one,
            "two_processes_1dev_tokens_per_s": two, "ratio_median": float(np.median(two) / np.median(one)),
            "ratio_best": float(max(two) / max(one))}, args.json)


if __name__ == "__main__":
    main()
