"""Local launcher: N processes of the main command on 127.0.0.1, for development and tests.

    python -m jaxrl_llm.launch --processes=2 [--devices_per_process=K] -- --config=configs/default.py ...

Each process gets `--config.distributed.*` (coordinator on a free local port, its index) and
`--config.cpu_devices=K`. Output lines are prefixed with the process index; Ctrl-C is forwarded
to every process; when one exits non-zero (or is killed) the others are ended and the launcher
exits non-zero, naming the process that died first. On a cluster, start the main command once
per host instead (README "Many hosts").
"""

from __future__ import annotations

import argparse
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


def commands(processes: int, devices: int, main_args: list, port: int, module: str = "jaxrl_llm.main") -> list:
    base = [sys.executable, "-u", "-m", module, *main_args,
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            f"--config.distributed.num_processes={processes}", f"--config.cpu_devices={devices}"]
    return [base + [f"--config.distributed.process_id={i}"] for i in range(processes)]


def _pump(i: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{i}] {line}")
        out.flush()


def run(cmds: list, out=sys.stdout) -> int:
    """Run `cmds` concurrently; returns 0 when all succeed, else the first failure's code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for c in cmds]
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
    ap.add_argument("--module", default="jaxrl_llm.main", help=argparse.SUPPRESS)
    args = ap.parse_args(own)
    if args.processes < 1 or args.devices_per_process < 1:
        ap.error("--processes and --devices_per_process must be >= 1")
    return run(commands(args.processes, args.devices_per_process, main_args, free_port(), args.module))


if __name__ == "__main__":
    sys.exit(main())
