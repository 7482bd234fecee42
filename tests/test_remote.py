"""Sampler nodes (`runtime.mode=remote`): the wire format, leases, the service's token and TLS,
and one learner with two node processes on 127.0.0.1 through joins, kill -9 and a learner restart."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pyarrow.flight as flight
import pytest

from jaxrl_llm.parallel.launch import free_port
from jaxrl_llm.remote import wire
from jaxrl_llm.remote.client import Client
from jaxrl_llm.remote.leases import LeaseError, Leases
from jaxrl_llm.remote.service import Service

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- wire


def test_weights_artifact_roundtrip_and_checksums():
    big = np.arange(40, dtype=np.float32)  # 160 bytes: its own pieces of at most 64
    params = {"embed": np.arange(12, dtype=np.float32).reshape(3, 4), "big": big,
              "layers": [{"w": np.linspace(-1, 1, 10).astype(ml_dtypes.bfloat16)}, {"b": np.ones(7, np.float32)}]}
    manifest, buf = wire.pack_params(params, version=3, chunk_bytes=64)
    offsets = {e["path"]: e["offset"] for e in manifest["leaves"]}
    assert all(o % wire.ALIGN == 0 for o in offsets.values())
    spans = [(c["offset"], c["offset"] + c["nbytes"]) for c in manifest["chunks"]]
    assert spans == [(0, 64), (64, 128), (128, 160), (192, 240), (256, 276), (320, 348)]  # big; embed; w; b
    like = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params)
    chunks = [buf[lo:hi].tobytes() for lo, hi in spans]
    out = wire.unpack_params(json.loads(json.dumps(manifest)), chunks, like)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    for i, c in enumerate(chunks):
        wire.check_chunk(manifest, i, c)
    bad = bytearray(chunks[1])
    bad[3] ^= 1
    with pytest.raises(ValueError, match="chunk 1 fails its checksum"):
        wire.check_chunk(manifest, 1, bytes(bad))
    with pytest.raises(ValueError, match="chunk 0 fails its checksum"):
        wire.check_chunk(manifest, 0, chunks[0][:-1])
    with pytest.raises(ValueError, match="do not match this node's model"):
        wire.unpack_params(manifest, chunks, {"embed": like["embed"]})


def _group(rows=2, p=4, new=3, k=2, prompt=(7, 8, 9), vocab=20, kept=True):
    """A well-formed group: prompt left-padded into p positions, `new` generated tokens; `kept`:
    sampled from a truncated distribution (top-k / top-p), so it carries behav_kept."""
    w = p + new
    toks = np.zeros((rows, w), np.int32)
    toks[:, p - len(prompt):p] = prompt
    toks[:, p:] = np.arange(new) + 1
    gen = np.zeros((rows, w), np.float32)
    gen[:, p:] = 1
    return {"tokens": toks, "loss_mask": gen, "behav_logp": -gen * 0.5, "versions": np.where(gen > 0, 2, -1).astype(np.int32),
            "topk_ids": np.ones((rows, w, k), np.int32), "topk_logp": np.full((rows, w, k), -1.0, np.float32),
            "rewards": (np.arange(rows) % 2).astype(np.float32), "truncated": np.zeros(rows, bool),
            "input_mask": (toks > 0).astype(np.float32), **({"behav_kept": gen.astype(np.int32) * 3} if kept else {})}


def _check(f, **kw):
    args = dict(rows=2, prompt=(7, 8, 9), vocab=20, topk=2, max_new_tokens=3, learner_version=5, min_version=1,
                kept=True, reward_range=(0.0, 1.0), max_width=7)
    wire.check_group(f, **{**args, **kw})


def test_rollout_table_roundtrip_and_every_forgery_rejected():
    f = _group()
    batch = wire.group_batch(f)
    got = wire.decode_group(wire.encode_group(batch))
    assert set(got) == set(wire.GROUP_FIELDS)
    for name in wire.GROUP_FIELDS:
        np.testing.assert_array_equal(got[name], f[name])
    _check(got)
    forged = {
        "outside the vocabulary": dict(f, tokens=np.where(f["tokens"] == 1, 20, f["tokens"]).astype(np.int32)),
        "learner is at version 5": dict(f, versions=np.where(f["loss_mask"] > 0, 6, -1).astype(np.int32)),
        "leased no older than 1": dict(f, versions=np.where(f["loss_mask"] > 0, 0, -1).astype(np.int32)),
        "expected \\(2, L\\)": {n: x[:1] for n, x in f.items()},
        "topk_logp has shape": dict(f, topk_logp=f["topk_logp"][:, :, :1]),
        "do not answer the leased prompt": dict(f, tokens=np.where(f["tokens"] == 8, 5, f["tokens"]).astype(np.int32)),
        "log-probs must be finite": dict(f, behav_logp=-f["behav_logp"] + 0.5),
        # NaN / inf where loss_mask is 0 (the prompt span) still poisons the loss: NaN * 0 is NaN
        "log-probs must be finite ": dict(f, behav_logp=np.where(f["loss_mask"] > 0, f["behav_logp"], np.nan)),
        "log-probs must be finite  ": dict(f, behav_logp=np.where(f["loss_mask"] > 0, f["behav_logp"], -np.inf)),
        "top-K: not NaN": dict(f, topk_logp=np.where(f["loss_mask"][..., None] > 0, f["topk_logp"], np.inf)),
        "top-K: not NaN ": dict(f, topk_logp=np.where(f["loss_mask"][..., None] > 0, f["topk_logp"], np.nan)),
        "behav_kept must be in": dict(f, behav_kept=f["behav_kept"] * 10),
        # finite, but a single such reward skips every minibatch of its batch (the loss overflows)
        r"rewards span \[0, 3e\+38\]; this task's lie in \[0, 1\]": dict(f, rewards=np.float32([0, 3e38])),
        r"rewards span \[-0.5, 1\]": dict(f, rewards=np.float32([-0.5, 1])),
        "rows of width 8; this run's are at most 7 wide": {n: np.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
                                                           if x.ndim > 1 else x for n, x in f.items()},
    }
    for why, g in forged.items():
        with pytest.raises(wire.Rejected, match=why.strip()):
            _check(wire.decode_group(wire.encode_group(wire.group_batch(g))))
    # A batch is assembled from groups of many nodes: behav_kept is in all of them or none, as the
    # run's sampling decides (one group carrying it beside others without ended the learner).
    with pytest.raises(wire.Rejected, match="behav_kept given, but this run's sampling does not truncate"):
        _check(got, kept=False)
    with pytest.raises(wire.Rejected, match="behav_kept missing: this run's sampling truncates"):
        _check(wire.decode_group(wire.encode_group(batch.replace(behav_kept=None))))
    greedy = np.where(np.arange(2)[None, None, :] == 0, 0.0, -np.inf).astype(np.float32)  # honest -inf
    _check(dict(got, topk_logp=np.broadcast_to(greedy, got["topk_logp"].shape), behav_logp=0 * got["behav_logp"]))
    with pytest.raises(wire.Rejected, match="dtype float64, expected int32"):
        wire.decode_group(wire.encode_group(batch.replace(tokens=f["tokens"].astype(np.float64))))
    t = wire.encode_group(batch)
    with pytest.raises(wire.Rejected, match="bytes do not hold shape"):
        wire.decode_group(t.set_column(2, "shape", [[[9, 9]] * t.num_rows]))


# ---------------------------------------------------------------------- leases


def _todo():
    d = 0
    while True:
        yield d, [0, 1]
        d += 1


def test_leases_expire_back_to_the_front_and_refuse_late_groups():
    now = [0.0]
    leases = Leases(_todo(), lease_s=10, clock=lambda: now[0])
    a, b = leases.issue("a", 0), leases.issue("b", 0)
    assert (a.draw, b.draw) == (0, 1)
    leases.received(a.id, "a", 0)
    with pytest.raises(LeaseError):
        leases.received(a.id, "a", 0)  # a group is received once
    with pytest.raises(LeaseError):
        leases.received(b.id, "a", 0)  # only by its holder
    now[0] = 8
    leases.heartbeat("b")
    now[0] = 12
    assert [x.id for x in leases.expire()] == [a.id] and leases.expired == 1
    with pytest.raises(LeaseError):
        leases.received(a.id, "a", 1)  # too late: the group is someone else's now
    c = leases.issue("b", 1)
    assert (c.draw, c.groups) == (0, [1])  # the expired lease's missing group first
    assert leases.issue("b", 1).draw == 2
    assert not leases.issue("a", 1, admit=lambda v, g: False) and leases.issue("a", 1).draw == 3
    assert len(leases.release("b")) == 3 and leases.issue("a", 1).draw == 0  # b held groups of draws 0, 1, 2
    d = leases.issue("a", 1)
    assert leases.give_back(d.id, 0) is d and d.pending == {1}  # a refused group: leased again at once
    assert leases.issue("a", 1).draw != d.draw  # a still holds d's draw: never two leases on one draw
    assert (lambda x: (x.draw, x.groups))(leases.issue("b", 1)) == (d.draw, [0])


def test_a_node_that_heartbeats_but_delivers_nothing_loses_its_leases_after_stall_s():
    now = [0.0]
    leases = Leases(_todo(), lease_s=10, clock=lambda: now[0], stall_s=25)
    slow, honest = leases.issue("slow", 0), leases.issue("honest", 0)
    for t in range(5, 30, 5):
        now[0] = t
        leases.heartbeat("slow"), leases.heartbeat("honest")
        if t == 20:
            leases.received(honest.id, "honest", 0)
        assert leases.expire() == [] or t > 25
    now[0] = 26
    assert [x.id for x in leases.expire()] == [slow.id] and (leases.expired, leases.stalled) == (1, 1)
    assert leases.pending_groups("honest") == 1 and leases.pending_groups("slow") == 0
    again = leases.issue("slow", 0)
    assert (again.draw, again.groups) == (slow.draw, slow.groups)  # first in line, and a fresh clock
    now[0] = 52
    leases.heartbeat("slow"), leases.heartbeat("honest")
    assert {x.node for x in leases.expire()} == {"slow", "honest"}  # 26 and 32 s without a group


# ---------------------------------------------------------------------- service


class _Echo:
    def hello(self, req):
        return {"hi": req["name"]}

    def lease(self, req):
        raise PermissionError("node x was refused")


class _Faulty:
    """A handler whose put_group fails in every way the service must contain."""

    def __init__(self):
        import collections

        self.refusals, self.streams = collections.Counter(), 0

    def refuse(self, reason):
        self.refusals[reason] += 1

    def check_session(self, req):
        if req.get("session") != "ok":
            e = wire.Rejected("the session key does not match")
            e.counted = True
            self.refuse("session")
            raise e
        self.streams += 1

    def put_group(self, req):
        if req["group"] == 1:
            raise RuntimeError("/secret/server/path.py exploded")  # a bug, not a refusal
        if req["group"] == 2:
            raise KeyError("lease")  # not counted by the handler: the service counts it
        return {"accepted": True}

    def hello(self, req):
        return {}


def test_service_refusals_are_one_line_counted_by_reason_and_a_bad_group_refuses_only_itself():
    h = _Faulty()
    svc = Service(h, "127.0.0.1", 0, token="s3cret")
    try:
        c = Client(svc.address, token="s3cret")
        f = _group(rows=2, p=2, new=2, k=0, prompt=(1,))
        groups = [(wire.group_batch(f), {"lease": 1, "group": g}) for g in range(4)]
        groups[3] = (groups[3][0], {"lease": 1, "group": 3, "pad": "x" * 17000})  # metadata past MAX_META_BYTES
        answers = c.put_groups(groups, session="ok")
        assert answers[0] == {"accepted": True} and answers[1]["rejected"] == (
            "internal error on the learner (RuntimeError); it is logged there")
        assert "KeyError" in answers[2]["rejected"] and "at most 16384 bytes" in answers[3]["rejected"]
        assert all("Traceback" not in str(a) and "/secret" not in str(a) for a in answers)
        with pytest.raises(flight.FlightServerError, match="session key does not match"):
            c.put_groups(groups[:1], session="forged")
        with pytest.raises(flight.FlightServerError, match="at most 65536 bytes"):
            c.call("hello", pad="x" * (70 << 10))
        with pytest.raises(flight.FlightServerError, match="unknown action"):
            c.call("nope")
        for _ in range(3):
            with pytest.raises(flight.FlightUnauthenticatedError):
                Client(svc.address, token="guess").call("hello")
        assert h.streams == 1 and dict(h.refusals) == {"internal": 1, "request": 4, "session": 1, "token": 3}
    finally:
        svc.close()


def test_failed_authentication_past_a_burst_waits_before_each_refusal():
    from jaxrl_llm.remote.service import TokenCheck

    now, slept, counted = [0.0], [], []
    check = TokenCheck("s3cret", counted.append, burst=3, delay_s=0.5, clock=lambda: now[0], sleep=slept.append)
    for i in range(6):
        with pytest.raises(flight.FlightUnauthenticatedError):
            check.start_call(None, {"authorization": ["Bearer guess"]})
    assert slept == [0.5] * 3 and counted == ["token"] * 3 + ["throttled"] * 3
    assert check.start_call(None, {"authorization": ["Bearer s3cret"]}) is None and len(slept) == 3  # never delayed
    now[0] = 1.5  # a second later the burst is free again
    with pytest.raises(flight.FlightUnauthenticatedError):
        check.start_call(None, {"authorization": ["Bearer guess"]})
    assert len(slept) == 3 and counted[-1] == "token"


def test_service_requires_its_token_and_speaks_tls(tmp_path):
    svc = Service(_Echo(), "127.0.0.1", 0, token="s3cret")
    try:
        assert Client(svc.address, token="s3cret").call("hello", name="n") == {"hi": "n"}
        with pytest.raises(flight.FlightUnauthenticatedError, match="the one sent does not match"):
            Client(svc.address, token="wrong").call("hello", name="n")
        with pytest.raises(flight.FlightUnauthenticatedError, match="none was sent"):
            Client(svc.address).call("hello", name="n")
        with pytest.raises(flight.FlightUnauthorizedError, match="refused: node x was refused"):
            Client(svc.address, token="s3cret").call("lease")
        with pytest.raises(flight.FlightServerError, match="unknown action 'nope'; valid: hello"):
            Client(svc.address, token="s3cret").call("nope")
        assert svc.auth.refused == 2
    finally:
        svc.close()
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no self-signed certificate for the TLS half")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    svc = Service(_Echo(), "127.0.0.1", 0, token="t", tls=(cert.read_bytes(), key.read_bytes()))
    try:
        assert Client(svc.address, token="t", tls_root_cert=cert.read_bytes()).call("hello", name="tls") == {"hi": "tls"}
        with pytest.raises(flight.FlightError):
            Client(svc.address, token="t", timeout=5).call("hello", name="plain")  # no TLS: no answer
    finally:
        svc.close()


# ---------------------------------------------------------------------- processes


def _records(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_step(workdir, step, proc, timeout=240):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if any(r.get("step", -1) >= step and "loss" in r for r in _records(workdir)):
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
        _wait_step(wd, 2, lrn)
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
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
    assert records[-1]["remote/b/staleness"] <= 2  # max_staleness: what is trained is within it
    m = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)  # configs/default.py
    per_layer = 4 * (m["hidden_size"] + m["num_heads"] * m["head_dim"]) * 2 + 4 * (
        m["hidden_size"] + m["num_kv_heads"] * m["head_dim"]) * 2 + 4 * (m["hidden_size"] + m["intermediate_size"]) * 3
    assert records[-1]["weights/publish_bytes"] == 4 * 2 * per_layer  # float32 adapters of 2 layers


def _hub(verify_fraction=1.0, task=None, max_new_tokens=4, capacity=100):
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.rollout import Sampler, SamplerConfig
    from jaxrl_llm.runtime import orchestrator
    from jaxrl_llm.remote.hub import Hub
    from jaxrl_llm.runtime.producer import Producer
    from jaxrl_llm.runtime.queue import VersionedQueue
    from jaxrl_llm.runtime.weights import WeightStore
    from jaxrl_llm.tasks.arithmetic import Arithmetic

    task = task or Arithmetic()
    mcfg = models.ModelConfig(vocab_size=task.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=8, eos_token_id=task.eos_id)
    cfg = orchestrator.default_config()
    cfg.prompts_per_batch, cfg.remote.verify_fraction = 2, verify_fraction
    producer = Producer(Sampler(mcfg, SamplerConfig(max_new_tokens=max_new_tokens, num_samples=2, capture_topk=0,
                                                     eos_token_id=task.eos_id)), task, cfg)
    store = WeightStore()
    store.publish(3, models.init_params(mcfg, jax.random.key(0)))
    queue = VersionedQueue(100)
    return Hub(producer, store, Leases(_todo(), 30.0), queue, cfg, {"task": {}}, capacity=capacity), task


def _weights(hub, session) -> dict:
    """The fingerprint an honest node reports for the hub's newest version (as it fetched it)."""
    manifest = hub.manifest(session)
    return {str(manifest["version"]): wire.fingerprint(wire.manifest_crcs(manifest), manifest["nbytes"])}


