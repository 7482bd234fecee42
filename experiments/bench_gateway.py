"""Trained tokens per second through the agent gateway vs the built-in environment on the same task.

    python experiments/bench_gateway.py --workdir=runs/bench_gateway [--steps=30]

Runs `configs/agent_calculator.py` (the calculator task played by `examples/calculator_agent.py`
over the stock OpenAI client) and `configs/tool_arithmetic.py` (the same problems, warm start and
training with the built-in environment) one after the other, same seed, same length, on this
machine, both decoding in `--slots` slots (64; the gateway with as many sessions in flight). Trained tokens per
second count the tokens with loss (rows x trained length) from the end of step `--skip` (compiles
done) to the last step. Request latency is a request's arrival at the gateway to its answer
(decoding included), the per-step p50 and p99 averaged over the measured steps. Over the same
steps, /proc gives the cores each run's processes kept busy: its own ("run") and its descendants'
("helpers": the agents' worker processes, the built-in task's tool workers), and from them the
core-milliseconds each thousand trained tokens cost, and the ratio per core-second
(`gateway_vs_builtin_per_core`: the ratio if both runs kept the same cores busy). `--repeats`
pairs of runs (3): each figure is the median over them, the ratio taken within each pair (its
range beside it). Writes
experiments/results/bench_gateway_cpu.{json,md}; the goal is `gateway_vs_builtin_trained` >= 0.8
(`fraction_of_goal`).

The stock client's own cost is measured in the same run (`client_floor`): the agent's request
(its history and `tools`) sent `--client-requests` times, 64 in flight, by `openai.AsyncOpenAI`
and by plain `httpx` to a server that answers every one with the same tool call, the client
process's CPU per request (`agent_client_ms_per_request`, `http_client_ms_per_request`). Times
the gateway run's requests per thousand trained tokens, it is the core-milliseconds per thousand
tokens that agents on the stock client spend whatever serves them; `gateway_vs_builtin_client_bound`
is the per-core ratio if the gateway's serving cost nothing beyond the built-in run's own work
and the agents nothing beyond their client.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from experiments.common import cpu_kind, report  # noqa: E402

GOAL = 0.8
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS = {"gateway": "configs/agent_calculator.py", "builtin": "configs/tool_arithmetic.py"}


def rows_per_step(config: str) -> int:
    """Rows every step trains: the config's prompts per batch x samples per prompt."""
    import importlib

    c = importlib.import_module(config[:-3].replace("/", ".")).get_config()
    return c.runtime.prompts_per_batch * c.sampler.num_samples


def measure(workdir: str, skip: int, rows: int) -> dict:
    steps = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "loss" in r]
    first, rest = steps[skip - 1], steps[skip:]
    # runtime/length_trained_mean is over the whole run so far: tokens trained by a step = its mean x rows x steps
    total = lambda r: rows * r["step"] * r["runtime/length_trained_mean"]  # noqa: E731
    tokens = total(rest[-1]) - total(first)
    out = {"steps": len(steps), "trained_tokens": tokens, "seconds": rest[-1]["time_s"] - first["time_s"],
           "final_reward": steps[-1]["reward/mean"], "turns_per_episode": steps[-1].get("episode/turns")}
    out["trained_tokens_per_s"] = tokens / out["seconds"]
    if out["turns_per_episode"]:  # a turn is a request to the gateway
        out["requests_per_ktoken"] = 1e3 * out["turns_per_episode"] * rows * len(rest) / tokens
    p50 = [r["gateway/request_p50_ms"] for r in rest if "gateway/request_p50_ms" in r]
    if p50:
        out["request_p50_ms"] = sum(p50) / len(p50)
        out["request_p99_ms"] = sum(r["gateway/request_p99_ms"] for r in rest if "gateway/request_p99_ms" in r) / len(p50)
    return out


def _slots(run: str, slots: int) -> list:
    """The same decode slots for both runs (and as many agent sessions in flight): on a CPU a
    tiny model decodes 64 rows about as fast as 128, so unequal slots would measure that."""
    if not slots:
        return []
    return [f"--config.sampler.slots={slots}"] + ([f"--config.gateway.concurrency={slots}"] if run == "gateway" else [])


