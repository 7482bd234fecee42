"""`remote/node.py` with a learner on 127.0.0.1: node processes through joins, kill -9, a learner
restart, SIGTERM and two learner processes."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow.flight as flight
import pytest

from jaxrl_llm.parallel.launch import free_port
from jaxrl_llm.remote import wire
from jaxrl_llm.remote.client import Client
from tests.remote_helpers import _group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_step(workdir, step, proc, timeout=240, key="loss"):
    """Wait for a trained step >= `step` whose record holds `key`."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if any(r.get("step", -1) >= step and "loss" in r and key in r for r in _records(workdir)):
            return
        assert proc.poll() is None, f"learner exited with {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


class _Processes:
    """Learner and node processes of one test, each logging to tmp_path/<name>.log; every one
    still running is killed on exit."""

    def __init__(self, tmp_path, port, env=None):
        self.tmp, self.port, self.env, self.logs, self.procs = tmp_path, port, env, [], []

    def start(self, cmd, name):
        log = open(self.tmp / f"{name}.log", "w")
        self.logs.append(log)
        self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        return self.procs[-1]

    def node(self, name):
        return self.start([sys.executable, "-m", "jaxrl_llm.sampler_node", f"--learner=127.0.0.1:{self.port}",
                           f"--name={name}", "--retry_s=0.5"], name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for f in self.logs:
            f.close()


def _trained(workdir, steps):
    """The step records (asserted to be steps 1..`steps`, once each) and every trained (draw, group)."""
    records = [r for r in _records(workdir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records, [tuple(o) for r in records for o in r["remote/origins"]]


@pytest.mark.serial
def test_learner_and_two_nodes_through_joins_kills_and_a_learner_restart(tmp_path):
    """Node a starts with the learner, node b joins at step 2; a is killed (-9) mid-generation at
    step 4, the learner (-9) at step 7; a new learner resumes from its checkpoint at version 6
    and b finds it by itself. A forger with the token is rejected and its lease expires, one
    without the token is refused. Every
    group is trained once: what the records say was trained is what the data position says was
    delivered, with nothing twice."""
    port, wd, token = free_port(), str(tmp_path / "run"), "s3cret"
    learner = [sys.executable, "-m", "jaxrl_llm.main", f"--workdir={wd}", "--config.warm_start.steps=0",
               "--config.runtime.mode=remote", f"--config.runtime.remote.port={port}", "--config.runtime.max_staleness=-1",
               "--config.runtime.remote.lease_s=1", "--config.runtime.prompts_per_batch=4", "--config.train.steps=10",
               "--config.train.save_every=3", "--config.train.eval_every=100", "--config.task.eval_size=8",
               "--config.train.progress=False", "--config.runtime.remote.verify_fraction=0.5"]
    with _Processes(tmp_path, port, dict(os.environ, JAXRL_REMOTE_TOKEN=token)) as run:
        first, a = run.start(learner, "l1"), run.node("a")
        _wait_step(wd, 2, first)
        run.node("b")
        _wait_step(wd, 4, first)
        a.send_signal(signal.SIGKILL)
        _wait_step(wd, 7, first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = run.start(learner, "l2")
        addr = f"127.0.0.1:{port}"
        for _ in range(600):  # the new learner serves once it has restored
            try:
                hello = Client(addr, token=token).call("hello", protocol=wire.PROTOCOL,
                                                        package=__import__("jaxrl_llm").__version__, name="forger")
                break
            except flight.FlightUnavailableError:
                time.sleep(0.2)
        with pytest.raises(flight.FlightUnauthenticatedError, match="requires its shared token"):
            Client(addr, token="guess").call("hello", name="intruder")
        forger, s = Client(addr, token=token), {k: hello[k] for k in ("run_id", "node", "session")}
        # A lease with a group beyond the 3 it forges, which it then holds until it expires (a lease
        # of a draw partly trained before the restart may hold fewer; such leases expire too).
        lease = None
        for _ in range(200):
            got = forger.call("lease", version=hello["version"], **s)["leases"]
            lease = next((x for x in got if len(x["groups"]) > 3), None)
            if lease is not None:
                break
        sc = hello["sampler"]
        p = 7  # the run's prompt width: rows are no wider than it plus max_new_tokens
        f = _group(rows=sc["num_samples"], p=p, new=sc["max_new_tokens"], k=sc["capture_topk"], prompt=(1,))
        forged = {"outside the vocabulary": dict(f, tokens=f["tokens"] + 10_000),
                  "the learner is at version": dict(f, versions=f["versions"] + 10_000),
                  "expected \\(16, L\\)": {n: x[:3] for n, x in f.items()}}
        answers = forger.put_groups([(wire.group_batch(g), {"lease": lease["id"], "group": k})
                                     for g, k in zip(forged.values(), lease["groups"])], **s)
        for why, answer in zip(forged, answers):  # each refused group is leased again at once
            assert re.search(why, answer["rejected"]), answer
        # The forger never comes back: its lease expires and its groups go to node b.
        assert second.wait(timeout=240) == 0, (tmp_path / "l2.log").read_text()[-3000:]
    records, trained = _trained(wd, 10)
    assert len(trained) == 10 * 4 and len(set(trained)) == len(trained)  # nothing trained twice
    with open(os.path.join(wd, "checkpoints", "10.runtime", "process_0.json")) as f:
        pos = json.load(f)["position"]["workers"]["0"]
    delivered = {(d, g) for d in range(pos["next"]) for g in range(4)}
    delivered |= {(int(d), g) for d, gs in pos["partial"].items() for g in gs}
    assert set(trained) == delivered  # and nothing skipped: the rest is leased again after a resume
    last = records[-1]
    assert last["remote/rejected"] >= 3 and last["remote/b/groups"] > 0 and last["remote/leases_expired"] >= 1
    assert (tmp_path / "b.log").read_text().count("node b joined") == 2  # and again after the restart, by itself


def test_sigterm_while_the_learner_waits_for_groups_saves_and_exits(tmp_path):
    """No node ever connects: the learner waits for groups; SIGTERM ends the wait, the run saves
    and exits 143 within its grace period (it used to exit 1 at the end of it, unsaved)."""
    cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--workdir={tmp_path}", "--config.warm_start.steps=0",
           "--config.runtime.mode=remote", f"--config.runtime.remote.port={free_port()}", "--config.train.steps=4",
           "--config.train.preempt_grace_s=10", "--config.task.eval_size=8", "--config.train.progress=False"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        while not seen or "serving sampler nodes" not in seen[-1]:
            seen.append(p.stdout.readline())
            assert seen[-1], "".join(seen)[-3000:]
        time.sleep(1.0)  # inside the wait for groups
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143 and time.monotonic() - t < 10, "".join(seen)[-2000:] + out[-2000:]
    assert "interrupted (SIGTERM) at version 0" in out and (tmp_path / "checkpoints" / "0").is_dir()


class _Mute(flight.FlightServerBase):
    """A learner that takes connections and does not answer (one going away, or stuck)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.done = threading.Event()

    def do_action(self, context, action):
        self.done.wait(60)
        return iter([])


def test_a_stopping_node_waits_for_its_leases_release_a_bounded_time():
    from jaxrl_llm.remote import node as sampler_node

    server = _Mute("grpc+tcp://127.0.0.1:0")
    try:
        node = sampler_node.Node(f"127.0.0.1:{server.port}", "t", "n", None, 0.5)
        node.session = {"run_id": "r", "node": "n", "session": "k"}
        t = time.monotonic()
        node.stop(release=True)  # a preempted node must exit within its grace period
        assert time.monotonic() - t < sampler_node.RELEASE_S + 2 and node.stopping.is_set()
    finally:
        server.done.set()
        server.shutdown()


def test_sigterm_returns_the_leases_while_a_call_to_the_learner_hangs():
    """Python runs a signal's handler in the main thread, between bytecodes, and a Flight call
    does not give it back until it ends (up to the client's 30 s timeout, against a learner under
    load): the node's work runs beside the main thread, so SIGTERM returns the leases and exits
    at once. Here the call goes to a socket that never answers (gRPC gives up on it after 20 s)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    child = ("import sys, pyarrow.flight as flight\n"
             "from jaxrl_llm.remote import node\n"
             "class Busy:\n"
             "    name, uploaded, rejected = 'busy', 0, 0\n"
             "    def __init__(self, *a): pass\n"
             "    def run(self):\n"
             f"        c = flight.FlightClient('grpc://127.0.0.1:{listener.getsockname()[1]}')\n"
             "        print('calling', flush=True)\n"
             "        list(c.do_action(flight.Action('lease', b''), options=flight.FlightCallOptions(timeout=120)))\n"
             "    def stop(self, release=True): print('released', release, flush=True)\n"
             "    def close(self): pass\n"
             "node.Node = Busy\n"
             "sys.exit(node.main(['--learner=127.0.0.1:1']))\n")
    p = subprocess.Popen([sys.executable, "-c", child], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "calling"
        time.sleep(1.0)  # inside the call
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert p.stdout.read().strip() == "released True"
    finally:
        p.kill()
        listener.close()


@pytest.mark.serial
def test_two_learner_processes_two_nodes_a_node_leaving_by_sigterm_and_a_preempted_wait(tmp_path):
    """With 2 learner processes, process 0 serves and hands each process its rows; a node sent
    SIGTERM returns its leases at once (none has to expire) and training goes on with the other.
    Once that one is killed too the learner waits for groups, and SIGTERM ends the wait: both
    processes stop at the same point, save and exit 143. The policy trains LoRA adapters: nodes
    fetch the base once and each version's adapters only."""
    port, wd = free_port(), str(tmp_path / "run")
    learner = [sys.executable, "-m", "jaxrl_llm.launch", "--processes=2", "--", f"--workdir={wd}",
               "--config.warm_start.steps=0", "--config.runtime.mode=remote", f"--config.runtime.remote.port={port}",
               "--config.runtime.max_staleness=2", "--config.runtime.prompts_per_batch=4", "--config.train.steps=1000",
               "--config.train.save_every=1000", "--config.train.eval_every=1000", "--config.task.eval_size=8",
               "--config.train.progress=False", "--config.sampler.batching=static", "--config.model.lora.rank=4"]
    with _Processes(tmp_path, port) as run:
        lrn, a, b = run.start(learner, "l"), run.node("a"), run.node("b")
        _wait_step(wd, 2, lrn, key="remote/a/staleness")  # under load b alone may fill the first steps
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=90) == 0
        _wait_step(wd, 4, lrn)
        b.send_signal(signal.SIGKILL)
        b.wait()
        time.sleep(3)  # what b uploaded is trained; the learner waits for groups no one sends
        lrn.send_signal(signal.SIGTERM)  # the launcher forwards it to both processes
        assert lrn.wait(timeout=60) == 143, (tmp_path / "l.log").read_text()[-3000:]
    log_text = (tmp_path / "l.log").read_text()
    stopped = int(log_text.split("interrupted (SIGTERM) at version")[1].split(":")[0])
    assert stopped >= 4 and os.path.isdir(os.path.join(wd, "checkpoints", str(stopped)))
    records, trained = _trained(wd, stopped)
    assert records[-1]["processes"] == 2
    assert len(trained) == stopped * 4 * 2 and len(set(trained)) == len(trained)
    assert "leases returned" in (tmp_path / "a.log").read_text()
    assert records[-1]["remote/leases_expired"] == 0 and records[-1]["remote/b/groups"] > 0
    # max_staleness: what is trained is within it, in every step (a step's key names the nodes whose
    # groups it trained)
    for node in ("a", "b"):
        seen = [r[f"remote/{node}/staleness"] for r in records if f"remote/{node}/staleness" in r]
        assert seen and max(seen) <= 2, node
    m = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)  # configs/default.py
    per_layer = 4 * (m["hidden_size"] + m["num_heads"] * m["head_dim"]) * 2 + 4 * (
        m["hidden_size"] + m["num_kv_heads"] * m["head_dim"]) * 2 + 4 * (m["hidden_size"] + m["intermediate_size"]) * 3
    assert records[-1]["weights/publish_bytes"] == 4 * 2 * per_layer  # float32 adapters of 2 layers
