"""A sampler node: generates for a learner on another machine (`runtime.mode=remote`).

    python -m jaxrl_llm.sampler_node --learner=HOST:PORT [--token=T] [--name=N] [--tls_root_cert=PEM]

Everything else comes from the learner: the model and sampling config, the task (the node
builds it from the same config: an embedded task needs nothing, a dataset task its files at the
same path), and each newest version of the weights. The node runs on its own local devices,
leases prompt draws, decodes them with static or continuous batching, scores them with the
task's scoring stage and uploads each group with its per-token versions. A background thread
heartbeats the leases and fetches every new version while decoding goes on; the slots swap to
it between batches (static) or segments (continuous, or static with
`runtime.refresh_mid_generation`), as local async samplers do. If the learner goes away, the
node drops its work and says hello again until a learner answers (a restarted one resumes its
data position; nothing leased before is trained). SIGTERM returns the leases at once. For
`task.name=agent` the node hosts a gateway on its own loopback and plays the agents itself
(docs/agents.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import threading
import time
import types

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

import jaxrl_llm
from jaxrl_llm import models, tasks, validation
from jaxrl_llm.gateway import agents, tally
from jaxrl_llm.models import lora
from jaxrl_llm.rollout import SamplerConfig, backend
from jaxrl_llm.remote import wire
from jaxrl_llm.remote.client import Client
from jaxrl_llm.remote.hub import STREAM
from jaxrl_llm.runtime.producer import Producer

POLL_S = 0.2  # heartbeat and newest-version poll
LOG_EVERY_S = 10.0  # how often a node that lost its learner says so
RELEASE_S = 5.0  # how long a stopping node waits for the learner to take its leases back
AHEAD = 8  # leases held ready, asked for in one call: what a slow link's round trip must cover
log = logging.getLogger("jaxrl_llm.sampler_node")


class LearnerLost(Exception):
    """The learner stopped answering, or restarted (its run id changed)."""


class Node:
    def __init__(self, address: str, token: str = "", name: str = "", tls_root_cert: bytes = None,
                 retry_s: float = 1.0):
        self.client = Client(address, token, tls_root_cert, timeout=30.0)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.retry_s, self.stopping = retry_s, threading.Event()
        self.parts, self.session, self.producer, self.lost = None, None, None, None
        self.uploaded = self.rejected = self.sessions = 0
        self.refused = None  # the learner's refusal, which ends the node
        # Built from a learner's hello (`_build`: kept while its config stays the same)
        self.like = self.like_adapters = self.lora = self._merge = None
        self.mid = False
        # Per session (`_session`): leases, time, the weights decoded with (and each version's
        # fingerprint), LoRA's base, the hand-over queues of its threads
        self.leased, self.busy_s, self.t0 = {}, 0.0, 0.0
        self.fingerprints, self.base_crcs, self.base = {}, ([], 0), None
        self.version, self.params, self.latest = -1, None, (-1, None)
        self.outbox, self.ready = queue.Queue(), queue.Queue()

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Serve learners until stopped: a lost learner is looked for again every `retry_s`."""
        lost_since = said = None
        while not self.stopping.is_set():
            try:
                self._session()
            except Exception as e:  # Flight errors, LearnerLost, a refusal (re-raised)
                if _refused(e):
                    raise
                if self.stopping.is_set():
                    break
                now = time.monotonic()
                if lost_since is None or now - said >= LOG_EVERY_S:  # first, then every LOG_EVERY_S
                    lost_since, said = lost_since or now, now
                    log.warning("learner at %s unavailable for %.0f s (%s); retrying every %g s", self.client.address,
                                now - lost_since, str(e).splitlines()[0][:200], self.retry_s)
                time.sleep(self.retry_s)
            else:
                lost_since = None

    def stop(self, release: bool = True) -> None:
        """Stop; with `release` the leases go back to the learner at once (within RELEASE_S: a
        learner that is itself going away may not answer)."""
        self.stopping.set()
        s = self.session
        if release and s is not None:
            try:
                self.client.call("release", timeout=RELEASE_S, **s)
            except Exception:  # the learner may be gone; its leases then expire
                pass

    def close(self) -> None:
        """End the scoring stage (e.g. the math task's checker processes)."""
        if self.producer is not None:
            self.producer.scorer.close()
            if isinstance(self.producer.task, agents.AgentTask):  # its gateway and agent processes
                self.producer.task.close()
            self.producer = None

    def _session(self):
        hello = self.client.call("hello", protocol=wire.PROTOCOL, package=jaxrl_llm.__version__, name=self.name)
        self._build(hello)
        self.session = s = {"run_id": hello["run_id"], "node": hello["node"], "session": hello["session"]}
        self.sessions += 1
        self.lost, self.leased, self.busy_s, self.t0 = None, {}, 0.0, time.monotonic()
        self.fingerprints, self.base_crcs = {}, ([], 0)  # version -> what it loaded; LoRA's base chunks
        if self.lora:
            manifest = self.client.call("manifest", part="base", **self.session)
            base, crcs = self.client.fetch_weights(manifest, self.like)
            self.base, self.base_crcs = jax.device_put(base), (crcs, manifest["nbytes"])
            log.info("fetched the LoRA base (%.1f MB)", manifest["nbytes"] / 1e6)
        self.version, self.params = self._fetch()
        self.latest = (self.version, self.params)
        log.warning("node %s joined the learner at %s (version %d)", s["node"], self.client.address, self.version)
        self.outbox, self.ready = queue.Queue(), queue.Queue()
        helpers = [threading.Thread(target=self._guarded, args=(f,), daemon=True, name=f.__name__)
                   for f in (self._beat, self._send, self._lease_ahead)]
        for t in helpers:
            t.start()
        try:
            if self.producer.streams:
                self._stream()
            else:
                self._batches()
        finally:
            self.lost = self.lost or LearnerLost("session ended")
            for t in helpers:
                t.join(timeout=10)
        if self.refused is not None:
            raise self.refused
        if not self.stopping.is_set():
            raise self.lost

    def _build(self, hello):
        """Task, sampler and producer from the learner's config (kept while it stays the same)."""
        key = (repr(hello["model"]), repr(hello["sampler"]), repr(hello["task"]), repr(hello["runtime"]),
               repr(hello.get("lora")), repr(hello.get("agent")))
        if self.parts == key:
            return
        self.close()
        task_cfg = ml_collections.ConfigDict(hello["task"])
        task = tasks.make(task_cfg, hello["hf_path"])
        agent = hello.get("agent")
        if agent:  # `task.name=agent`: this node hosts a gateway on its loopback and plays the agents itself
            task = agents.AgentTask(task, agent["spec"], types.SimpleNamespace(
                **agent["settings"], host="127.0.0.1", port=0, token="", external=False))
        mcfg = models.ModelConfig.from_dict(hello["model"])
        # the learner's matmul precision, process-wide as the run applies it (run.xla.matmul_precision)
        jax.config.update("jax_default_matmul_precision", None if mcfg.matmul_precision == "default" else
                          mcfg.matmul_precision)
        devices = jax.local_devices()  # multi-turn episodes decode on one device, as in a run (`plan.resolve`)
        devices = devices[:1] if task_cfg.name in tasks.MULTI_TURN + ("agent",) else devices
        sampler = backend.make(mcfg, SamplerConfig(**_tuples(hello["sampler"])), Mesh(np.asarray(devices), ("data",)))
        scorer = tasks.scorer(task, task_cfg)
        if agent:  # sessions the task checks (an agent's None) are scored by this stage too
            task.scorer = scorer
        self.producer = Producer(sampler, task, ml_collections.ConfigDict(hello["runtime"]), scorer)
        self.like = jax.eval_shape(lambda: models.init_params(mcfg, jax.random.key(0)))
        self.lora = hello.get("lora")  # LoRA: the base is fetched once, each version's adapters merged here
        if self.lora:
            lcfg = mcfg.replace(lora_rank=self.lora["rank"], lora_alpha=float(self.lora["alpha"]),
                                lora_targets=tuple(self.lora["targets"]))
            self.like_adapters = jax.eval_shape(lambda: lora.split(models.init_params(lcfg, jax.random.key(0)))[1])
            self._merge = jax.jit(lambda b, a: lora.merge(b, a, lcfg.lora_scale, mcfg.dtype))
        self.mid = bool(hello["runtime"].get("refresh_mid_generation"))
        self.parts = key

    # ------------------------------------------------------------------ weights and heartbeats

    def _call(self, action, **kw):
        if self.lost is not None or self.stopping.is_set():
            raise self.lost or LearnerLost("stopping")
        try:
            return self.client.call(action, **self.session, **kw)
        except Exception as e:
            if _refused(e):
                raise
            self.lost = LearnerLost(f"{action}: {str(e).splitlines()[0][:200]}")
            raise self.lost from e

    def _fetch(self):
        manifest = self.client.call("manifest", **self.session)
        t = time.perf_counter()
        if self.lora:
            adapters, crcs = self.client.fetch_weights(manifest, self.like_adapters)
            params = self.producer.sampler.place_params(self._merge(self.base, adapters))
        else:
            loaded, crcs = self.client.fetch_weights(manifest, self.like)
            params = self.producer.sampler.place_params(loaded)
        # What the groups decoded with this version say they used (the learner compares it with
        # what it published: weights that never arrived would otherwise pass for staleness).
        self.fingerprints[manifest["version"]] = wire.fingerprint(crcs + self.base_crcs[0],
                                                                  manifest["nbytes"] + self.base_crcs[1])
        for old in sorted(self.fingerprints)[:-64]:
            del self.fingerprints[old]
        log.info("fetched version %d (%.1f MB%s) in %.2f s", manifest["version"], manifest["nbytes"] / 1e6,
                 ", LoRA adapters" if self.lora else "", time.perf_counter() - t)
        return manifest["version"], params

    def _guarded(self, fn):
        """A helper thread's body: any failure ends the session (a refusal ends the node)."""
        try:
            fn()
        except LearnerLost:
            pass
        except Exception as e:
            if _refused(e):
                self.refused = e
            self.lost = self.lost or LearnerLost(f"{fn.__name__}: {str(e).splitlines()[0][:200]}")

    def _beat(self):
        """Heartbeats; each newer version is fetched here, beside decoding."""
        sent = self.producer.episode_totals()  # episodes (multi-turn, agents) count toward this learner from now
        agent = self.producer.task if isinstance(self.producer.task, agents.AgentTask) else None
        said = agent.counters() if agent is not None else None  # likewise its gateway's counters
        while self.lost is None and not self.stopping.is_set():
            busy = self.busy_s / max(1e-9, time.monotonic() - self.t0)
            totals, counts = self.producer.episode_totals(), agent.counters() if agent is not None else None
            episodes = (totals - sent).tolist() if self.producer.episodes else None
            gateway = None if agent is None else {  # the latencies since the last beat, the newest if too many
                "counts": (counts - said).tolist(), "ms": agent.latencies()[-tally.MAX_LATENCIES:].tolist()}
            r = self._call("heartbeat", version=self.version, busy=busy, episodes=episodes, gateway=gateway)
            sent, said = totals, counts  # answered: the learner has them
            if r["version"] > self.latest[0]:
                self.latest = self._fetch()
            time.sleep(POLL_S)

    def refresh(self):
        """Swap to the newest fetched weights (the sampler's refresh hook)."""
        if self.latest[0] > self.version:
            self.version, self.params = self.latest
            return self.latest
        return None

    # ------------------------------------------------------------------ generation

    def _lease_ahead(self):
        """Keep AHEAD leases ready for the slots (requested together: one round trip)."""
        while self.lost is None and not self.stopping.is_set():
            want = AHEAD - self.ready.qsize()
            got = self._call("lease", version=self.version, count=want)["leases"] if want > 0 else []
            for r in got:
                self.leased[r["draw"]] = r
                self.ready.put(r)
            if len(got) < want or want <= 0:
                time.sleep(POLL_S / 4)

    def _lease(self):
        """The next ready lease, or None."""
        try:
            return self.ready.get(timeout=POLL_S / 4)
        except queue.Empty:
            return None

    def _ended(self) -> bool:
        return self.lost is not None or self.stopping.is_set()

    def _todo(self):
        """Leased (draw, groups) for the slots; None while the learner has nothing to lease."""
        while not self._ended():
            lease = self._lease()
            yield None if lease is None else (lease["draw"], lease["groups"])
        while True:
            yield None

    def _stream(self):
        t = time.monotonic()
        for item, _, failures, _ in self.producer.stream(STREAM, self.params, self.version, self._todo(),
                                                         self.refresh, self._ended):
            self.busy_s += time.monotonic() - t
            draw, (group,) = item.origin.draw, item.origin.groups
            self._put(self.leased[draw], group, item.batch, failures)
            t = time.monotonic()

    def _batches(self):
        g = self.producer.group_size
        while not self._ended():
            lease = self._lease()
            if lease is None:
                continue
            t = time.monotonic()
            self.refresh()
            pending = self.producer.generate(self.params, self.version, STREAM + 1, lease["draw"],
                                             refresh=self.refresh if self.mid else None)
            batch, failures = pending.result()
            batch = jax.tree.map(np.asarray, batch)
            self.busy_s += time.monotonic() - t
            for k in lease["groups"]:
                self._put(lease, k, jax.tree.map(lambda x: x[k * g:(k + 1) * g], batch), failures)
                failures = 0

    def _put(self, lease, group, batch, failures):
        """Hand a scored group to the sender thread (decoding goes on while it uploads), with the
        fingerprint of each version's weights its tokens were sampled with."""
        used = np.unique(np.asarray(batch.versions)[np.asarray(batch.loss_mask) > 0]).tolist()
        weights = {str(v): self.fingerprints.get(v, "") for v in used}
        self.outbox.put((batch, {"lease": lease["id"], "group": group, "failures": failures, "weights": weights}))

    def _send(self):
        """Upload what the generation loop hands over, everything waiting in one stream."""
        while self.lost is None and not self.stopping.is_set():
            try:
                groups = [self.outbox.get(timeout=POLL_S)]
            except queue.Empty:
                continue
            while not self.outbox.empty():
                groups.append(self.outbox.get_nowait())
            results = self.client.put_groups(groups, **self.session)
            for (_, meta), r in zip(groups, results):
                if "rejected" in r:
                    self.rejected += 1
                    log.warning("group %d of lease %d rejected: %s", meta["group"], meta["lease"], r["rejected"][:300])
                else:
                    self.uploaded += 1


