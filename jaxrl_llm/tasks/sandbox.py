"""Tools, sandboxed: what a multi-turn environment calls runs in a worker process
(`pool.WorkerPool`) with a hard timeout, contained by `isolation` (no network, a private read-only
filesystem view with one writable scratch directory, its own PID namespace, no privileges,
process, memory and file-size limits) and an environment of ENV_KEPT only. Output is cut to a
byte limit twice: what the tool returns, and what anything in the worker writes to file
descriptors 1 and 2 (read from a pipe with a byte budget). Every process tool code started is
killed when its call returns, and all of them with the worker at a timeout or at close. A tool
that raises, overruns or dies becomes a `ToolResult` that says so, and is counted; it never
stops the run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from jaxrl_llm import validation
from jaxrl_llm.tasks import isolation
from jaxrl_llm.tasks.pool import WorkerPool

ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")  # a tool worker's whole environment, with HOME and TMPDIR


class SandboxError(validation.Refused):
    """The kernel gave a tool worker fewer isolation layers than the task requires."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str  # the tool's output (cut to the limit), or what went wrong
    status: str  # ok | error | timeout
    seconds: float  # the call's time in the worker (the timeout for one that overran)


def _wipe_start_environment() -> None:
    """/proc/self/environ shows the environment a process started with (here: the learner's,
    passed on by spawn), whatever os.environ holds later; zero those bytes once os.environ no
    longer points at them."""
    import ctypes

    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: proc(5) fields 50 and 51
    if 0 < start < end:
        ctypes.memset(start, 0, end - start)


def isolate(scratch_root: str, memory_mb: int, file_mb: int, processes: int = 32, *layers) -> None:
    """A fresh tool worker's setup: an environment of ENV_KEPT only, then `isolation.enter` with
    cwd/HOME/TMPDIR a new directory under `scratch_root`."""
    scratch = tempfile.mkdtemp(prefix="tool_", dir=scratch_root)
    keep = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    os.environ.clear()  # nothing of the run's environment (its token, keys, paths) reaches tool code
    _wipe_start_environment()
    os.environ.update(keep, HOME=scratch, TMPDIR=scratch)
    isolation.enter(scratch, memory_mb, file_mb, processes, *layers)
    tempfile.tempdir = scratch


class _FdOutput:
    """For one call: file descriptors 1 and 2 of this worker (and of every process tool code
    starts) write to a pipe, drained by a thread that keeps the first `limit` bytes."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.dropped = limit, bytearray(), 0
        sys.stdout.flush(), sys.stderr.flush()
        self._read, write = os.pipe()
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(write, 1), os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while chunk := os.read(self._read, 1 << 16):
            room = max(self.limit - len(self.kept), 0)
            self.kept += chunk[:room]
            self.dropped += max(len(chunk) - room, 0)

    def close(self) -> str:
        """What was written (the pipe's last writer is gone once tool processes are reaped)."""
        sys.stdout.flush(), sys.stderr.flush()
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        self._thread.join(timeout=2.0)  # a writer that outlived `reap` (no PID namespace) is cut off
        os.close(self._read)
        return bytes(self.kept).decode("utf-8", "replace")


def _call(tool: Callable, limit: int, *args):
    """In the worker: the tool's output as text (what it returned, then what was written to
    fds 1 and 2), cut to `limit` bytes, and its seconds. No process it started outlives it."""
    t = time.perf_counter()
    fds = _FdOutput(limit)
    try:
        out = str(tool(*args))
    finally:
        isolation.reap()
        written = fds.close()
    return cut(out + written, limit, fds.dropped), time.perf_counter() - t


def cut(text: str, limit: int, dropped: int = 0) -> str:
    """`text` within `limit` UTF-8 bytes; a cut one ends saying how many bytes were dropped
    (`dropped` of them before `text`)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit and not dropped:
        return text
    kept, note = data[:limit], ""
    for _ in range(3):  # the note's own length decides how much text fits beside it
        kept = data[:max(limit - len(note.encode()), 0)].decode("utf-8", "ignore").encode()
        note = f"\n[... {len(data) - len(kept) + dropped} more bytes cut]"
    return kept.decode() + note


def _layers_probe() -> tuple:
    return isolation.layers()


class ToolRunner:
    """`submit(tool, [args, ...]) -> Future[list[ToolResult]]` (one job, e.g. one turn's calls);
    `run(tool, *args) -> ToolResult`. `tool` is a module-level function (it is pickled to the
    workers) returning text. Counters: `calls`, `errors`, `timeouts`, `seconds`. `close()`
    stops the workers (and every process of theirs) and removes their scratch directories.
    With `require` (the default) the runner refuses, at once, a kernel that gives its workers
    fewer than `isolation.FULL` layers; `processes` bounds the tasks a worker's tool may run;
    `as_nobody` and `namespaces` as in `isolation.enter`."""

    def __init__(self, workers: int = 1, timeout: float = 5.0, max_output_bytes: int = 4096, memory_mb: int = 2048,
                 file_mb: int = 64, processes: int = 32, require: bool = True, as_nobody: bool = True,
                 namespaces: bool = True):
        if max_output_bytes < 64:
            raise ValueError(f"max_output_bytes must be >= 64 (room for the cut note); got {max_output_bytes}")
        self.timeout, self.limit = timeout, max_output_bytes
        self.scratch = tempfile.mkdtemp(prefix="jaxrl_tools_")
        self._pool = WorkerPool(workers, timeout=timeout, default=None,
                                setup=(isolate, (self.scratch, memory_mb, file_mb, processes, as_nobody, namespaces)))
        self._lock = threading.Lock()
        self.calls = self.errors = self.timeouts = 0
        self.seconds = 0.0
        layers = self.isolation
        logging.getLogger(__name__).info("tool workers contained by: %s", ", ".join(layers))
        missing = [layer for layer in isolation.FULL if layer not in layers] if require else []
        if missing:
            self.close()
            raise SandboxError(f"tool workers lack {', '.join(missing)} isolation here (the kernel refused "
                               f"namespaces); set task.tool_isolation=weak to run tools with a socket guard only")

    @property
    def isolation(self) -> tuple:
        """The layers a worker entered: `isolation.FULL` where the kernel allows, else ("socket-guard",)."""
        layers, error = self._pool.call(_layers_probe)
        if error is not None:
            raise SandboxError(f"a tool worker did not answer: {error}")
        return layers

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
