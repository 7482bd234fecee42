"""Sampler nodes over a real network stack (loopback): weight transfer, training with a node
against local sampler threads, and staleness behind an injected delay (not a test).

    python experiments/bench_remote.py [--json experiments/results/bench_remote_cpu.json] [--parts transfer,train,delay,adversary]

(a) transfer: a Qwen2.5-0.5B-shaped bf16 sampler copy (about 1 GB) served by the learner's
    service (`remote/service.py`, Arrow Flight) and fetched by the node's client in parallel
    chunk streams with every SHA-256 checked, against a raw TCP socket copy of the same bytes
    between the same two processes, measured in the same run: `transfer_vs_loopback`.
(b) train: the embedded default config for `--steps` steps, once with one local async sampler
    thread and once as a learner with one sampler-node process, on the same cores, interleaved
    `--repeats` times: trained completion tokens per second after `--skip` steps, and the
    learner's idle share: `remote_vs_local_trained`, `learner_idle_remote`.
(c) delay: one node behind a relay on 127.0.0.1 that holds every forwarded read for `--delays`
    seconds (each way) and caps the bandwidth, with room for `--delay_queue_size` batches in
    flight: the mean staleness the learner trains at, next to what the simulated mode's model
    predicts (staleness = delay / seconds per learner step, on top of the undelayed run's).
(d) adversary: the train part's remote run, clean and beside a second node that misbehaves
    (`--adversaries`): `hoard` leases all it may and heartbeats without ever uploading; `flood`
    uploads a `--flood_mb` group after group under a lease it holds, and comes back under a new
    name each time it is refused; `flood_sink`, the control, floods a service of its own (what
    the flood costs this shared machine without the learner receiving it). The honest node's
    trained tokens per second with each, over the clean run's, interleaved `--repeats` times:
    `remote_adversary_vs_clean` (the worst of hoard and flood; the limit is 1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402

from jaxrl_llm.parallel.launch import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- (a) transfer


def _params_05b():
    """Random bf16 leaves with the shapes of Qwen2.5-0.5B's sampler copy."""
    import jax
    import ml_dtypes

    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.integers(0, 1 << 16, s.shape, np.uint16).view(ml_dtypes.bfloat16), _skeleton())


class _Weights:
    """A handler serving one artifact, as the learner's hub does."""

    def __init__(self, params):
        from jaxrl_llm.remote import wire

        self.art = wire.pack_params(params, 1)

    def manifest(self, req):
        return self.art[0]

    def chunk(self, req):
        c = self.art[0]["chunks"][int(req["chunk"])]
        return memoryview(self.art[1])[c["offset"]:c["offset"] + c["nbytes"]]


def _serve_weights(port_q, stop):
    from jaxrl_llm.remote.service import Service

    svc = Service(_Weights(_params_05b()), "127.0.0.1", 0)
    port_q.put(svc.port)
    stop.wait()
    svc.close()


def _serve_raw(nbytes, port_q, stop):
    buf = np.random.default_rng(1).integers(0, 255, nbytes, np.uint8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port_q.put(s.getsockname()[1])
        s.settimeout(1.0)
        while not stop.is_set():
            try:
                conn, _ = s.accept()
            except socket.timeout:
                continue
            with conn:
                conn.sendall(memoryview(buf))


def _raw_fetch(port, nbytes) -> float:
    out = bytearray(nbytes)
    view = memoryview(out)
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        got = 0
        while got < nbytes:
            got += c.recv_into(view[got:], min(nbytes - got, 1 << 22))
    return time.perf_counter() - t


def transfer(repeats: int) -> dict:
    from jaxrl_llm.remote.client import Client

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve_weights, args=(q, stop), daemon=True)
    server.start()
    client = Client(f"127.0.0.1:{q.get(timeout=600)}")
    manifest = client.call("manifest")
    nbytes = manifest["nbytes"]
    raw = ctx.Process(target=_serve_raw, args=(nbytes, q, stop), daemon=True)
    raw.start()
    raw_port = q.get(timeout=120)
    like = _skeleton()
    flight_s, raw_s = [], []
    for _ in range(repeats):  # interleaved
        t = time.perf_counter()
        client.fetch_weights(manifest, like)
        flight_s.append(time.perf_counter() - t)
        raw_s.append(_raw_fetch(raw_port, nbytes))
    stop.set()
    server.join(30)
    raw.join(30)
    gb = nbytes / 1e9
    return {"transfer_bytes": nbytes, "transfer_chunks": len(manifest["chunks"]),
            "transfer_flight_gbps": gb / min(flight_s), "transfer_raw_socket_gbps": gb / min(raw_s),
            "transfer_vs_loopback": min(raw_s) / min(flight_s)}