def _cpu_s(pid: int) -> dict:
    """CPU seconds (user + system) so far of process `pid` ("run") and of its descendants alive
    now ("helpers": the agents' worker processes, the task's tool workers), from /proc."""
    tick, parent, cpu = os.sysconf("SC_CLK_TCK"), {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            parent[int(entry)], cpu[int(entry)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    tree, grew = {pid}, True
    while grew:
        more = {c for c, p in parent.items() if p in tree} - tree
        tree, grew = tree | more, bool(more)
    return {"run": cpu.get(pid, 0.0), "helpers": sum(cpu[c] for c in tree - {pid})}


def _cores(proc, metrics: str, skip: int, steps: int):
    """Cores the run's processes kept busy from the first step >= `skip` seen in metrics.jsonl to
    the first step >= `steps` seen (the window `measure` counts, give or take a step where the
    file grew by several steps between two looks: a rate, so the window need not match exactly),
    sampled from /proc when the file grows; None where /proc is missing or the run ended first."""
    first = last = None
    seen, linux = 0, os.path.isdir("/proc")
    while linux and proc.poll() is None and (last is None or last[0] < steps):
        done = sum(1 for line in open(metrics) if '"loss"' in line) if os.path.exists(metrics) else 0
        if done >= skip and done > seen:
            mark = (done, time.monotonic(), _cpu_s(proc.pid))
            first, last = first or mark, mark
        seen = done
        time.sleep(0.02)
    proc.wait()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    if first is None or last[0] < steps or last[0] == first[0]:
        return None
    (_, t0, a), (_, t1, b) = first, last
    cores = {k: (b[k] - a[k]) / (t1 - t0) for k in a}
    return {**cores, "total": sum(cores.values())}


ANSWER = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "policy", "usage": {
    "prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}, "choices": [{
        "index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
            "role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                "name": "calculator", "arguments": '{"expression": "37*48"}'}}]}}]}


def _static(port: int) -> None:
    """A server answering every request with `ANSWER` (a raw ASGI app on uvicorn: no work of its own)."""
    import uvicorn

    body = json.dumps(ANSWER).encode()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


async def _client_ms(url: str, n: int, stock: bool) -> float:
    """CPU milliseconds of this process per request, `n` requests 64 in flight, after 200 to warm up."""
    import asyncio

    import openai

    from examples.calculator_agent import CALCULATOR

    call = ANSWER["choices"][0]["message"]
    body = {"model": "policy", "tools": [CALCULATOR], "messages": [
        {"role": "user", "content": "37*48*91="}, call, {"role": "tool", "tool_call_id": "call_0", "content": "1776"}]}
    http, gate = openai.DefaultAsyncHttpxClient(), asyncio.Semaphore(64)

    async def one():
        async with gate:
            if stock:  # a client per request over one shared pool (the run's agents: one per session; building
                # one costs ~0.15 ms, in the figure)
                client = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0, http_client=http)
                reply = await client.chat.completions.create(**body)
                reply.choices[0].message.model_dump(exclude_none=True)
            else:
                (await http.post(f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer k"})).json()

    await asyncio.gather(*[one() for _ in range(200)])
    t0 = time.process_time()
    await asyncio.gather(*[one() for _ in range(n)])
    cpu = time.process_time() - t0
    await http.aclose()
    return 1e3 * cpu / n


def client_floor(n: int) -> dict:
    """The agent's request by the stock client and by plain httpx: client CPU ms per request."""
    import asyncio
    import multiprocessing
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=_static, args=(port,), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", data=b"{}", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or not server.is_alive():
                    raise
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/s/x/v1"
        return {"agent_client_ms_per_request": asyncio.run(_client_ms(url, n, True)),
                "http_client_ms_per_request": asyncio.run(_client_ms(url, n, False))}
    finally:
        server.terminate()
        server.join(10)


def run_pair(args, repeat: int) -> dict:
    """One gateway run and one built-in run, the first of the two alternating with `repeat` so a
    drift in machine load does not always favour the same side."""
    got = {}
    for name in (list(RUNS) if repeat % 2 == 0 else list(RUNS)[::-1]):
        config, d = RUNS[name], os.path.join(args.workdir, f"{name}_{repeat}")
        shutil.rmtree(d, ignore_errors=True)  # a metrics.jsonl left by an earlier bench would read as this run's steps
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl_llm.main", f"--config={config}", f"--workdir={d}",
                                 f"--config.train.steps={args.steps}", f"--config.train.eval_every={args.steps}",
                                 f"--config.train.save_every={args.steps}", "--config.train.progress=False",
                                 "--config.train.resume=fresh", *_slots(name, args.slots)])
        cores = _cores(proc, os.path.join(d, "metrics.jsonl"), args.skip, args.steps)
        got[name] = measure(d, args.skip, rows_per_step(config))
        if cores is not None:  # core-milliseconds each thousand trained tokens cost, by process
            got[name].update({f"cores_{k}": v for k, v in cores.items()})
            got[name].update({f"core_ms_per_ktoken_{k}": 1e6 * v / got[name]["trained_tokens_per_s"]
                              for k, v in cores.items()})
    return got


def summary(pairs: list) -> dict:
    """The median over the repeats of each figure, the ratio taken within each pair, and its range."""
    import numpy as np

    ratios = [p["gateway"]["trained_tokens_per_s"] / p["builtin"]["trained_tokens_per_s"] for p in pairs]
    # the same ratio per core-second: what it would be if both runs kept the same cores busy
    key = "core_ms_per_ktoken_total"
    per_core = [p["builtin"][key] / p["gateway"][key] for p in pairs if key in p["gateway"] and key in p["builtin"]]

    def med(side, key):
        got = [p[side][key] for p in pairs if p[side].get(key) is not None]
        return float(np.median(got)) if got else None

    ratio = float(np.median(ratios))
    return {"gateway_vs_builtin_trained": ratio, "gateway_vs_builtin_trained_range": [min(ratios), max(ratios)],
            "fraction_of_goal": ratio / GOAL, "gateway_request_p50_ms": med("gateway", "request_p50_ms"),
            "gateway_request_p99_ms": med("gateway", "request_p99_ms"),
            "gateway_trained_tokens_per_s": med("gateway", "trained_tokens_per_s"),
            "builtin_trained_tokens_per_s": med("builtin", "trained_tokens_per_s"),
            **{f"{side}_core_ms_per_ktoken_{k}": med(side, f"core_ms_per_ktoken_{k}")
               for side in ("gateway", "builtin") for k in ("run", "helpers")},
            **{f"{side}_cores": med(side, "cores_total") for side in ("gateway", "builtin")},
            "gateway_vs_builtin_per_core": float(np.median(per_core)) if per_core else None,
            "gateway_requests_per_ktoken": med("gateway", "requests_per_ktoken")}


def bound(result: dict, floor: dict) -> dict:
    """The agents' client cost per thousand trained tokens, and the per-core ratio it alone allows."""
    per_k, builtin = result["gateway_requests_per_ktoken"], (result["builtin_core_ms_per_ktoken_run"] or 0) + (
        result["builtin_core_ms_per_ktoken_helpers"] or 0)
    if not per_k or not builtin:
        return floor
    client = floor["agent_client_ms_per_request"] * per_k
    return {**floor, "agent_client_core_ms_per_ktoken": client,
            "gateway_vs_builtin_client_bound": builtin / (builtin + client)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the measurement (compiles)")
    ap.add_argument("--slots", type=int, default=64,
                    help="decode slots of both runs and the gateway's concurrent sessions (0: each config's own)")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs; figures are their medians")
    ap.add_argument("--client-requests", type=int, default=3000, help="requests timing the stock client")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    pairs = [run_pair(args, i) for i in range(args.repeats)]
    result = summary(pairs)
    result = {**result, **bound(result, client_floor(args.client_requests)), "steps": args.steps, "skip": args.skip,
              "slots": args.slots, "repeats": args.repeats, "runs": pairs, **cpu_kind()}
    os.makedirs(args.out, exist_ok=True)
    report(result, os.path.join(args.out, "bench_gateway_cpu.json"))


if __name__ == "__main__":
    main()
