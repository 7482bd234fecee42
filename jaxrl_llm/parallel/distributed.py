"""Many hosts on JAX's own multi-controller runtime: one process per host, `jax.distributed`.

Everything that differs between one process and many lives here (and in `launch.py`):
start-up, turning process-local rows into one global batch, bringing global params back to a
process's own devices, and the small host-side reductions (metrics, "does every process have
a batch?"). With one process every function is the identity, so single-host code paths are the
same code.

Data stays local: each process draws its own prompts, samples and scores its own rows on its
own devices and computes group advantages locally (a group never straddles processes); the
learner's mesh spans every process's devices and sees the concatenation of all processes'
rows, in process order.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import validation as V

# Environment variables that mean "a multi-process launch": JAX's own, SLURM's, Open MPI's and
# a TPU pod's (where jax.distributed.initialize() auto-detects the rest).
_LAUNCH_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
               "MEGASCALE_COORDINATOR_ADDRESS")


SECTION = V.Section(  # all optional: nothing set and no launcher environment -> one process
    coordinator_address=("", V.text()),  # host:port of process 0 (e.g. 10.0.0.1:1234)
    num_processes=(0, V.integer(0)),  # 0: auto-detect (TPU pod, SLURM) or the environment
    process_id=(-1, V.integer(0, extra=(-1,))),  # -1: auto-detect
    local_device_ids=("", V.text()),  # comma-separated, e.g. "0,1"; empty: all of this host's
    heartbeat_timeout_s=(60, V.positive()),  # a process silent this long is declared dead; the others exit
    initialization_timeout_s=(300, V.positive()),
    cpu_batch_scheduling=(True, V.boolean()),  # on CPU (gloo): run under SCHED_BATCH, see `batch_scheduling`
)
default_config = SECTION.config
RULES = SECTION.rules


def wanted(cfg) -> bool:
    """Whether this run is multi-process: explicit values or a launcher's environment."""
    explicit = bool(cfg.coordinator_address) or cfg.num_processes > 1
    return explicit or any(k in os.environ for k in _LAUNCH_ENV)


def initialize(cfg) -> None:
    """Start the multi-controller runtime when asked (see `wanted`); a no-op otherwise. Must run
    before the first JAX computation. On CPU the collectives go through gloo, and the process
    runs under SCHED_BATCH (`batch_scheduling`) when the CPU is JAX's backend (`on_cpu`)."""
    if not wanted(cfg) or jax.distributed.is_initialized():
        return
    platforms = _platforms()
    if not platforms or "cpu" in platforms:  # CPU collectives, when any, go through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg.cpu_batch_scheduling and on_cpu():
        batch_scheduling()
    kw = dict(initialization_timeout=int(cfg.initialization_timeout_s),
              heartbeat_timeout_seconds=int(cfg.heartbeat_timeout_s))
    if cfg.coordinator_address:
        kw["coordinator_address"] = cfg.coordinator_address
    if cfg.num_processes > 0:
        kw["num_processes"] = int(cfg.num_processes)
    if cfg.process_id >= 0:
        kw["process_id"] = int(cfg.process_id)
    if cfg.local_device_ids:
        kw["local_device_ids"] = [int(i) for i in str(cfg.local_device_ids).split(",")]
    jax.distributed.initialize(**kw)


def _platforms() -> list:
    names = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    return [p.strip() for p in names.split(",") if p.strip()]


def on_cpu() -> bool:
    """Whether JAX's default backend will be the CPU, decided without starting a backend (which
    must wait for `jax.distributed.initialize`): the first platform named by JAX_PLATFORMS, or,
    when none is named, no accelerator plugin installed (JAX picks a GPU/TPU plugin when one is)."""
    platforms = _platforms()
    if platforms:
        return platforms[0] == "cpu"
    import importlib.metadata
    import importlib.util
    import pkgutil

    try:
        import jax_plugins
        plugins = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        plugins = []
    plugins += [e.value for e in importlib.metadata.entry_points(group="jax_plugins")]
    return not plugins and importlib.util.find_spec("libtpu") is None


ACCELERATOR_NODES = ("/dev/nvidia0", "/dev/accel0", "/dev/vfio/0")  # an NVIDIA GPU, a TPU (v4+ / older)


