"""Seconds per all-reduce between 2 local processes over gloo, by buffer count and size (not a test).

    python experiments/gloo_latency.py [--calls 200] [--pin]

Why the learner reduces one flat gradient (`minibatches.replica_value_and_grad`): XLA:CPU's collectives
run one gloo call per buffer of a combined (tuple) all-reduce, so many small tensors cost a
round trip each where one buffer of the same total size costs about one.

Each case runs twice: under the default scheduling policy and under SCHED_BATCH, which
`jaxrl_llm.parallel.distributed` sets on CPU (`batch_scheduling`: gloo's I/O thread otherwise preempts
the sending thread and spins until the next scheduler tick). `--pin` puts each process on a core
of its own (`taskset`), where that stall hits about every call.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CASES = ((1, 1), (1, 30), (3000, 30), (90000, 1))  # (floats per buffer, buffers)


def worker(pid: int, port: str, calls: int, batch: bool) -> None:
    if batch:
        from jaxrl_llm.parallel import distributed

        distributed.batch_scheduling()
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    for n, k in CASES:
        xs = [jax.make_array_from_process_local_data(rows, np.ones((1, n), np.float32)) for _ in range(k)]
        f = jax.jit(lambda xs: [x.sum(0) for x in xs], out_shardings=rep)  # k buffers, one combined all-reduce
        jax.block_until_ready(f(xs))
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            jax.block_until_ready(f(xs))
            ts.append(time.perf_counter() - t)
        if pid == 0:
            policy = "SCHED_BATCH" if batch else "default    "
            print(f"{policy} {k:3d} buffer(s) x {n:6d} floats: mean {np.mean(ts) * 1e6:6.0f} us, "
                  f"median {np.median(ts) * 1e6:6.0f} us per call", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--pin", action="store_true", help="each process on a core of its own")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(int(args.worker[0]), args.worker[1], args.calls, args.worker[2] == "1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jaxrl_llm.parallel.launch import free_port

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cores = sorted(os.sched_getaffinity(0))
    for batch in ("0", "1"):
        port = str(free_port())
        procs = [subprocess.Popen((["taskset", "-c", str(cores[i % len(cores)])] if args.pin else [])
                                  + [sys.executable, __file__, "--worker", str(i), port, batch, "--calls",
                                     str(args.calls)], env=env, stderr=subprocess.DEVNULL) for i in range(2)]
        if max(p.wait() for p in procs):
            sys.exit(1)


if __name__ == "__main__":
    main()
