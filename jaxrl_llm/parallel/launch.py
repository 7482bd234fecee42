"""Local launcher: N processes of the main command on 127.0.0.1, for development and tests.

    python -m jaxrl_llm.launch --processes=2 [--devices_per_process=K] -- --config=configs/default.py ...

Each process gets `--config.distributed.*` (coordinator on a free local port, its index) and
`--config.cpu_devices=K`; on a GPU / TPU host also its own K accelerators
(`--config.distributed.local_device_ids`: process i the i-th block of K), so no two processes
preallocate memory on the same device. Output lines are prefixed with the process index; Ctrl-C
is forwarded to every process; when one exits non-zero (or is killed) the others are ended and the launcher
exits non-zero, naming the process that died first; when the launcher itself is killed (-9), so
are they (`PR_SET_PDEATHSIG` on Linux): no orphan goes on writing the run's checkpoints. Each
process is bound to its own equal share of the launcher's cores (`core_sets`; `--cpu_bind=False`
leaves them shared), as a host has its own. On a cluster, start the main command once per host
instead (docs/many_hosts.md).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 20  # after the first failure, how long the others get to exit before SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(processes: int, devices: int, main_args: list, port: int, module: str = "jaxrl_llm.main",
             accelerator: bool = False) -> list:
    base = [sys.executable, "-u", "-m", module, *main_args,
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            f"--config.distributed.num_processes={processes}", f"--config.cpu_devices={devices}"]
    own = lambda i: ([f"--config.distributed.local_device_ids={','.join(str(i * devices + d) for d in range(devices))}"]
                     if accelerator else [])  # noqa: E731
    return [base + [f"--config.distributed.process_id={i}"] + own(i) for i in range(processes)]


def core_sets(processes: int, cores=None):
    """Disjoint, equal, contiguous blocks of `cores` (default: this process's affinity), one per
    process; None when there are fewer cores than processes. Processes sharing cores run their
    compute threads against each other's and every collective waits for the slower one
    (`experiments/bench_multihost.py` measures both). Open MPI's mpirun binds its processes to
    cores by default too."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if processes > len(cores):
        return None
    k = len(cores) // processes
    return [set(cores[i * k:(i + 1) * k]) for i in range(processes)]


PR_SET_PDEATHSIG = 1  # linux/prctl.h
# looked up at import, before any fork: no dynamic loading in a child forked from a process with threads
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def _child_setup(cores, parent: int) -> None:
    """In each child before it runs (`preexec_fn`): its cores, and SIGKILL once the launcher dies,
    unless that happened already (then its parent is no longer `parent`)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)


def _pump(i: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{i}] {line}")
        out.flush()


def run(cmds: list, out=sys.stdout, cores=None) -> int:
    """Run `cmds` concurrently (command i on the cores `cores[i]`, when given); returns 0 when
    all succeed, else the first failure's code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    me = os.getpid()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              preexec_fn=lambda i=i: _child_setup(None if cores is None else cores[i], me))
             for i, c in enumerate(cmds)]
    pumps = [threading.Thread(target=_pump, args=(i, p.stdout, out), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    signalled = []

    def forward(sig, _frame):  # Ctrl-C / preemption: every process saves and exits by itself
        signalled.append(sig)
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = None
        while failed is None:
            codes = [p.poll() for p in procs]  # poll every process: returncode is set by poll()
            if not signalled:
                failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if all(c is not None for c in codes):
                failed = failed or next(((i, c) for i, c in enumerate(codes) if c != 0), None)
                break
            time.sleep(0.2)
        if failed and not signalled:
            _end(procs)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for t in pumps:
            t.join(timeout=5)
    if failed:
        i, code = failed
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        if signalled:  # the processes' own exit code (130 / 143: saved, resumable)
            out.write(f"launch: stopped by {signal.Signals(signalled[0]).name} ({how} from process {i})\n")
        else:
            out.write(f"launch: process {i} died first ({how}); ended the others\n")
        return code if code > 0 else 1
    return 0


def _end(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, main_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m jaxrl_llm.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, required=True)
    ap.add_argument("--devices_per_process", type=int, default=1)
    ap.add_argument("--cpu_bind", type=lambda v: v.lower() in ("1", "true", "yes"), default=True,
                    help="bind each process to its own share of the cores (default True; off when too few)")
    ap.add_argument("--module", default="jaxrl_llm.main", help=argparse.SUPPRESS)
    args = ap.parse_args(own)
    if args.processes < 1 or args.devices_per_process < 1:
        ap.error("--processes and --devices_per_process must be >= 1")
    cores = core_sets(args.processes) if args.cpu_bind else None
    from jaxrl_llm.parallel import distributed

    accelerator = not distributed.on_cpu()
    return run(commands(args.processes, args.devices_per_process, main_args, free_port(), args.module, accelerator),
               cores=cores)
