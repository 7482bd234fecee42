"""Where a run's agents play their sessions (`task.name=agent`, `gateway.agent_processes`):

  0  a thread of this process with an event loop of its own (`Runner`);
  N  N worker processes, each an event loop with concurrency / N sessions (`ProcessRunner`).

An agent's own CPU work is mostly its client's: the `openai` package builds, sends and parses
each request in Python (over half of this process's interpreter time with 64 sessions in a
thread, `experiments/results/bench_gateway_cpu.md`), time the slots' host loop and the gateway's
server then wait for. In worker processes it runs beside them instead. Either way a session is
`start(session, problem) -> Future[reward | None]`, failing with the agent's error.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import itertools
import multiprocessing
import queue
import threading
from concurrent.futures import Future
from typing import Callable


def load(spec: str) -> Callable:
    """`module:function` -> the agent coroutine function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"task.agent={spec!r}: name it as module:function (e.g. examples.calculator_agent:agent)")
    fn = getattr(importlib.import_module(module), name, None)
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"task.agent={spec!r} is not an async function (async def agent(client, problem))")
    return fn


def make(spec: str, url: Callable[[str], str], token: str, cfg):
    """The runner `cfg` (the gateway section) asks for, playing agent `spec`."""
    n = int(getattr(cfg, "agent_processes", 0))
    if n:
        return ProcessRunner(spec, url, token, cfg.concurrency, cfg.session_timeout_s, n)
    return Runner(load(spec), url, token, cfg.concurrency, cfg.session_timeout_s)


async def _play(agent, semaphore, http, url: str, token: str, timeout_s: float, problem: dict):
    import openai

    async with semaphore:
        client = openai.AsyncOpenAI(base_url=url, api_key=token, max_retries=0, timeout=timeout_s, http_client=http)
        return await asyncio.wait_for(agent(client, dict(problem)), timeout_s)


async def _shared(n: int):
    """A loop's semaphore and one HTTP connection pool for every session's client (a client of
    its own would build an SSL context per session: most of the agents' CPU time)."""
    import openai

    return asyncio.Semaphore(n), openai.DefaultAsyncHttpxClient()


class Runner:
    """Agents' sessions on an event loop of its own thread, at most `concurrency` at a time."""

    def __init__(self, agent: Callable, url: Callable[[str], str], token: str, concurrency: int, timeout_s: float):
        self.agent, self.url, self.token, self.timeout_s = agent, url, token, timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gateway-agents")
        self.thread.start()
        self._slots, self._http = asyncio.run_coroutine_threadsafe(_shared(concurrency), self.loop).result()
        self.errors = collections.deque(maxlen=100)  # (session, repr of the exception), newest last

    def start(self, session: str, problem: dict) -> Future:
        """Future[reward | None] of one session played by the agent."""
        return asyncio.run_coroutine_threadsafe(
            _play(self.agent, self._slots, self._http, self.url(session), self.token, self.timeout_s, problem),
            self.loop)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._http.aclose(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class AgentError(RuntimeError):
    """An agent's exception in a worker process (its repr: the exception itself stays there)."""


def _next_job(jobs):
    """The next job, or None once the run's process is gone (a kill -9 leaves no worker behind)."""
    while True:
        try:
            return jobs.get(timeout=1.0)
        except queue.Empty:
            if not multiprocessing.parent_process().is_alive():
                return None


def _worker(spec: str, token: str, concurrency: int, timeout_s: float, jobs, results) -> None:
    """A worker process: sessions from `jobs` ((session, problem, url); None: stop) played
    `concurrency` at a time, each outcome put on `results` as (session, ok, reward or repr)."""
    agent = load(spec)

    async def serve():
        semaphore, http = await _shared(concurrency)
        loop, running = asyncio.get_running_loop(), set()

        async def one(session, problem, url):
            try:
                results.put((session, True, await _play(agent, semaphore, http, url, token, timeout_s, problem)))
            except Exception as e:  # the agent's failure is the session's, reported, never the worker's
                results.put((session, False, repr(e)))

        while (job := await loop.run_in_executor(None, _next_job, jobs)) is not None:
            task = asyncio.create_task(one(*job))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
        await http.aclose()

    asyncio.run(serve())


class ProcessRunner:
    """Agents' sessions in `processes` worker processes (spawned: no state of this one shared),
    `concurrency` split among them; sessions go to the workers in turn."""

    def __init__(self, spec: str, url: Callable[[str], str], token: str, concurrency: int, timeout_s: float,
                 processes: int):
        load(spec)  # refused here, by name, rather than in every worker
        ctx = multiprocessing.get_context("spawn")
        self.url, self._results = url, ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(processes)]
        per = -(-concurrency // processes)
        self._workers = [ctx.Process(target=_worker, args=(spec, token, per, timeout_s, q, self._results), daemon=True,
                                     name=f"gateway-agents-{i}") for i, q in enumerate(self._jobs)]
        for w in self._workers:
            w.start()
        self._next, self._lock, self._futures = itertools.cycle(self._jobs), threading.Lock(), {}
        self.errors = collections.deque(maxlen=100)
        self._reader = threading.Thread(target=self._read, daemon=True, name="gateway-agent-results")
        self._reader.start()

    def start(self, session: str, problem: dict) -> Future:
        future = Future()
        with self._lock:
            self._futures[session] = future
            jobs = next(self._next)
        jobs.put((session, dict(problem), self.url(session)))
        return future

    def _read(self) -> None:
        while (got := self._results.get()) is not None:
            session, ok, value = got
            with self._lock:
                future = self._futures.pop(session, None)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(AgentError(value))

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for w in self._workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
        self._results.put(None)
        self._reader.join(timeout=10)