def _skeleton():
    """The model's tree of leaves (what a node's `like` provides)."""
    import jax

    from jaxrl_llm import models
    from bench_scale import QWEN25_05B

    return jax.eval_shape(lambda: models.init_params(models.ModelConfig(**QWEN25_05B), jax.random.key(0)))


# ---------------------------------------------------------------------- (b, c) training


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


NODE_ENV = {}  # --node_xla_flags


def _run(mode: str, steps: int, extra=(), node_via=None, adversary=None) -> list:
    """One embedded-default run (`mode` async or remote, with one node, and `adversary` (a kind
    of `_adversary`) beside it); its step records."""
    wd = tempfile.mkdtemp(prefix=f"bench_remote_{mode}_")
    port = free_port()
    cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py", f"--workdir={wd}",
           f"--config.train.steps={steps}", "--config.train.eval_every=100000", "--config.train.save_every=100000",
           "--config.train.progress=False", f"--config.runtime.mode={mode}", f"--config.runtime.remote.port={port}",
           *extra]
    learner = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    node = relay = None
    if mode == "remote":
        target = port
        if node_via is not None:
            relay = Relay(port, *node_via)
            target = relay.port
        node = subprocess.Popen([sys.executable, "-m", "jaxrl_llm.sampler_node", f"--learner=127.0.0.1:{target}",
                                 "--name=n", "--retry_s=0.5"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, **NODE_ENV})
    bad = None
    if adversary is not None:
        bad = mp.get_context("spawn").Process(target=_adversary, args=(adversary, port, FLOOD_MB[0]), daemon=True)
        bad.start()
    try:
        _, err = learner.communicate(timeout=1800)
        if learner.returncode:
            raise RuntimeError(f"{mode} run failed: {err[-2000:]}")
    finally:
        for p in (node, learner):
            if p is not None and p.poll() is None:
                p.kill()
        if bad is not None:
            bad.kill()
        if relay is not None:
            relay.close()
    return _records(wd)


FLOOD_MB = [1024]  # --flood_mb