def test_hub_checks_versions_run_ids_and_rewards_and_refuses_a_lying_node():
    from jaxrl_llm.remote.hub import MIN_VERIFIED

    hub, task = _hub()
    with pytest.raises(PermissionError, match=r"protocol 1 \(jaxrl_llm 0\.1\.0\); the node 0 \(jaxrl_llm 0\.0\.1\)"):
        hub.hello({"protocol": 0, "package": "0.0.1"})
    me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    with pytest.raises(wire.Rejected, match="restarted"):
        hub.lease({"run_id": "old", "node": me["node"]})

    def make(lease, k, lie):
        prompt = hub.producer.draw(1, lease["draw"])[0][k]
        f = _group(rows=2, p=len(prompt) + 1, new=4, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
        honest = [task.reward(prompt, t[m > 0].tolist()) for t, m in zip(f["tokens"], f["loss_mask"])]
        f["rewards"] = (1.0 - np.asarray(honest) if lie else np.asarray(honest)).astype(np.float32)
        return f

    def group(lease, k, lie, claimed=None):
        f = make(lease, k, lie)
        return hub.put_group({**s, "lease": lease["id"], "group": k, "weights": weights if claimed is None else claimed,
                              "table": wire.encode_group(wire.group_batch(f))}), f

    weights = _weights(hub, s)
    for claimed, why in (({}, r"\(None\) are not the ones published"), ({"3": "0-1"}, r"\(0-1\) are not the ones")):
        lease = hub.lease({**s, "version": 3})["leases"][0]
        with pytest.raises(wire.Rejected, match=f"the weights the node used for version 3 {why}"):
            group(lease, 0, lie=False, claimed=claimed)  # weights that never arrived are not staleness
    lease = hub.lease({**s, "version": 3})["leases"][0]
    out, f = group(lease, 0, lie=False)
    assert out == {"accepted": True} and len(hub.queue) == 1
    item = hub.queue.get(3)[0]
    assert item.origin == (0, lease["draw"], (0,))
    np.testing.assert_array_equal(item.batch.rewards, f["rewards"])
    np.testing.assert_array_equal(item.batch.advantages, 0.0)  # the learner's own, per batch (RemoteMode)
    with pytest.raises(wire.Rejected, match="not held"):
        group(lease, 0, lie=False)  # once only
    for i in range(MIN_VERIFIED - 1):  # 1 honest + 4 lies: refused at the 5th check (4 / 5 > max_mismatch)
        (lease,) = hub.lease({**s, "version": 3})["leases"]
        with pytest.raises(wire.Rejected, match="differ from the learner's"):
            group(lease, 0, lie=True)
    with pytest.raises(PermissionError, match=f"{MIN_VERIFIED - 1} of {MIN_VERIFIED} verified groups"):
        hub.lease({**s, "version": 3})
    with pytest.raises(PermissionError, match="'n' was refused earlier in this run"):
        hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    assert hub.refusals == {"hello": 2, "session": 1, "weights": 2, "lease": 1, "reward": MIN_VERIFIED - 1,
                            "refused": 1}
    assert hub.rejected == 11 and len(hub.queue) == 0 and hub.leases.pending_groups() == 0


def test_each_node_leases_from_its_own_room_so_a_hoarding_node_starves_no_one():
    hub, _ = _hub(capacity=4)
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    hog, honest = ({k: me[k] for k in ("run_id", "node", "session")} for me in (hub.hello({**hi, "name": "hog"}),
                                                                              hub.hello({**hi, "name": "honest"})))
    for _ in range(5):  # the hog asks again and again and uploads nothing
        hub.lease({**hog, "version": 3, "count": 8})
    assert hub.leases.pending_groups("hog") == 4  # its room: capacity groups leased or queued
    got = hub.lease({**honest, "version": 3, "count": 8})["leases"]
    assert sum(len(x["groups"]) for x in got) == 4 and hub.leases.pending_groups("honest") == 4


def test_oversized_groups_are_refused_before_decoding_and_gone_nodes_leave_the_table_and_metrics():
    import pyarrow as pa

    from jaxrl_llm.remote import hub as hub_lib

    hub, task = _hub(verify_fraction=0.0)
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    rows = pa.table({n: pa.array([None] * 2_000_000, t) for n, t in zip(wire._SCHEMA.names, wire._SCHEMA.types)})
    for name in ("wide", "rows"):  # each refused before decoding, and its node for good: no honest node sends it
        me = hub.hello({**hi, "name": name})
        bad = {k: me[k] for k in ("run_id", "node", "session")}
        lease = hub.lease({**bad, "version": 3})["leases"][0]
        prompt = hub.producer.draw(1, lease["draw"])[0][lease["groups"][0]]
        wide = _group(rows=2, p=len(prompt) + 4000, new=4, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        table = wire.encode_group(wire.group_batch(wide)) if name == "wide" else rows
        with pytest.raises(wire.Rejected, match="this run's groups take at most 10 rows and"):
            hub.put_group({**bad, "lease": lease["id"], "group": lease["groups"][0], "table": table})
        with pytest.raises(PermissionError, match=f"node {name} was refused: it sent a group larger than"):
            hub.lease({**bad, "version": 3})
    assert hub.refusals == {"size": 2, "refused": 2} and hub.leases.pending_groups() == 0  # all leased again
    me = hub.hello({**hi, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    lease = hub.lease({**s, "version": 3})["leases"][0]
    hub._draw_prompts = lambda draw: 1 / 0  # a bug on the learner: the node hears "internal error", nothing more
    with pytest.raises(wire.Rejected, match=r"^internal error on the learner \(ZeroDivisionError\); it is logged there$"):
        hub.put_group({**s, "lease": lease["id"], "group": lease["groups"][0], "table": wire.encode_group(
            wire.group_batch(_group(rows=2, p=hub.max_width - 4, new=4, k=0, prompt=prompt, vocab=task.vocab_size,
                                    kept=False)))})
    assert hub.refusals["internal"] == 1 and hub.leases.pending_groups("n") == len(lease["groups"]) - 1
    for n in range(5):
        hub.hello({**hi, "name": f"gone{n}"})
    assert len([k for k in hub.metrics() if k.startswith("remote/gone")]) == 5 * 3
    for name in list(hub.nodes):
        if name != "n":
            hub.nodes[name].seen -= hub_lib.PRUNE_LEASES * hub.leases.lease_s + 1
    assert hub.lease({**s, "version": 3})["leases"]
    hub.nodes["n"].seen -= hub_lib.PRUNE_LEASES * hub.leases.lease_s + 1  # gone too, but it holds a lease
    hub.expire()
    assert sorted(hub.nodes) == ["n"] and not any(k.startswith("remote/gone") for k in hub.metrics())
    live = __import__("dataclasses").replace(hub.nodes["n"], seen=time.monotonic())
    hub.nodes.update({f"x{i}": live for i in range(hub_lib.MAX_NODES)})
    with pytest.raises(wire.Rejected, match=f"at most {hub_lib.MAX_NODES} nodes at once; try again later"):
        hub.hello({**hi, "name": "one-more"})


def test_node_names_are_bounded_labels_and_sessions_cannot_be_taken():
    from jaxrl_llm.remote import hub as hub_lib

    hub, _ = _hub()
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    now = [0.0]
    hub.hellos.clock = lambda: now[0]
    for i in range(hub_lib.HELLO_BURST):  # new sessions per host: a burst, then one per HELLO_EVERY_S
        hub.hello({**hi, "name": "churn", "peer": f"ipv4:10.0.0.9:{4000 + i}"})
    with pytest.raises(wire.Rejected, match=r"too many new sessions from ipv4:10.0.0.9; try again in 10 s"):
        hub.hello({**hi, "name": "churn", "peer": "ipv4:10.0.0.9:5000"})
    hub.hello({**hi, "name": "other-host", "peer": "ipv4:10.0.0.8:4000"})
    now[0] = hub_lib.HELLO_EVERY_S
    hub.hello({**hi, "name": "churn", "peer": "ipv4:10.0.0.9:5001"})
    assert hub.refusals == {"throttled": 1}
    hub.nodes.clear()
    for bad in ("x" * 65, "a b", "a/b", "\u00e9t\u00e9", 7):
        with pytest.raises(PermissionError, match="node names are 1 to 64 characters"):
            hub.hello({**hi, "name": bad})
    names = [hub.hello({**hi, "name": n})["node"] for n in ("a", "a", "a-1", "a")]
    assert names == ["a", "a-1", "a-1-1", "a-2"] and len(hub.nodes) == 4  # unique, whatever the order
    me, other = hub.hello({**hi, "name": "me"}), hub.hello({**hi, "name": "other"})
    assert me["session"] != other["session"] and len(me["session"]) == 32
    mine = {k: me[k] for k in ("run_id", "node", "session")}
    assert hub.heartbeat(mine)["version"] == 3
    for forged in (dict(mine, node="other"), dict(mine, session=""), {k: mine[k] for k in ("run_id", "node")}):
        with pytest.raises(wire.Rejected, match="session key does not match"):
            hub.release(forged)  # nobody else's leases can be heartbeaten or released


def test_hub_plays_a_multi_turn_group_again_and_refuses_a_forged_observation():
    from jaxrl_llm.tasks import arithmetic
    from jaxrl_llm.tasks.tool_arithmetic import ToolArithmetic

    task = ToolArithmetic()
    hub, _ = _hub(task=task, max_new_tokens=task.max_answer_len)
    try:
        me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
        s = {k: me[k] for k in ("run_id", "node", "session")}

        def put(forge):
            lease = hub.lease({**s, "version": 3})["leases"][0]
            prompt = hub.producer.draw(1, lease["draw"])[0][0]
            # the warm start's trace of this prompt: two calls, their values as observations, the answer
            _, episode, keep = task.trace(arithmetic.decode(prompt))
            n, p = task.max_answer_len, task.max_prompt_len
            f = _group(rows=2, p=p, new=n, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
            f["tokens"][:, p:] = 0
            f["tokens"][:, p:p + len(episode)] = episode
            f["loss_mask"][:] = 0
            f["loss_mask"][:, p:p + len(episode)] = keep
            f["input_mask"] = (f["tokens"] > 0).astype(np.float32)
            f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
            f["rewards"] = np.ones(2, np.float32)
            if forge:  # the first observation's first digit, changed
                at = p + keep.index(0.0)
                f["tokens"][1, at] = 3 + (f["tokens"][1, at] - 2) % 10
            return hub.put_group({**s, "lease": lease["id"], "group": 0, "weights": _weights(hub, s),
                                  "table": wire.encode_group(wire.group_batch(f))})

        assert put(forge=False) == {"accepted": True}
        with pytest.raises(wire.Rejected, match="episode replay: the observation at token .* is not the environment's"):
            put(forge=True)
        assert hub.rejected == 1
        hub._replay = lambda *a: 1 / 0  # the learner's own environment fails: unverified, not held against the node
        assert put(forge=True) == {"accepted": True} and hub.replay_failures == 1 and hub.rejected == 1
    finally:
        task.close()


def test_remote_options_fail_at_start_up(tmp_path, monkeypatch, capsys):
    from jaxrl_llm.remote import node as sampler_node
    from jaxrl_llm import validation as V
    from jaxrl_llm.remote import mode as remote
    from jaxrl_llm.runtime import orchestrator

    c = orchestrator.default_config()
    c.remote.port = 70000
    assert V.check(c, V.flatten(orchestrator.rules(), "runtime."), "runtime.") == [
        "runtime.remote.port=70000: expected an integer in [0, 65535]"]
    c.remote.port = free_port()
    first = remote.serve(None, c.remote)
    try:
        with pytest.raises(ValueError, match=rf"runtime.remote.port={c.remote.port}: cannot serve on 127.0.0.1:"):
            remote.serve(None, c.remote)  # taken by the first
    finally:
        first.shutdown()
    for argv, why in ((["--learner=nohostport"], "expected HOST:PORT"), (["--learner=h:70000"], "expected HOST:PORT"),
                      (["--learner=h:1", "--cpu_devices=-1"], "--cpu_devices=-1: expected 0")):
        with pytest.raises(SystemExit):
            sampler_node.main(argv)
        assert why in capsys.readouterr().err
    assert sampler_node.main(["--learner=h:1", f"--tls_root_cert={tmp_path}/none.pem"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"jaxrl_llm.sampler_node: error: --tls_root_cert='{tmp_path}/none.pem' does not exist"
    assert "Traceback" not in err
    with pytest.raises(FileNotFoundError):
        sampler_node.main(["--learner=h:1", f"--tls_root_cert={tmp_path}/none.pem", "--verbose"])
    c = orchestrator.default_config()
    c.mode = "remote"
    orchestrator.validate(c)  # loopback: no token needed
    c.remote.host = "0.0.0.0"
    monkeypatch.delenv("JAXRL_REMOTE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="reachable beyond this machine: set a shared token"):
        orchestrator.validate(c)
    monkeypatch.setenv("JAXRL_REMOTE_TOKEN", "t")
    orchestrator.validate(c)
    c.remote.tls_cert = str(tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="needs both runtime.remote.tls_cert and runtime.remote.tls_key"):
        orchestrator.validate(c)
    c.remote.tls_key = str(tmp_path / "key.pem")
    with pytest.raises(ValueError, match="cert.pem' does not exist"):
        orchestrator.validate(c)


def _table(f: dict):
    """A group table of exactly the fields, dtypes and shapes in `f` (unlike `wire.encode_group`,
    which starts from a well-formed batch)."""
    import pyarrow as pa

    rows = [(n, x.dtype.name, list(x.shape), np.ascontiguousarray(x).tobytes()) for n, x in f.items()]
    return pa.Table.from_pylist([dict(zip(wire._SCHEMA.names, r)) for r in rows], schema=wire._SCHEMA)


_POISON = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38, "neg": -5, "big": 2**31 - 1}


def _mutate(f: dict, mutations) -> dict:
    """`f` with each (field, kind, u, v) applied: a field dropped, retyped, cut by a row or a
    column, or one value (at position u of its flat array) poisoned; an unknown field added."""
    f = dict(f)
    for field, kind, u, v in mutations:
        if field not in f:
            continue
        x = f[field]
        if kind == "drop":
            del f[field]
        elif kind == "dtype":
            f[field] = x.astype(np.float64 if x.dtype != np.float64 else np.int32)
        elif kind == "rows":
            f[field] = x[:-1] if v < 0.5 else np.concatenate([x, x[:1]])
        elif kind == "width" and x.ndim > 1:
            f[field] = x[:, 1:] if v < 0.5 else np.concatenate([x, x[:, :1]], 1)
        elif kind == "extra":
            f["logits"] = x
        elif kind in _POISON and x.size and x.dtype != bool:
            y = x.copy().reshape(-1)
            value = _POISON[kind]
            if np.issubdtype(y.dtype, np.integer):  # its own extremes: no float cast of inf or 3e38
                value = -1 if not np.isfinite(value) else int(min(max(value, -2**31), 2**31 - 1))
            y[min(int(u * y.size), y.size - 1)] = np.array(value).astype(y.dtype) if np.isfinite(value) else value
            f[field] = y.reshape(x.shape)
    return f


def test_fuzzed_groups_through_the_hub_never_stop_a_learner_step_and_no_refused_group_is_trained():
    """>= 500 groups with random fields missing, retyped or reshaped, NaN / inf / huge values at
    any position, rows and widths off by one, through `Hub.put_group`: the hub answers each one
    with acceptance or a `wire.Rejected` (never an internal error), refused groups never reach
    the queue, and every batch of accepted groups trains one real learner step with finite
    metrics and no skipped update."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    from jaxrl_llm.learner import learner as L
    from jaxrl_llm.parallel import sharding
    from jaxrl_llm.batch import TrajectoryBatch
    from jaxrl_llm.remote.mode import _widen

    hub, task = _hub(verify_fraction=0.0)
    mcfg, new = hub.producer.sampler.model_cfg, hub.producer.sampler.cfg.max_new_tokens
    c = L.default_config()
    c.num_minibatches, c.packing = 1, "off"
    lrn = L.Learner(mcfg, {"name": "ppo"}, c, mesh=sharding.make_mesh(devices=jax.devices()[:1]))
    state = [lrn.init(jax.random.key(0))]
    from jaxrl_llm.remote.throttle import Buckets

    hub.hellos = Buckets(10**6, 1.0)  # a node refused for an oversized group comes back as a new one
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    me = hub.hello({**hi, "name": "fuzz"})
    node = [{k: me[k] for k in ("run_id", "node", "session")}]
    weights = _weights(hub, node[0])
    seen = {"accepted": 0, "refused": 0, "steps": 0, "nodes_refused": 0}
    fields = sorted(wire.GROUP_FIELDS)
    mutation = st.tuples(st.sampled_from(fields), st.sampled_from(["drop", "dtype", "rows", "width", "extra",
                                                                   *_POISON]),
                         st.floats(0, 1), st.floats(0, 1))

    @settings(max_examples=500, deadline=None, derandomize=True, database=None)
    @given(st.lists(mutation, max_size=3), st.floats(0, 1))
    @example([("tokens", "width", 0.0, 0.9)], 0.5)  # rows wider than the run's: its node is refused for good
    def one(mutations, reward):
        s = node[0]
        lease = hub.lease({**s, "version": 3})["leases"][0]
        prompt = hub.producer.prompts(1, lease["draw"])[lease["groups"][0]]
        f = _group(rows=2, p=hub.max_width - new, new=new, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
        f["rewards"] = np.float32([reward, 1 - reward])
        queued = len(hub.queue)
        try:
            hub.put_group({**s, "lease": lease["id"], "group": lease["groups"][0], "weights": weights,
                           "table": _table(_mutate(f, mutations))})
            seen["accepted"] += 1
        except wire.Rejected as e:
            assert "internal error" not in str(e), (mutations, e)
            assert len(hub.queue) == queued
            seen["refused"] += 1
        if hub.nodes[s["node"]].refused:  # an oversized group: no honest node sends one
            seen["nodes_refused"] += 1
            me = hub.hello({**hi, "name": f"fuzz{seen['nodes_refused']}"})  # its name stays refused
            node[0] = {k: me[k] for k in ("run_id", "node", "session")}
            return
        hub.release(s)
        if len(hub.queue) == 2:
            got = []
            for _ in range(2):
                item = hub.queue.get(3)[0]
                hub.made_by.pop((item.origin.draw, *item.origin.groups))  # trained: out of the node's room
                got.append(item.batch)
            width = max(b.shape[1] for b in got)
            batch = TrajectoryBatch.concat([_widen(b, width, 0) for b in got])
            state[0], m = lrn.train_step(state[0], hub.producer.with_rewards(batch, np.asarray(batch.rewards)))
            m = jax.device_get(m)
            assert m["skipped_updates"] == 0 and all(np.isfinite(v).all() for v in jax.tree_util.tree_leaves(m)), m
            seen["steps"] += 1

    one()
    assert seen["accepted"] + seen["refused"] >= 500 and seen["refused"] >= 250 and seen["steps"] >= 20, seen
    assert seen["nodes_refused"] > 0 and hub.leases.pending_groups() == 0, seen  # their leases went back
