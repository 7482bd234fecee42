"""The learner's side of every sampler-node call (served by `service.py`): who is connected,
which prompts each node works on (`leases.py`), the newest weights as a chunked artifact, and
the checks every incoming group passes before it joins the learner's queue.

A group is accepted only if its node is known to this learner run (a node of a run that died
says hello again), it holds the group's lease, the group decodes to the declared fields
(`wire.decode_group`) and passes `wire.check_group`; with `verify_fraction`, the learner scores
that share of groups itself and refuses the rewards that differ (a multi-turn task's episodes
replayed against its environment: every observation must be its answer, `multiturn.replay`;
agents' prompts and rewards are their own, docs/agents.md). A node whose mismatch rate exceeds
`max_mismatch` (after `MIN_VERIFIED` checks) is refused from then on. Advantages are the
learner's own. Everything refused is counted, nothing refused is trained."""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import re
import secrets
import threading
import time
import uuid
from typing import Optional

import numpy as np

import jaxrl_llm
from jaxrl_llm import staleness, tasks
from jaxrl_llm.gateway.tally import Tally
from jaxrl_llm.remote import wire
from jaxrl_llm.remote.leases import LeaseError, Leases
from jaxrl_llm.runtime.producer import Origin, Producer, Rollout
from jaxrl_llm.runtime.queue import VersionedQueue
from jaxrl_llm.remote.throttle import Buckets
from jaxrl_llm.runtime.weights import WeightStore
from jaxrl_llm.tasks import envs, multiturn

log = logging.getLogger(__name__)

STREAM = 0  # the data position's stream the nodes share (draws are Producer.draw(STREAM + 1, d))
MIN_VERIFIED = 5
BASE = -2  # the artifact version of LoRA's frozen base (`manifest(part="base")`)
MAX_LEASES = 8  # per lease call
MAX_NODES, PRUNE_LEASES = 256, 4  # in the node table at once; nodes gone for PRUNE_LEASES lease periods leave it
HELLO_BURST, HELLO_EVERY_S = 16, 10.0  # new sessions per peer host: a burst, then one per period
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a node's display name: bounded, safe in metric keys and logs
# Why calls were refused (`remote/rejected/<reason>`): the service's (token, throttled, request)
# and the hub's (hello, session, refused node, lease, size, malformed group, weights, reward, internal).
REASONS = ("token", "throttled", "request", "hello", "session", "refused", "lease", "size", "malformed", "weights",
           "reward", "internal")


@dataclasses.dataclass
class NodeStats:
    name: str  # unique in this run
    asked: str  # the name it asked for
    peer: str
    joined: float
    seen: float
    version: int = -1  # the weights version it reported last
    busy: float = 0.0  # share of its time generating or scoring, as it reported
    groups: int = 0  # accepted
    rejected: int = 0
    verified: int = 0
    mismatched: int = 0
    reward_failures: int = 0
    refused: bool = False
    session: str = ""  # the random key hello gave this session; every later call must carry it