def _refused(e) -> bool:
    """Whether the learner refused this node for good (token, version, reward mismatch)."""
    return "refused:" in str(e)


def _tuples(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--learner", required=True, help="HOST:PORT of the learner's service")
    ap.add_argument("--token", default=os.environ.get("JAXRL_REMOTE_TOKEN", ""),
                    help="the learner's shared token (default: $JAXRL_REMOTE_TOKEN)")
    ap.add_argument("--name", default="", help="this node's name in the learner's metrics")
    ap.add_argument("--tls_root_cert", default="", help="PEM certificate of a TLS learner (e.g. self-signed)")
    ap.add_argument("--cpu_devices", type=int, default=0, help="CPU devices to expose to JAX (0: JAX's default)")
    ap.add_argument("--retry_s", type=float, default=1.0, help="seconds between tries to reach a lost learner")
    ap.add_argument("--verbose", action="store_true", help="print a start-up refusal with its traceback")
    a = ap.parse_args(argv)
    host, _, port = a.learner.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        ap.error(f"--learner={a.learner!r}: expected HOST:PORT with a port in [1, 65535]")
    if a.cpu_devices < 0:
        ap.error(f"--cpu_devices={a.cpu_devices}: expected 0 (JAX's default) or a positive count")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s node %(message)s")
    if a.cpu_devices:
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)
    return validation.cli(lambda: _serve(a), a.verbose, "jaxrl_llm.sampler_node")


def _serve(a) -> int:
    """The node of parsed arguments `a`, until it is refused, stopped or loses for good."""
    if a.tls_root_cert and not os.path.isfile(a.tls_root_cert):
        raise FileNotFoundError(f"--tls_root_cert={a.tls_root_cert!r} does not exist")
    cert = open(a.tls_root_cert, "rb").read() if a.tls_root_cert else None
    node = Node(a.learner, a.token, a.name, cert, a.retry_s)

    def on_term(signum, frame):
        node.stop(release=True)
        node.close()
        log.warning("node %s: %s, leases returned; %d groups uploaded, %d rejected", node.name,
                    signal.Signals(signum).name, node.uploaded, node.rejected)
        os._exit(0)  # decoding threads and scorer processes end with the process

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    failed = []

    def work():
        try:
            node.run()
        except Exception as e:
            failed.append(e)

    worker = threading.Thread(target=work, name="node", daemon=True)
    worker.start()
    try:  # Python runs a signal's handler in the main thread between bytecodes: kept free here, it
        while worker.is_alive():  # returns the leases even while a Flight call to the learner hangs
            worker.join(0.5)
    finally:
        node.close()
    if failed:
        log.error("node %s stops: %s", node.name, failed[0])
        return 2
    return 0
