"""Tools, sandboxed: what a multi-turn environment calls runs in a worker process
(`pool.WorkerPool`) with a hard timeout, no network, a scratch directory and memory and file-size
limits; its output is cut to a byte limit. A tool that raises, overruns or dies becomes a
`ToolResult` that says so, and is counted; it never stops the run.

No network: each fresh worker enters a network namespace of its own (`unshare(CLONE_NEWNET)`;
unprivileged, inside a user namespace), whose only interface is a loopback that is down, so every
connect fails at once, to 127.0.0.1 too. Where the kernel allows no namespace, the worker still
refuses Internet sockets at the Python level (`socket.socket` for AF_INET / AF_INET6 raises); the
runner reports which applies (`isolation`). Both apply where both can.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from jaxrl_llm.tasks.pool import WorkerPool

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")  # a tool worker's whole environment, with HOME and TMPDIR


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str  # the tool's output (cut to the limit), or what went wrong
    status: str  # ok | error | timeout
    seconds: float  # the call's time in the worker (the timeout for one that overran)


def _unshare_network() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET):  # root, then unprivileged
        if libc.unshare(flags) == 0:
            return True
    return False


def _guard_sockets() -> None:
    import socket

    real = socket.socket

    class NoInternet(real):
        def __init__(self, family=-1, *args, **kwargs):
            if family in (-1, socket.AF_INET, socket.AF_INET6):
                raise PermissionError("tools have no network (sandbox)")
            super().__init__(family, *args, **kwargs)

    socket.socket = NoInternet
    socket.create_connection = lambda *a, **k: NoInternet()  # noqa: E731


def _wipe_start_environment() -> None:
    """/proc/self/environ shows the environment a process started with (here: the learner's,
    passed on by spawn), whatever os.environ holds later; zero those bytes once os.environ no
    longer points at them."""
    import ctypes

    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: proc(5) fields 50 and 51
    if 0 < start < end:
        ctypes.memset(start, 0, end - start)


def isolate(scratch_root: str, memory_mb: int, file_mb: int) -> None:
    """A fresh tool worker's setup: no network, cwd/HOME/TMPDIR in a new directory under
    `scratch_root`, an environment of ENV_KEPT only, address space and file size limits."""
    import resource

    netns = _unshare_network()
    _guard_sockets()
    scratch = tempfile.mkdtemp(prefix="tool_", dir=scratch_root)
    os.chdir(scratch)
    keep = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    os.environ.clear()  # nothing of the run's environment (its token, keys, paths) reaches tool code
    _wipe_start_environment()
    os.environ.update(keep, HOME=scratch, TMPDIR=scratch, JAXRL_TOOL_NETNS="1" if netns else "0")
    tempfile.tempdir = scratch
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    if file_mb:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))


def _call(tool: Callable, limit: int, *args):
    """In the worker: the tool's output as text, cut to `limit` bytes, and its seconds."""
    t = time.perf_counter()
    out = str(tool(*args))
    return cut(out, limit), time.perf_counter() - t


def cut(text: str, limit: int) -> str:
    """`text` within `limit` UTF-8 bytes; a cut one ends saying how much was dropped."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    note = f"\n[... {len(data) - limit} more bytes cut]"
    return data[:max(limit - len(note), 0)].decode("utf-8", "ignore") + note


def _network_probe() -> str:
    return os.environ.get("JAXRL_TOOL_NETNS", "?")


class ToolRunner:
    """`submit(tool, [args, ...]) -> Future[list[ToolResult]]` (one job, e.g. one turn's calls);
    `run(tool, *args) -> ToolResult`. `tool` is a module-level function (it is pickled to the
    workers) returning text. Counters: `calls`, `errors`, `timeouts`, `seconds`. `close()`
    stops the workers and removes their scratch directories."""

    def __init__(self, workers: int = 1, timeout: float = 5.0, max_output_bytes: int = 4096, memory_mb: int = 2048,
                 file_mb: int = 64):
        if max_output_bytes < 64:
            raise ValueError(f"max_output_bytes must be >= 64 (room for the cut note); got {max_output_bytes}")
        self.timeout, self.limit = timeout, max_output_bytes
        self.scratch = tempfile.mkdtemp(prefix="jaxrl_tools_")
        self._pool = WorkerPool(workers, timeout=timeout, default=None,
                                setup=(isolate, (self.scratch, memory_mb, file_mb)))
        self._lock = threading.Lock()
        self.calls = self.errors = self.timeouts = 0
        self.seconds = 0.0

    @property
    def isolation(self) -> str:
        """"netns" (own network namespace and the socket guard) or "socket-guard" (the guard alone)."""
        return "netns" if self._pool.call(_network_probe)[0] == "1" else "socket-guard"

    def submit(self, tool: Callable, args_list: Sequence[tuple]) -> Future:
        inner = self._pool.submit(_call, [(tool, self.limit, *args) for args in args_list])
        outer: Future = Future()
        inner.add_done_callback(lambda f: self._finish(f, outer))
        return outer

    def run(self, tool: Callable, *args) -> ToolResult:
        return self.submit(tool, [args]).result()[0]

    def _finish(self, inner: Future, outer: Future) -> None:
        try:
            results = [self._result(value, error) for value, error in inner.result()]
        except BaseException as e:  # the workers could not start: every call of the job failed
            results = None
            outer.set_exception(e)
        if results is not None:
            outer.set_result(results)

    def _result(self, value, error) -> ToolResult:
        if error is None:
            result = ToolResult(value[0], "ok", value[1])
        elif error == "timeout":
            result = ToolResult(f"tool timed out after {self.timeout:g} s", "timeout", self.timeout)
        else:
            result = ToolResult(cut(f"tool error: {error}", self.limit), "error", 0.0)
        with self._lock:
            self.calls += 1
            self.errors += result.status == "error"
            self.timeouts += result.status == "timeout"
            self.seconds += result.seconds
        return result

    def close(self) -> None:
        self._pool.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