def _adversary(kind: str, port: int, flood_mb: int) -> None:
    """A node with the token that misbehaves until killed: `hoard` leases all it may and only
    heartbeats; `flood` puts one huge group after another under a lease it holds and, refused for
    it, says hello again under a new name (as often as the learner lets a host)."""
    import pyarrow as pa
    import pyarrow.flight as flight

    import jaxrl_llm
    from jaxrl_llm.remote import wire
    from jaxrl_llm.remote.client import Client

    if kind == "flood_sink":  # the control: the same flood, into a service of its own, not the learner's
        from jaxrl_llm.remote.service import Service

        sink = Service(_Sink(), "127.0.0.1", 0)
        port, kind = sink.port, "flood"
    client = Client(f"127.0.0.1:{port}")
    blob = np.zeros(flood_mb << 20, np.uint8) if kind == "flood" else None
    table = pa.table({"field": ["tokens"], "dtype": ["int32"], "shape": [[(flood_mb << 20) // 4]],
                      "data": pa.array([blob.data if blob is not None else b""], pa.large_binary())})
    for k in itertools.count():  # refused for good, it comes back under a new name
        hello = None
        while hello is None:
            try:
                hello = client.call("hello", protocol=wire.PROTOCOL, package=jaxrl_llm.__version__, name=f"{kind}{k}")
            except flight.FlightUnavailableError:  # not serving yet, or the run ended
                time.sleep(0.2)
            except flight.FlightError:  # too many new sessions: it waits its turn
                time.sleep(1.0)
        s, held = {k: hello[k] for k in ("run_id", "node", "session")}, []  # held: (lease, group) not flooded yet
        try:
            while True:
                for x in client.call("lease", version=hello["version"], count=8, **s)["leases"]:
                    held += [(x["id"], g) for g in x["groups"]]
                client.call("heartbeat", version=hello["version"], **s)
                if kind == "flood" and held:
                    lease, group = held.pop(0)
                    desc = flight.FlightDescriptor.for_command(json.dumps(s).encode())
                    writer, reader = client._flight.do_put(desc, table.schema)
                    writer.write_with_metadata(table.to_batches()[0], pa.py_buffer(json.dumps(
                        {"lease": lease, "group": group}).encode()))
                    writer.done_writing()
                    reader.read()
                    writer.close()
                else:
                    time.sleep(0.2)
        except flight.FlightUnavailableError:  # the run ended
            return
        except flight.FlightError:  # refused: a new identity
            pass


class _Sink:
    """A learner stand-in that leases one group forever and refuses every upload by its size."""

    def hello(self, req):
        return {"run_id": "sink", "node": req["name"], "session": "s", "version": 0}

    def lease(self, req):
        return {"leases": [{"id": 1, "draw": 0, "groups": [0]}]}

    def heartbeat(self, req):
        return {}

    def put_group(self, req):
        from jaxrl_llm.remote import wire

        wire.check_size(req["table"], 1 << 20)


def adversary(steps: int, skip: int, repeats: int, kinds) -> dict:
    runs, seen = {k: [] for k in ("clean", *kinds)}, {}
    for _ in range(repeats):  # interleaved
        for k in runs:
            records = _run("remote", steps, adversary=None if k == "clean" else k)
            runs[k].append(_rates(records, skip))
            # Evidence that the adversary was there: the nodes the learner heard, what it refused.
            seen[f"adversary_{k}_nodes_max"] = max(r["remote/nodes"] for r in records)
            for reason in ("size", "lease"):
                seen[f"adversary_{k}_refused_{reason}"] = records[-1].get(f"remote/rejected/{reason}", 0.0)
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    out = {f"adversary_{k}_trained_tokens_per_s": v for k, v in best.items()}
    out.update(seen)
    out.update({f"adversary_{k}_vs_clean": best[k] / best["clean"] for k in kinds})
    out["remote_adversary_vs_clean"] = min(best[k] / best["clean"] for k in kinds if k != "flood_sink")
    if {"flood", "flood_sink"} <= set(kinds):  # the learner's own share of the flood's cost
        out["adversary_flood_vs_flood_sink"] = best["flood"] / best["flood_sink"]
    out["adversary_flood_mb"] = FLOOD_MB[0]
    return out


def _rows() -> int:
    """Rows per learner step of the default config."""
    sys.path.insert(0, ROOT)
    from configs import default

    c = default.get_config()
    return c.runtime.prompts_per_batch * c.sampler.num_samples


def _rates(records, skip: int) -> dict:
    """Trained completion tokens / s and learner idle over steps skip+1 .. end."""
    a, b = records[skip - 1], records[-1]
    tokens = lambda r: r["runtime/length_trained_mean"] * r["step"] * _rows()  # noqa: E731
    return {"tokens_per_s": (tokens(b) - tokens(a)) / (b["time_s"] - a["time_s"]),
            "learner_idle": (b["runtime/learner_idle_s"] - a["runtime/learner_idle_s"]) / (b["time_s"] - a["time_s"]),
            "staleness": float(np.mean([r["staleness/mean"] for r in records[skip:]])),
            "step_s": (b["time_s"] - a["time_s"]) / (b["step"] - a["step"])}


def train(steps: int, skip: int, repeats: int) -> dict:
    local, remote = [], []
    for _ in range(repeats):
        local.append(_rates(_run("async", steps), skip))
        remote.append(_rates(_run("remote", steps), skip))
    best = lambda runs: max(runs, key=lambda r: r["tokens_per_s"])  # noqa: E731
    lo, re = best(local), best(remote)
    return {"local_trained_tokens_per_s": lo["tokens_per_s"], "remote_trained_tokens_per_s": re["tokens_per_s"],
            "remote_vs_local_trained": re["tokens_per_s"] / lo["tokens_per_s"],
            "learner_idle_local": lo["learner_idle"], "learner_idle_remote": re["learner_idle"],
            "staleness_local": lo["staleness"], "staleness_remote": re["staleness"],
            "step_s_local": lo["step_s"], "step_s_remote": re["step_s"]}


def delay(steps: int, skip: int, delays, mbps: float, queue_size: int) -> dict:
    """Unbounded staleness, and room for `queue_size` learner batches in flight per node: what is
    in flight must cover the round trip, or the link's latency bounds the node's throughput."""
    out, base = {"delay_queue_size": queue_size}, None
    for d in delays:
        extra = ("--config.runtime.max_staleness=-1", f"--config.runtime.queue_size={queue_size}")
        r = _rates(_run("remote", steps, extra, node_via=(d, mbps)), skip)
        base = r if base is None else base
        out[f"delay_{d:g}s_staleness"] = r["staleness"]
        # The simulated mode's model: a delay of d seconds is d / step_seconds learner steps.
        out[f"delay_{d:g}s_predicted"] = base["staleness"] + (d - delays[0]) / r["step_s"]
        out[f"delay_{d:g}s_step_s"] = r["step_s"]
    return out


class Relay:
    """A TCP relay on 127.0.0.1 that holds every forwarded read `delay_s` before sending it on
    and caps each direction at `mbps` megabytes per second (the delaying proxy)."""

    def __init__(self, target: int, delay_s: float, mbps: float):
        self.target, self.delay_s, self.rate = target, delay_s, mbps * 1e6
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port, self.stop = self.sock.getsockname()[1], threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the learner is not serving yet: the node tries again
                a.close()
                continue
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src, dst):
        import collections

        held, lock, more = collections.deque(), threading.Lock(), threading.Event()

        def send():  # forwards each read once it is `delay_s` old, at the capped rate
            while not self.stop.is_set():
                more.wait(0.05)
                with lock:
                    ready = held and held[0][0] <= time.monotonic()
                    item = held.popleft() if ready else None
                    if not held:
                        more.clear()
                if item is None:
                    if held:
                        time.sleep(max(0.0, held[0][0] - time.monotonic()))
                    continue
                try:
                    dst.sendall(item[1])
                except OSError:
                    return
                time.sleep(len(item[1]) / self.rate)

        threading.Thread(target=send, daemon=True).start()
        while not self.stop.is_set():
            try:
                data = src.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            with lock:
                held.append((time.monotonic() + self.delay_s, data))
                more.set()

    def close(self):
        self.stop.set()
        self.sock.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", default="transfer,train,delay")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the rates (compiles, first weights)")
    ap.add_argument("--delays", default="0,0.5,2", help="seconds each way, comma separated")
    ap.add_argument("--mbps", type=float, default=100.0, help="relay bandwidth cap, MB/s each way")
    ap.add_argument("--delay_queue_size", type=int, default=8, help="(c): runtime.queue_size behind the relay")
    ap.add_argument("--merge", action="store_true", help="keep the other parts' figures already in --json")
    ap.add_argument("--node_xla_flags", default="", help="XLA_FLAGS of the node process (e.g. its threads)")
    ap.add_argument("--adversaries", default="hoard,flood,flood_sink", help="(d): the misbehaving nodes, one run each")
    ap.add_argument("--flood_mb", type=int, default=1024, help="(d): the size of each flooding group")
    ap.add_argument("--adversary", action="store_true", help="run part (d) alone (--parts adversary)")
    a = ap.parse_args()
    FLOOD_MB[0] = a.flood_mb
    if a.adversary:
        a.parts = "adversary"
    if a.node_xla_flags:
        NODE_ENV["XLA_FLAGS"] = a.node_xla_flags
    parts = a.parts.split(",")
    out = common.cpu_kind()
    if "transfer" in parts:
        out.update(transfer(max(a.repeats, 3)))
    if "train" in parts:
        out.update(train(a.steps, a.skip, a.repeats))
    if "adversary" in parts:
        out.update(adversary(a.steps, a.skip, a.repeats, a.adversaries.split(",")))
    if "delay" in parts:
        out.update(delay(a.steps, a.skip, [float(x) for x in a.delays.split(",")], a.mbps, a.delay_queue_size))
    if a.merge and a.json and os.path.exists(a.json):  # a rerun of some parts keeps the others' figures
        with open(a.json) as f:
            out = {**json.load(f), **out}
    common.report(out, a.json)


if __name__ == "__main__":
    main()