class Hub:
    def __init__(self, producer: Producer, store: WeightStore, leases: Leases, queue: VersionedQueue, cfg,
                 node_config: dict, admission=None, vocab: int = 0, capacity: int = 1, lengths=None,
                 gate=None, consumed=None):
        """`cfg`: the runtime section; `node_config`: what a node needs to build its task,
        model and sampler (`hello`); `capacity`: leased + queued groups allowed per live node;
        `gate` (`runtime.dynamic.Gate`): a group it stops goes to `consumed(origin)`, not the queue."""
        self.gate, self.consumed, self.producer, self.store = gate, consumed, producer, store
        self.leases, self.queue, self.cfg = leases, queue, cfg
        self.node_config, self.admission, self.capacity, self.lengths = node_config, admission, capacity, lengths
        self.vocab = vocab or producer.sampler.model_cfg.vocab_size
        self.run_id = uuid.uuid4().hex
        self.nodes: dict[str, NodeStats] = {}
        self.refusals: collections.Counter = collections.Counter()  # reason (REASONS) -> calls refused
        self.replay_failures = 0  # multi-turn groups left unverified
        self._refused: dict[str, str] = {}  # asked name -> why
        self._artifacts: collections.OrderedDict = collections.OrderedDict()  # version -> (manifest, buffer)
        self._packed: collections.OrderedDict = collections.OrderedDict()  # version -> (chunk CRCs, bytes)
        self._prompts: collections.OrderedDict = collections.OrderedDict()  # draw -> prompts
        self._lock = threading.RLock()  # `refuse` is called with it held
        self._rng = np.random.default_rng([cfg.seed, 31])
        self.made_by: dict[tuple, str] = {}  # (draw, group) queued -> its node, until trained or dropped
        sc = producer.sampler.cfg
        self.max_width = producer.prompt_width + sc.max_new_tokens  # no row a node sends is wider
        self.routing = wire.routing_spec(producer.sampler)  # the experts every group must carry, if any
        self.group_bytes = wire.max_group_bytes(producer.group_size, self.max_width, sc.capture_topk, self.routing)
        self.reward_range = tasks.reward_range(producer.task)
        self.agents = hasattr(producer.task, "rollouts")  # task.name=agent: rows open with what agents sent
        self.gateways = Tally()  # task.name=agent: the nodes' gateways' `gateway/*`
        self.hellos = Buckets(HELLO_BURST, HELLO_EVERY_S)

    rejected = property(lambda self: sum(self.refusals.values()), doc="calls refused, for any reason")

    def refuse(self, reason: str) -> None:
        """Count a refused call (the service counts its own through this too)."""
        with self._lock:
            self.refusals[reason] += 1

    def _refusal(self, e: Exception, reason: str) -> Exception:
        """`e`, counted under `reason` and marked so (the service counts what is not marked)."""
        self.refuse(reason)
        e.counted = True
        return e

    def check_session(self, req: dict) -> None:
        """A put stream's session, checked before the service reads its first group."""
        self._node(req)

    # ------------------------------------------------------------------ calls

    def hello(self, req: dict) -> dict:
        try:
            name = self._greet(req)
        except PermissionError as e:
            raise self._refusal(e, "hello")
        host = str(req.get("peer", "")).rsplit(":", 1)[0]
        if not self.hellos.take(host):  # a node refused for good cannot come back as a new one at will
            raise self._refusal(wire.Rejected(f"too many new sessions from {host[:80]}; try again in "
                                              f"{self.hellos.wait_s(host):.0f} s"), "throttled")
        with self._lock:
            if len(self.nodes) >= MAX_NODES:
                full = wire.Rejected(f"this learner serves at most {MAX_NODES} nodes at once; try again later")
                raise self._refusal(full, "hello")  # not a refusal for good: the node says hello again
            node, k = name, 1
            while node in self.nodes:  # a display label, unique in this run
                node, k = f"{name}-{k}", k + 1
            now = time.monotonic()
            self.nodes[node] = NodeStats(node, name, str(req.get("peer", ""))[:80], now, now,
                                         session=secrets.token_hex(16))
        return {"run_id": self.run_id, "node": node, "session": self.nodes[node].session,
                "version": self.store.latest()[0], "lease_s": self.leases.lease_s, **self.node_config}

    def _greet(self, req: dict) -> str:
        """The name a hello asks for, if this learner can take it; else PermissionError."""
        mine = {"protocol": wire.PROTOCOL, "package": jaxrl_llm.__version__}
        theirs = {k: req.get(k) for k in mine}
        if theirs != mine:
            raise PermissionError(f"this learner speaks protocol {mine['protocol']} (jaxrl_llm {mine['package']}); "
                                  f"the node {str(theirs['protocol'])[:20]} (jaxrl_llm {str(theirs['package'])[:20]})")
        name = req.get("name") or "node"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise PermissionError(f"node names are 1 to 64 characters of A-Z a-z 0-9 . _ -; got {str(name)[:80]!r}")
        if name in self._refused:  # saying hello again does not undo a refusal
            raise PermissionError(f"node {name!r} was refused earlier in this run: {self._refused[name]}")
        self._prune()
        return name

    def lease(self, req: dict) -> dict:
        """Up to `count` (at most MAX_LEASES) leases while the node's own room lasts (`capacity`
        groups leased or queued, so one node never takes another's) and the run's does: a node
        on a slow link leases ahead, or the round trip bounds its throughput."""
        n = self._node(req)
        self.expire()
        admit = None
        if self.admission is not None:
            admit = lambda v, groups: self.admission.try_admit(v, self.store.latest()[0], groups)  # noqa: E731
        out = []
        for _ in range(min(MAX_LEASES, max(1, int(req.get("count", 1))))):
            room = min(self.capacity - self.leases.pending_groups(n.name) - self._queued(n.name),
                       self.capacity * max(1, self.live()) - len(self.queue) - self.leases.pending_groups())
            x = self.leases.issue(n.name, int(req.get("version", -1)), admit) if room > 0 else None
            if x is None:
                break
            out.append({"id": x.id, "draw": x.draw, "groups": x.groups})
        return {"leases": out}

    def heartbeat(self, req: dict) -> dict:
        n = self._node(req)
        n.version, n.busy, episodes, gateway = wire.check_beat(req, len(envs.TOTALS))
        self.producer.add_episode_totals(episodes)  # the node's episodes since its last beat, if any
        self.gateways.add(gateway)  # and its gateway's counters and latencies, if any
        return {"version": self.store.latest()[0], "leases": self.leases.heartbeat(n.name)}

    def release(self, req: dict) -> dict:
        n = self._node(req)
        return {"released": len(self._revoke(self.leases.release(n.name)))}

    def manifest(self, req: dict) -> dict:
        """The newest version's artifact (LoRA: its adapters); `part="base"`: LoRA's frozen base,
        served as version BASE and fetched once per node session."""
        self._node(req)
        if req.get("part") == "base":
            return self._artifact((BASE, self.store.base()))[0]
        return self._artifact(self.store.publication())[0]

    def chunk(self, req: dict):
        try:
            with self._lock:
                art = self._artifacts.get(int(req["version"]))
            if art is None:
                raise KeyError(f"weights version {req['version']} is no longer served; fetch the newest manifest")
            c = art[0]["chunks"][int(req["chunk"])]
        except (ValueError, LookupError, TypeError) as e:
            raise self._refusal(e, "request")
        return memoryview(art[1])[c["offset"]:c["offset"] + c["nbytes"]]

    def put_group(self, req: dict) -> dict:
        n, lease = self._node(req), None
        try:
            lease_id, group = int(req["lease"]), int(req["group"])
            lease = self.leases.held(lease_id, n.name, group)
            wire.check_size(req["table"], self.group_bytes)  # before a byte of it is decoded
            f = wire.decode_group(req["table"])
            prompt = self._draw_prompts(lease.draw)[group]
            sc = self.producer.sampler.cfg
            wire.check_group(f, rows=self.producer.group_size, prompt=[] if self.agents else prompt,
                             vocab=self.vocab, topk=sc.capture_topk, max_new_tokens=sc.max_new_tokens,
                             learner_version=self.store.latest()[0], min_version=max(0, lease.version),
                             kept=sc.dist.truncated, max_width=self.max_width, reward_range=self.reward_range,
                             routing=self.routing)
            self._check_weights(req.get("weights"), f)
            if not self.agents and self._rng.random() < self.cfg.remote.verify_fraction:
                self._verify(n, prompt, f)
            self.leases.received(lease_id, n.name, group)
        except Exception as e:  # every path: counted, leased again at once (the node's beats would keep it held)
            n.rejected += 1
            if lease is not None and self.leases.give_back(lease.id, group) and self.admission is not None:
                self.admission.revoke(lease.version, 1)
            if getattr(e, "reason", "") == "size":  # no honest node sends more than its config allows
                self._refuse_node(n, "it sent a group larger than this run's groups can be")
            if not isinstance(e, (ValueError, LookupError, TypeError)):
                log.exception("a group from node %s failed on the learner", n.name)
                e = wire.Rejected(f"internal error on the learner ({type(e).__name__}); it is logged there", "internal")
            raise self._refusal(wire.Rejected(str(e)), _reason(e)) from None
        batch = wire.group_batch(f)  # advantages: once per learner batch (`RemoteMode`)
        n.groups += 1
        with self._lock:  # the service's threads; a group whose rewards are all equal is consumed, untrained
            if self.gate is not None and not self.gate.passes(batch):
                self.consumed(Origin(STREAM, lease.draw, (group,)))
                return {"accepted": True, "dropped": True}
        if self.lengths is not None:
            self.lengths.add("generated", batch)
        n.reward_failures += int(req.get("failures", 0))
        version = staleness.oldest_version(batch.versions, batch.loss_mask)
        self.made_by[lease.draw, group] = n.name
        self.queue.put(Rollout(Origin(STREAM, lease.draw, (group,)), batch), version, timeout=10.0)
        if self.admission is not None:
            self.admission.enqueued(lease.version)
        return {"accepted": True}

    # ------------------------------------------------------------------ learner side

    def expire(self) -> None:
        self._revoke(self.leases.expire())
        self._prune()

    def live(self, within: Optional[float] = None) -> int:
        """Nodes heard from within `within` seconds (default: one lease period)."""
        now, within = time.monotonic(), within or self.leases.lease_s
        return sum(1 for n in list(self.nodes.values()) if not n.refused and now - n.seen <= within)

    def release_all(self) -> None:
        self._revoke(self.leases.release())

    # ------------------------------------------------------------------ helpers

    def _node(self, req: dict) -> NodeStats:
        """The calling node, checked: this run's, known, its session key, not refused."""
        n = self.nodes.get(req.get("node")) if req.get("run_id") == self.run_id else None
        if n is None or not hmac.compare_digest(str(req.get("session", "")).encode(), n.session.encode()):
            why = ("this learner run does not know the node (it restarted): say hello again"
                   if req.get("run_id") != self.run_id else
                   f"unknown node {str(req.get('node'))[:80]!r}: say hello first" if n is None else
                   f"the session key does not match node {n.name!r}'s (hello gives each session its own)")
            raise self._refusal(wire.Rejected(why), "session")
        if n.refused:
            raise self._refusal(PermissionError(f"node {n.name} was refused: {self._refused[n.asked]}"), "refused")
        n.seen = time.monotonic()
        return n

    def _refuse_node(self, n: NodeStats, why: str) -> None:
        """Refuse node `n` for good (and its name for the rest of the run); its leases go back."""
        n.refused = True
        self._refused[n.asked] = why
        while len(self._refused) > 4096:  # bounded: the oldest refusals are forgotten first
            del self._refused[next(iter(self._refused))]
        self._revoke(self.leases.release(n.name))

    def _prune(self) -> None:
        """Nodes unheard for PRUNE_LEASES lease periods and holding no lease leave the table (and
        the metrics); a refused node's name stays refused."""
        now = time.monotonic()
        with self._lock:
            for name, n in list(self.nodes.items()):
                if now - n.seen > PRUNE_LEASES * self.leases.lease_s and not self.leases.pending_groups(name):
                    del self.nodes[name]

    def _queued(self, node: str) -> int:
        return sum(1 for v in list(self.made_by.values()) if v == node)

    def _revoke(self, leases) -> list:
        if self.admission is not None:
            for x in leases:
                if x.pending:
                    self.admission.revoke(x.version, len(x.pending))
        return leases

    def _draw_prompts(self, draw: int) -> list:
        with self._lock:
            if draw not in self._prompts:
                self._prompts[draw] = self.producer.prompts(STREAM + 1, draw)
                while len(self._prompts) > 256:
                    self._prompts.popitem(last=False)
            return self._prompts[draw]

    def _artifact(self, latest):
        version, params = latest
        with self._lock:
            if version not in self._artifacts:
                self._artifacts[version] = wire.pack_params(params, version, self.cfg.remote.chunk_mb << 20)
                manifest = self._artifacts[version][0]
                self._packed[version] = (wire.manifest_crcs(manifest), manifest["nbytes"])
                while len(self._packed) > 256:
                    self._packed.popitem(last=False)
                versions = [v for v in self._artifacts if v != BASE]  # the base stays for the run
                for old in versions[:-2]:  # the newest, and the one nodes may still be fetching
                    del self._artifacts[old]
            return self._artifacts[version]

    def _check_weights(self, claimed, f) -> None:
        """Each version a group's tokens name must come with the fingerprint of the weights the
        node loaded for it (`wire.fingerprint`), equal to what this learner published."""
        claimed = claimed if isinstance(claimed, dict) else {}
        for v in np.unique(f["versions"][f["loss_mask"] > 0]).tolist():
            with self._lock:
                mine = self._packed.get(v)
                base = self._packed.get(BASE, ([], 0)) if self.node_config.get("lora") else ([], 0)
            if mine is None:
                raise wire.Rejected(f"weights version {v} was not published to nodes by this learner run", "weights")
            want = wire.fingerprint(mine[0] + base[0], mine[1] + base[1])
            if claimed.get(str(v)) != want:
                raise wire.Rejected(f"the weights the node used for version {v} ({str(claimed.get(str(v)))[:40]}) are "
                                    f"not the ones published ({want})", "weights")

    def _verify(self, n: NodeStats, prompt, f) -> None:
        if self.producer.multi_turn:
            try:
                mine, problem = self._replay(prompt, f)
            except Exception as e:  # this learner's environment failed: the group goes unverified, not refused
                self.replay_failures += 1
                log.warning("could not replay a multi-turn group: %s: %s", type(e).__name__, e)
                return
        else:
            mine, _ = self.producer.scorer.submit([prompt], f["tokens"], f["loss_mask"] > 0, len(f["tokens"])).result()
            problem = None
        n.verified += 1
        if problem or not np.allclose(mine, f["rewards"], atol=1e-5):
            n.mismatched += 1
            if n.verified >= MIN_VERIFIED and n.mismatched > self.cfg.remote.max_mismatch * n.verified:
                self._refuse_node(n, f"{n.mismatched} of {n.verified} verified groups had differing rewards")
            raise wire.Rejected(problem or f"rewards {np.round(f['rewards'], 4).tolist()} differ from the learner's "
                                f"{np.round(mine, 4).tolist()}", reason="reward")

    def _replay(self, prompt, f):
        """A multi-turn group's episodes played again against this learner's environment
        (`multiturn.replay`): (rewards, the first difference or None)."""
        n = self.producer.sampler.cfg.max_new_tokens
        p = f["tokens"].shape[1] - n
        rewards = []
        for episode, obs in multiturn.episode_rows(f["tokens"], f["input_mask"], f["loss_mask"], p):
            reward, problem = multiturn.replay(self.producer.task, prompt, episode, obs, n)
            if problem:
                return None, f"episode replay: {problem}"
            rewards.append(reward)
        return np.asarray(rewards, np.float32), None

    def metrics(self) -> dict:
        m = {"remote/nodes": float(self.live()), "remote/rejected": float(self.rejected),
             **{f"remote/rejected/{r}": float(self.refusals[r]) for r in REASONS},
             "remote/leases_expired": float(self.leases.expired), "remote/leases_stalled": float(self.leases.stalled),
             "remote/refused": float(sum(n.refused for n in self.nodes.values())),
             "remote/replay_failures": float(self.replay_failures), **self.gateways.metrics()}
        latest = self.store.latest()[0]
        for n in list(self.nodes.values()):
            m.update({f"remote/{n.name}/groups": float(n.groups), f"remote/{n.name}/busy": n.busy})
            m[f"remote/{n.name}/lag"] = float(latest - n.version) if n.version >= 0 else float("nan")
            if n.verified:
                m[f"remote/{n.name}/mismatch"] = n.mismatched / n.verified
        return m


def _reason(e: Exception) -> str:
    """The REASONS entry a put_group failure counts under."""
    if isinstance(e, LeaseError):
        return "lease"
    if isinstance(e, wire.Rejected):
        return e.reason
    return "malformed" if isinstance(e, (ValueError, LookupError, TypeError)) else "internal"
