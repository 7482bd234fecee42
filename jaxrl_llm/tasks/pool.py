"""Worker processes that run reward checks with a hard per-item timeout.

Symbolic checkers (sympy behind math-verify) can take unbounded time on adversarial output,
and their own signal-based timeouts only work in a main thread, while samplers score from
worker threads. So checks run in separate processes. A job is a list of argument tuples (one
prompt group); one worker runs it item by item and reports each result as it finishes, so an
item that overruns is pinned down exactly: that worker is killed and replaced, the item scores
the default (counted), and the rest of the job goes on in the fresh worker. Jobs spread over
`workers` processes, so groups are checked in parallel while the sampler keeps decoding.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

READY_TIMEOUT_S = 300.0  # importing the checker (sympy) in a fresh worker, on a loaded machine

log = logging.getLogger(__name__)


class WorkerPool:
    """`submit(fn, items) -> Future[list[(value, error)]]`, `error` in {None, "timeout",
    "<ExcType>: msg"}; a failed item's value is `default`. `fn` must be picklable (a
    module-level function); `preload` modules are imported, and `warmup` = (fn, args) called,
    in each fresh worker before its clock starts (a checker's first call may build parsers);
    `setup` = (fn, args) is called first of all, before any import (`sandbox.isolate`: no
    network, a scratch directory); a worker whose setup raises does not start.
    Thread-safe. Workers start at once, in the background (importing a checker such as sympy
    takes seconds, better spent before the first batch is sampled); `close()` stops them."""

    def __init__(self, workers: int, timeout: float = 5.0, default: Any = 0.0, preload: Sequence[str] = (),
                 warmup: Optional[tuple] = None, setup: Optional[tuple] = None):
        if workers < 1:
            raise ValueError(f"a worker pool needs at least 1 worker; got {workers}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout}")
        self.workers, self.timeout, self.default, self.preload = workers, timeout, default, tuple(preload)
        self.warmup = warmup  # (fn, args): one call each fresh worker makes before its clock starts
        self.setup = setup  # (fn, args): what a fresh worker calls before anything else
        self.timeouts = self.errors = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, daemon=True, name=f"reward-worker-{i}")
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, items: Sequence[tuple]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
        self._jobs.put((fn, list(items), future))
        return future

    def map(self, fn: Callable, items: Sequence[tuple]) -> list:
        return self.submit(fn, items).result()

    def call(self, fn: Callable, *args):
        """One check: (value, error)."""
        return self.map(fn, [args])[0]

    def _count(self, error: str) -> None:
        with self._lock:
            if error == "timeout":
                self.timeouts += 1
            else:
                self.errors += 1

    def _serve(self) -> None:
        """One thread per worker process: takes jobs and runs them there, replacing the process
        when an item overruns."""
        proc = None
        try:
            try:
                proc = _Process(self.preload, self.warmup, self.setup)
            except Exception:  # tried again, and reported, with the first job
                proc = None
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fn, items, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    out, proc = self._run(proc, fn, items)
                    future.set_result(out)
                except BaseException as e:  # the worker could not be started: the caller sees why
                    future.set_exception(e)
                    proc = _kill(proc)
        finally:
            _kill(proc)

    def _run(self, proc, fn, items):
        out, i = [], 0
        while i < len(items):
            if proc is None:
                proc = _Process(self.preload, self.warmup, self.setup)
            proc.load(fn)
            proc.send(("items", items[i:]))
            while i < len(items):
                got = proc.receive(self.timeout)
                if got is None:  # overran (or died): kill it, score the default, go on in a fresh one
                    self._count("timeout")
                    out.append((self.default, "timeout"))
                    i += 1
                    proc = _kill(proc)
                    break
                value, error = got
                if error is not None:
                    self._count(error)
                    value = self.default
                out.append((value, error))
                i += 1
        return out, proc

    def close(self) -> None:
        with self._lock:
            self._closed, threads = True, self._threads
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            t.join(timeout=10)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Process:
    """One spawned worker and its pipe."""

    def __init__(self, preload: tuple, warmup: Optional[tuple] = None, setup: Optional[tuple] = None):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds JAX/XLA threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, preload, warmup, setup), daemon=True)
        self.proc.start()
        child.close()
        self.fn = None
        self._ready(f"a reward worker did not start (importing {', '.join(preload) or 'nothing'})")

    def load(self, fn) -> None:
        """Make `fn` the worker's check; unpickling it imports its module, off any item's clock."""
        if self.fn is not fn:
            self.send(("fn", fn))
            self._ready(f"a reward worker could not load the check {getattr(fn, '__qualname__', fn)!r}")
            self.fn = fn

    def _ready(self, what: str) -> None:
        got = self.receive(READY_TIMEOUT_S)
        if got != ("ready", None):
            self.proc.join(timeout=1)
            why = (got[1] if got else f"no answer within {READY_TIMEOUT_S:.0f} s" if self.proc.is_alive()
                   else f"it exited with code {self.proc.exitcode}")
            self.kill()
            raise RuntimeError(f"{what}: {why}")

    def send(self, msg) -> None:
        self.conn.send(msg)

    def receive(self, timeout: float):
        """The next message, or None if none came within `timeout` s or the worker died."""
        try:
            return self.conn.recv() if self.conn.poll(timeout) else None
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


def _kill(proc):
    if proc is not None:
        proc.kill()
    return None


def _worker(conn, preload: tuple, warmup: Optional[tuple], setup: Optional[tuple] = None) -> None:
    import importlib

    if setup is not None:
        try:
            setup[0](*setup[1])
        except Exception as e:  # the pool reports it: a worker that cannot be set up never runs an item
            conn.send(("setup", f"{type(e).__name__}: {e}"))
            return
    for m in preload:
        importlib.import_module(m)
    logging.disable(logging.WARNING)  # math-verify warns on every call that timeouts are ours
    if warmup is not None:
        try:
            warmup[0](*warmup[1])
        except Exception:  # a failing check is reported per item, not here
            pass
    conn.send(("ready", None))
    fn = None
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        except Exception as e:  # a check that cannot be unpickled here (e.g. its module fails to import)
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        if kind == "fn":
            fn = payload
            conn.send(("ready", None))
            continue
        for args in payload:
            try:
                conn.send((fn(*args), None))
            except Exception as e:
                conn.send((None, f"{type(e).__name__}: {e}"))
