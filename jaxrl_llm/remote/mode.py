"""The remote mode (`runtime.mode="remote"`): the learner trains on what sampler nodes on other
machines send (`python -m jaxrl_llm.sampler_node --learner=HOST:PORT`, `docs/sampler_nodes.md`).

The learner serves (`service.py`, Arrow Flight) from its first run() call to the end of the
run, across eval and checkpoint boundaries, so nodes keep generating while it evaluates or
saves. Nodes lease prompt draws (`leases.py`), fetch each newest version of the weights, and
upload scored groups; the `Hub` checks them and feeds the same `VersionedQueue`, staleness
policies (`drop`, `keep`, `admit`: issuing a lease is the admission gate) and data position as
local async samplers (worker 0's stream: switching between async and remote keeps it). What
was queued or leased but not trained when the learner stops is generated again after a resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

import jax
import numpy as np

from jaxrl_llm import staleness
from jaxrl_llm import validation as V
from jaxrl_llm.parallel import distributed, preemption
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.runtime import dynamic
from jaxrl_llm.runtime.admission import Admission
from jaxrl_llm.remote.hub import STREAM, Hub
from jaxrl_llm.remote.leases import Leases
from jaxrl_llm.runtime.modes import Context, QueueFed, Spec, register
from jaxrl_llm.runtime.queue import QueueTimeout, VersionedQueue

TOKEN_ENV = "JAXRL_REMOTE_TOKEN"
# `runtime.remote`: the learner's service for sampler nodes. Beyond loopback it needs the token
# (or JAXRL_REMOTE_TOKEN); tls_cert / tls_key: PEM files for TLS. lease_s: a lease lives that
# long past a node's last heartbeat; stall_s: a node that delivers no group for that long loses
# its leases though it heartbeats.
SECTION = V.Section(host=("127.0.0.1", V.text()), port=(8815, V.integer(0, high=65535)), token=("", V.anything()),
                    lease_s=(30.0, V.positive()), stall_s=(600.0, V.positive()), verify_fraction=(0.05, V.unit()),
                    max_mismatch=(0.1, V.unit()), chunk_mb=(16, V.integer(1)), tls_cert=("", V.anything()),
                    tls_key=("", V.anything()))
POLL_S = 0.05
WAIT_LOG_S = 10.0  # how often a learner with no data says what it waits for
log = logging.getLogger("jaxrl_llm.remote")


class RemoteMode(QueueFed):
    """A mode fed by sampler nodes; `close()` ends the service."""

    def __init__(self, ctx: Context):
        super().__init__(ctx, ctx.cfg.prompts_per_batch)  # queue entries (prompt groups) per learner batch
        self.cfg, self.producer = ctx.cfg, ctx.producer
        self.node_config = node_config(ctx)
        self.hub: Optional[Hub] = None  # process 0's
        self.gate, self._gated = None, None  # dynamic sampling: the hub's gate, its totals at the last step
        self.service = None
        self._version = -1  # the version of the batch in hand

    @property
    def reward_failures(self) -> int:
        return sum(n.reward_failures for n in self.hub.nodes.values()) if self.hub else 0

    def start(self) -> None:
        if self.hub is None and distributed.is_main():
            self._serve()
        super().start()

    def _serve(self):
        c, r, ctx = self.cfg, self.cfg.remote, self.ctx
        admit = c.staleness_policy == "admit"
        self.admission = Admission(c.max_staleness, self.items * distributed.count()) if admit else None
        queue = VersionedQueue(1 << 20, None if c.max_staleness < 0 else c.max_staleness, c.staleness_policy,
                               on_drop=self._dropped)  # bounded by the leases the hub issues
        capacity = max(c.queue_size, c.max_staleness + 1 if admit else 0) * self.items * distributed.count()
        leases = Leases(ctx.position.todo(STREAM), r.lease_s, stall_s=r.stall_s)
        self.gate = dynamic.Gate(self.producer.group_size, c.dynamic_min_std,
                                 c.dynamic_max_draws * c.prompts_per_batch) if c.dynamic_sampling else None
        self.hub = Hub(self.producer, ctx.store, leases, queue, c, self.node_config, self.admission,
                       capacity=capacity, lengths=ctx.lengths, gate=self.gate,
                       consumed=lambda origin: ctx.position.deliver(*origin))
        self.service = serve(self.hub, r)
        log.warning("serving sampler nodes: python -m jaxrl_llm.sampler_node --learner=%s", self.service.address)

    def _dropped(self, item) -> None:
        self.hub.made_by.pop((item.origin.draw, *item.origin.groups), None)
        self.ctx.on_drop(item)

    def _take(self, version: int):
        """This process's rows of the next batch. With many learner processes, process 0 alone
        serves nodes: it takes every process's groups and broadcasts them (one shape header,
        then the arrays), and each process keeps its own `items` groups."""
        n = distributed.count()
        got = self._wait(version, self.items * n) if self.hub is not None else self._wait_for_main()
        if n == 1:
            batch = self._assemble(got)
        else:
            if self.hub is not None:
                preemption.agree(1)
            batch = _broadcast_batch(self._assemble(got) if got else None)
            rows = batch.shape[0] // n
            i = distributed.index()
            batch = jax.tree.map(lambda x: x[i * rows:(i + 1) * rows], batch)
        self._version = version
        return got, batch

    def _assemble(self, got) -> TrajectoryBatch:
        width = max(r.batch.shape[1] for r in got)
        pad = self.producer.sampler.cfg.pad_token_id
        batch = TrajectoryBatch.concat([_widen(r.batch, width, pad) for r in got])
        return self.producer.with_rewards(batch, np.asarray(batch.rewards))  # advantages within each group

    def _wait_for_main(self) -> list:
        """Processes other than 0: poll (one small collective each) until process 0 has a batch."""
        while not preemption.agree(0)[0] & 1:
            pass
        return []

    def _wait(self, version: int, items: int) -> list:
        """`items` acceptable groups from the queue (process 0); says what it waits for."""
        t0, said, got, hub = time.perf_counter(), time.monotonic(), [], self.hub
        while len(got) < items:
            hub.expire()
            held = self.admission is not None and not got and not self.admission.ready(version, len(hub.queue), items)
            if not held:
                try:
                    got.append(hub.queue.get(version, timeout=POLL_S)[0])
                    continue
                except QueueTimeout:
                    pass
            else:
                time.sleep(POLL_S)
            preemption.agree(0)  # the other processes poll with us; a preemption ends the wait
            if time.monotonic() - said > WAIT_LOG_S:
                said = time.monotonic()
                nodes = hub.live()
                log.warning("waiting %.0f s for %d more prompt groups at version %d: %s", time.perf_counter() - t0,
                            items - len(got), version,
                            f"{nodes} sampler node(s) connected" if nodes else
                            f"no sampler node connected (python -m jaxrl_llm.sampler_node "
                            f"--learner={self.service.address})")
        return got

    def _queue_depth(self):
        return None if self.hub is None else len(self.hub.queue)

    def _served(self, batch, elapsed) -> dict:
        if self.hub is None:
            return {}
        m = self.hub.metrics()
        by_node = {}
        for r in self._got:  # each node's staleness in this step
            node = self.hub.made_by.pop((r.origin.draw, *r.origin.groups), "?")
            by_node.setdefault(node, []).append(self._version - staleness.oldest_version(r.batch.versions,
                                                                                         r.batch.loss_mask))
        m.update({f"remote/{node}/staleness": float(np.mean(d)) for node, d in by_node.items()})
        if self.gate is not None:
            filtered, self._gated = dynamic.gate_metrics([self.gate], self._gated, self.cfg.prompts_per_batch)
            m.update(filtered)
        m["remote/origins"] = [[r.origin.draw, *r.origin.groups] for r in self._got]
        return m

    def close(self) -> None:
        if self.service is not None:
            self.hub.release_all()
            self.service.close()
            self.service = None


def node_config(ctx: Context) -> dict:
    """What a node is told (the token and the service's settings are not): the caller's part
    (the task and where the model comes from) and the sampler, model, runtime and adapters."""
    learner, sampler, c = ctx.learner, ctx.producer.sampler, ctx.cfg
    m = learner.model_cfg
    return dict(ctx.node_config or {}, model=dataclasses.asdict(sampler.model_cfg),
                sampler=dataclasses.asdict(sampler.cfg),
                runtime={k: v for k, v in c.to_dict().items() if k != "remote"},
                lora=dict(rank=m.lora_rank, alpha=m.lora_alpha, targets=list(m.lora_targets))
                if learner.publishes_adapters else None)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(hub, r):
    """The learner's service for remote section `r`; a port it cannot take is named."""
    from jaxrl_llm.remote.service import Service  # pyarrow.flight only where it serves

    try:
        return Service(hub, r.host, r.port, token(r), tls(r))
    except Exception as e:  # pyarrow says only "Server did not start properly"
        raise ValueError(f"runtime.remote.port={r.port}: cannot serve on {r.host}:{r.port} (in use, or not an "
                         f"address of this machine): {str(e).splitlines()[0]}") from None


def validate(r) -> None:
    """The remote section's cross-field rules (start-up)."""
    if r.host not in LOOPBACK and not token(r):
        raise ValueError(f"runtime.remote.host={r.host!r} is reachable beyond this machine: set a shared token "
                         f"(--config.runtime.remote.token or {TOKEN_ENV}) that sampler nodes must present")
    if bool(r.tls_cert) != bool(r.tls_key):
        raise ValueError("TLS needs both runtime.remote.tls_cert and runtime.remote.tls_key (PEM files)")
    for f in (r.tls_cert, r.tls_key):
        if f and not os.path.isfile(f):
            raise ValueError(f"runtime.remote TLS file {f!r} does not exist")


register("remote", Spec(RemoteMode, concurrent=True, section=SECTION, validate=lambda c, batching: validate(c.remote)))

_DTYPES = (np.int32, np.float32, np.bool_)


def _broadcast_batch(batch: Optional[TrajectoryBatch]) -> TrajectoryBatch:
    """Process 0's host batch on every process (the others pass None): a header of dtypes and
    shapes first, so the others can offer arrays of the same shapes to the broadcast."""
    fields = list(TrajectoryBatch.__dataclass_fields__)
    head = np.full((len(fields), 5), -1, np.int64)  # per field: dtype index (-1: absent), ndim, shape
    if batch is not None:
        for i, f in enumerate(fields):
            x = getattr(batch, f)
            if x is not None:
                x = np.asarray(x)
                head[i, :2] = _DTYPES.index(x.dtype.type), x.ndim
                head[i, 2:2 + x.ndim] = x.shape
    head = np.asarray(distributed.broadcast(head))
    present = [(f, h) for f, h in zip(fields, head) if h[0] >= 0]
    if batch is None:
        arrays = {f: np.zeros(h[2:2 + h[1]], _DTYPES[h[0]]) for f, h in present}
    else:
        arrays = {f: np.asarray(getattr(batch, f)) for f, _ in present}
    out = distributed.broadcast(arrays)
    return TrajectoryBatch(**{f: np.asarray(out[f]) if f in out else None for f in fields})


def token(r) -> str:
    """The shared token of remote section `r`: its own, else the environment's."""
    return r.token or os.environ.get(TOKEN_ENV, "")


def tls(r):
    """(certificate PEM, key PEM) of remote section `r`, or None."""
    if not r.tls_cert:
        return None
    with open(r.tls_cert, "rb") as c, open(r.tls_key, "rb") as k:
        return c.read(), k.read()


def _widen(batch: TrajectoryBatch, width: int, pad_id: int) -> TrajectoryBatch:
    """Right-pad a host group to `width` tokens (static batching pads prompts per draw)."""
    extra = width - batch.shape[1]
    if not extra:
        return batch
    fill = {"tokens": pad_id, "versions": -1}

    def pad(name, x):
        if x is None or np.ndim(x) < 2:
            return x
        return np.pad(np.asarray(x), [(0, 0), (0, extra)] + [(0, 0)] * (np.ndim(x) - 2),
                      constant_values=fill.get(name, 0))

    return batch.replace(**{f: pad(f, getattr(batch, f)) for f in batch.__dataclass_fields__})