def backend_line(nodes=ACCELERATOR_NODES) -> tuple[str, Optional[str]]:
    """(what JAX runs on, for the start-up log; a warning or None). The warning says when an
    accelerator's device node exists but JAX's backend is the CPU and no JAX_PLATFORMS asked
    for it: a missing or shadowed CUDA / TPU plugin (e.g. torch's CUDA libraries installed over
    JAX's) would otherwise train on the CPU without a word."""
    devs = jax.devices()
    kinds = sorted({d.device_kind for d in devs})
    line = (f"backend {jax.default_backend()}: {len(devs)} device(s) ({', '.join(kinds)}), "
            f"{jax.local_device_count()} in this process")
    seen = [n for n in nodes if os.path.exists(n)]
    if jax.default_backend() != "cpu" or not seen or "cpu" in _platforms():
        return line, None
    return line, (f"{seen[0]} exists but JAX runs on the CPU: install the accelerator's JAX "
                  "(`pip install -e \".[gpu]\"` or `\".[tpu]\"`; docs/accelerators.md), or set JAX_PLATFORMS=cpu "
                  "to mean it")


def batch_scheduling() -> bool:
    """Put this thread, and so every thread JAX starts after it, under Linux's SCHED_BATCH
    (unprivileged; same share of the CPU, but a woken thread does not preempt a running one).

    Why: gloo's TCP I/O thread, woken by a peer's bytes, preempts the thread that is sending
    while that thread holds the connection's lock; the I/O thread then retries the lock from a
    level-triggered epoll loop, spinning until the scheduler tick (4 ms at HZ=250) hands the CPU
    back. Where no idle core is left for the I/O thread (a process on a core of its own, or
    busy cores), about every collective paid that tick, many times a small all-reduce's own cost
    (measured: experiments/README.md "Many hosts"). Returns whether the policy was set."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


def index() -> int:
    return jax.process_index()


def count() -> int:
    return jax.process_count()


def is_main() -> bool:
    """Process 0 writes logs, configs and reports."""
    return jax.process_index() == 0


def seed_ids(*ids: int) -> list:
    """Seed-sequence entries for process-local draws: process 0 draws exactly what a single
    process draws, every other process something of its own."""
    return [*ids, index()] if index() else list(ids)


# ---------------------------------------------------------------------- arrays


def global_batch(local, mesh, batch_spec: PartitionSpec):
    """Process-local rows -> one global array per leaf, rows split by `batch_spec` over `mesh`
    (the processes' rows concatenated in process order); scalars replicated."""
    def one(x):
        sh = NamedSharding(mesh, batch_spec if np.ndim(x) else PartitionSpec())
        if count() == 1:
            return jax.device_put(x, sh)
        return jax.make_array_from_process_local_data(sh, np.asarray(x))

    return jax.tree_util.tree_map(one, local)


def put_global(tree, shardings):
    """Host values every process holds in full (e.g. initial params) -> global arrays in
    `shardings` (one sharding or a matching tree)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, tree)

    def one(x, sh):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree_util.tree_map(one, tree, shardings)


_GATHER = {}


def to_local(tree):
    """Global arrays -> copies on this process's first device, by a jitted reshard (an
    all-gather where the learner shards them; nothing goes through the host). Every process
    must call it at the same point. The identity with one process."""
    if count() == 1:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mesh = leaves[0].sharding.mesh
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves), mesh)
    if key not in _GATHER:
        _GATHER[key] = jax.jit(lambda *xs: xs, out_shardings=NamedSharding(mesh, PartitionSpec()))
    return jax.tree_util.tree_unflatten(treedef, [x.addressable_data(0) for x in _GATHER[key](*leaves)])


def broadcast(tree):
    """Process 0's host values to every process (e.g. a warm start computed locally)."""
    if count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree)


# ---------------------------------------------------------------------- host reductions


def gather(x) -> np.ndarray:
    """[processes, ...] of a host value every process contributes (same shape everywhere)."""
    x = np.asarray(x)
    if count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x))


def host_sum(x):
    return gather(x).sum(0)


def agree(status: int) -> np.ndarray:
    """Every process's small status code (one collective); all processes must call it."""
    return gather(np.asarray(status, np.int32))

