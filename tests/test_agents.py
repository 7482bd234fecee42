"""`gateway/agents.py`: `task.name=agent` trains the embedded calculator task through the gateway,
played by `examples/calculator_agent.py` (the stock OpenAI client, no project imports)."""

import json

import numpy as np
import pytest

from configs.agent_calculator import get_config
from jaxrl_llm.gateway import agents, embedded, chat, runners
from jaxrl_llm.run import experiment, plan
from jaxrl_llm.tasks import arithmetic, tool_arithmetic as ta
from tests.test_experiment import shrink
from tests.test_math_dataset import tokenizer_dir  # noqa: F401  (a fixture: a tiny chat model and its tokenizer)


@pytest.mark.parametrize("mode", ["sync", "async", "sdk"])
def test_a_run_trains_the_calculator_agents_sessions(mode, tmp_path):
    """Sync: each draw's sessions, then a step, the agents on a thread of the run's process.
    Async with two sampler threads: two draws' sessions share one gateway's slots at once, each
    thread getting its own sessions back, the agents in one worker process. SDK: sync, the agent
    written with the OpenAI Agents SDK (`examples/calculator_agent_sdk.py`, the Responses API)."""
    c = shrink(get_config(), steps=2, eval_every=2)
    c.sampler.slots, c.task.max_turns, c.gateway.concurrency = 3, 3, 4
    c.gateway.agent_processes = 1 if mode == "async" else 0
    if mode == "sdk":
        mode, c.task.agent = "sync", "examples.calculator_agent_sdk:agent"
    c.runtime.mode, c.runtime.num_samplers = mode, 2 if mode == "async" else 1
    summary = experiment.run(c, str(tmp_path), log=lambda *_: None)
    assert summary["version"] == 2 and summary["reward_failures"] == 0
    steps = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    last = steps[-1]
    drawn = 2 * 2 * 4  # steps x prompts x G: in sync mode exactly these, async may have drawn ahead
    assert last["episode/count"] == drawn if mode == "sync" else last["episode/count"] >= drawn
    assert last["gateway/sessions_closed"] >= last["episode/count"] and last["gateway/sessions_timed_out"] == 0
    # every request repeated its session's conversation exactly, and no agent failed
    assert all(r["gateway/sessions_branched"] == r["gateway/agent_errors"] == 0 for r in steps)
    # latency percentiles cover the requests answered since the last step (async may have none by then)
    assert any(r.get("gateway/request_p50_ms", 0) > 0 for r in steps) and all(np.isfinite(r["loss"]) for r in steps)


def test_the_embedded_format_is_the_built_in_tasks_ids():
    """A prompt, a calculator call and its value as the built-in environment writes them."""
    f = embedded.ArithmeticChat()
    user = chat.normal({"role": "user", "content": "37*48*91="})
    assert f.prompt([user]) == [arithmetic.BOS] + arithmetic.encode("37*48*91=")
    turn = [ta.CALL] + arithmetic.encode("37*48") + [ta.END]
    msg, calls = f.reply(turn, "0_0")
    assert calls == [{"name": "calculator", "arguments": {"expression": "37*48"}}] and msg["content"] == ""
    said = chat.normal(msg)
    assert f.extension([user, said], [{"role": "tool", "content": "1776"}]) == arithmetic.encode("1776")
    assert f.extension([user, said], [{"role": "tool", "content": "error: nope"}]) == [ta.ERR]
    answer, none = f.reply(arithmetic.encode("161616") + [arithmetic.EOS], "0_1")
    assert answer == {"role": "assistant", "content": "161616"} and none == []
    with pytest.raises(chat.ChatError, match="messages"):
        f.prompt([chat.normal({"role": "system", "content": "be nice"}), user])


def test_the_agent_spec_and_mode_are_checked_at_start_up():
    c = shrink(get_config())
    c.task.agent = "examples.calculator_agent:nothing"
    with pytest.raises(ValueError, match="not an async function"):
        plan.resolve(c)
    c.task.agent = "examples.calculator_agent"
    with pytest.raises(ValueError, match="module:function"):
        runners.load(c.task.agent)
    c = shrink(get_config())
    c.task.agent = ""
    with pytest.raises(ValueError, match="task.name=agent plays an agent: set --config.task.agent"):
        plan.resolve(c)
    c.gateway.external = True
    with pytest.raises(ValueError, match="gateway.external=True: .*set --config.gateway.port and --config.gateway.token"):
        plan.resolve(c)
    c = shrink(get_config())
    c.runtime.mode = "simulated"
    with pytest.raises(ValueError, match="task.name=agent runs in runtime.mode=sync, async or remote"):
        plan.resolve(c)
    c.runtime.mode = "remote"
    c.gateway.update(external=True, token="s3cret", port=8123)
    with pytest.raises(ValueError, match="in runtime.mode=remote each sampler node hosts a gateway"):
        plan.resolve(c)


@pytest.mark.parametrize("source", ["arithmetic", "tool_arithmetic"])
def test_the_samplers_stop_each_turn_at_the_formats_closing_token(source):
    """What `service.Gateway` requires of its sampler, from the plan (task.source=arithmetic had
    no turn stop and was refused at its first draw)."""
    c = shrink(get_config())
    c.task.source = source
    p = plan.resolve(c)
    assert p.sampler.turn_stop_ids == (p.task.format.stop_id,) != (p.sampler.eos_token_id,)


class _Gateway:
    """The parts of `service.Gateway` a draw's collection uses, for sessions that never asked."""

    def __init__(self):
        self.abandoned = []

    def check(self):
        pass

    def reward(self, session, value):
        raise KeyError(session)

    def abandon(self, session):
        self.abandoned.append(session)
        return False

    def closed(self):
        return []


def test_an_agent_that_fails_before_asking_is_dropped_at_once():
    """No row exists for it, so nothing will be handed over: its problem is not waited for until
    the session timeout, and the failure is counted with its error."""
    import time
    from concurrent.futures import Future

    task = agents.AgentTask(ta.ToolArithmetic(), "examples.calculator_agent:agent", _settings())
    task.gateway, task.runner = _Gateway(), type("R", (), {"errors": []})()
    failed = Future()
    failed.set_exception(ValueError("no network"))
    start = time.monotonic()
    assert task._collect({"s0": (0, 0)}, {"s0": failed}) == {}
    assert time.monotonic() - start < 5 and task.gateway.abandoned == ["s0"]
    assert task.counts["dropped"] == 1 and task.counts["agent_errors"] == 1
    assert "no network" in task.runner.errors[0][1]


def test_a_session_still_open_at_the_draws_deadline_is_closed_and_its_hand_over_dropped():
    """An agent that never ends its session (e.g. one asking forever elsewhere) would hold its
    slot for the rest of the run: at the draw's deadline the session is abandoned, counted as
    dropped, and its later hand-over is not kept."""
    import time
    from concurrent.futures import Future

    task = agents.AgentTask(ta.ToolArithmetic(), "examples.calculator_agent:agent", _settings(session_timeout_s=0.1))
    task.GRACE_S, task.gateway, task.runner = 0.3, _Gateway(), type("R", (), {"errors": []})()
    start = time.monotonic()
    assert task._collect({"s1": (0, 0)}, {"s1": Future()}) == {}  # the agent never returns
    assert 0.5 <= time.monotonic() - start < 5 and task.gateway.abandoned == ["s1"] and task.counts["dropped"] == 1
    task.gateway.closed = lambda: ["s1"]  # its rows left the slots: handed over as dropped, seen by the next draw
    failed = Future()
    failed.set_exception(ValueError("no network"))
    task._collect({"s2": (0, 0)}, {"s2": failed})
    assert task._handed == {} and task._given_up == set() and task.counts["dropped"] == 2


def _settings(session_timeout_s=300.0):
    import types

    return types.SimpleNamespace(host="127.0.0.1", port=0, concurrency=2, session_timeout_s=session_timeout_s,
                                 max_attempts=1, seed=0, max_obs_tokens=8)


def test_agent_worker_processes_leave_with_a_run_killed_with_sigkill():
    """`gateway.agent_processes`: a worker process whose run dies by kill -9 (no clean-up
    runs) stops on its own within seconds instead of lingering."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.test_distributed import ENV, ROOT

    script = ("from jaxrl_llm.gateway import runners\n"
              "r = runners.ProcessRunner('examples.calculator_agent:agent', lambda s: 'http://127.0.0.1:9/v1', 't', "
              "2, 30.0, 1)\n"
              "print(r._workers[0].pid, flush=True)\n"
              "import time; time.sleep(120)\n")
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    worker = int(run.stdout.readline())
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{worker}") and \
            open(f"/proc/{worker}/stat").read().split(")")[-1].split()[0] != "Z":
        time.sleep(0.2)
    gone = not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split(")")[-1].split()[0] == "Z"
    assert gone, f"agent worker {worker} outlived its run"


def test_external_agents_take_their_sessions_from_rl_prompts(tmp_path):
    """gateway.external: the run plays no agent; another "process" (a thread with its own event
    loop and HTTP clients) polls GET /rl/prompts, plays each session with the example agent on the
    stock client and posts its reward (null: the task's check); the run trains those rows."""
    import asyncio
    import socket
    import threading

    import httpx
    import openai

    from examples.calculator_agent import agent

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = shrink(get_config(), steps=1, eval_every=1)
    c.sampler.slots, c.task.max_turns, c.gateway.concurrency = 3, 3, 4
    c.task.agent, c.runtime.mode = "", "sync"
    c.gateway.update(external=True, token="s3cret", port=port)
    stop, played, probes, auth = threading.Event(), [], [], {"Authorization": "Bearer s3cret"}
    base = f"http://127.0.0.1:{port}"

    async def elsewhere():
        async with httpx.AsyncClient(timeout=30) as http:
            async def play(item):
                client = openai.AsyncOpenAI(base_url=item["base_url"], api_key="s3cret", max_retries=0)
                reward = await agent(client, item["problem"])
                r = await http.post(f"{base}/rl/sessions/{item['session']}/reward", json={"reward": reward},
                                    headers=auth)
                played.append((item["session"], r.status_code))
                if not probes:  # a made-up session, and one played already: neither opens a row
                    probes.append(item["session"])
                    ask = [{"role": "user", "content": "1+1="}]
                    for name in ("intruder", item["session"]):
                        other = openai.AsyncOpenAI(base_url=f"{base}/s/{name}/v1", api_key="s3cret", max_retries=0)
                        try:
                            await other.chat.completions.create(model="policy", messages=ask)
                        except openai.APIStatusError as e:
                            probes.append((name, e.status_code, e.message))

            tasks = []
            while not stop.is_set():
                try:
                    r = await http.get(f"{base}/rl/prompts", params={"max": 8}, headers=auth)
                except httpx.TransportError:  # not serving yet
                    await asyncio.sleep(0.05)
                    continue
                tasks += [asyncio.create_task(play(item)) for item in r.json()["sessions"]]
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks, return_exceptions=True)

    thread = threading.Thread(target=lambda: asyncio.run(elsewhere()), daemon=True)
    thread.start()
    try:
        summary = experiment.run(c, str(tmp_path), log=lambda *_: None)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert summary["version"] == 1
    step = next(r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r)
    assert step["episode/count"] == 2 * 4 and step["gateway/sessions_closed"] >= 8
    assert len(played) >= 8 and all(code == 200 for _, code in played)
    (_, intruder, again) = probes
    assert intruder[:2] == ("intruder", 404) and "not one this run handed out" in intruder[2]
    assert again[1] in (400, 404) and ("closed" in again[2] or "handed out" in again[2])
    assert json.load(open(tmp_path / "config.json"))["gateway"]["token"] == "***"  # never written out


def test_an_agent_run_killed_with_sigkill_resumes_losing_and_repeating_no_session(tmp_path):
    """kill -9 of a sync agent run mid-way: the resumed run trains every step once, each on
    exactly its draw's P x G sessions (the checkpointed episode count goes on from the restored
    version: none of the dead run's sessions past it is counted or trained)."""
    import os
    import subprocess
    import sys

    from tests.test_distributed import ENV, ROOT, TINY
    from tests.test_faults import killed_mid_run

    base = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/agent_calculator.py", *TINY[1:],
            "--config.runtime.mode=sync", "--config.sampler.slots=3", "--config.task.max_turns=3",
            "--config.gateway.concurrency=4", "--config.gateway.agent_processes=1", "--config.train.save_every=2",
            "--config.train.eval_every=1000", "--config.train.keep=100"]
    run = str(tmp_path / "run")
    end = killed_mid_run(base, run) + 2
    path = os.path.join(run, "metrics.jsonl")
    r = subprocess.run([*base, f"--workdir={run}", f"--config.train.steps={end}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(x) for x in open(path) if '"loss"' in x]
    assert [s["step"] for s in steps] == list(range(1, end + 1))
    per_step = 2 * 4  # prompts_per_batch x num_samples
    assert [s["episode/count"] for s in steps] == [per_step * s["step"] for s in steps]


def test_agent_sessions_of_a_mixture_of_experts_carry_their_routing_and_replay_it(tmp_path):
    """The gateway's slots record each session's experts (prompt, drawn and tool-result
    positions): a sync agent run of a random MoE policy replays them, its learner reproducing the
    sampled log-probs and routing exactly as sampled."""
    c = shrink(get_config(), steps=2, eval_every=2)
    c.sampler.slots, c.task.max_turns, c.gateway.concurrency, c.runtime.mode = 3, 3, 4, "sync"
    c.gateway.agent_processes = 1
    c.model.moe.update(experts=4, top_k=2, intermediate_size=32, routing="replay")
    assert plan.resolve(c).sampler.record_routing
    assert experiment.run(c, str(tmp_path), log=lambda *_: None)["version"] == 2
    steps = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    assert max(r["mismatch/abs_logp_max"] for r in steps) < 1e-4
    # the sampler's experts are the learner's own top k but where a minibatch update flipped a near-tie
    assert all(r["moe/routing_differs_pairs"] < 0.02 for r in steps)


async def fails_after_one_turn(client, problem):
    """An agent with a bug: it raises after its first answer."""
    from examples.calculator_agent import CALCULATOR

    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": problem["prompt"]}],
                                         tools=[CALCULATOR])
    raise RuntimeError("the agent's own bug")


def test_an_agent_that_fails_at_its_last_attempt_does_not_stop_the_run(tmp_path):
    """Every session's agent raises after a turn, and no attempt is left (max_attempts=1): each
    session is scored by the task's check of what it sampled and trained, counted; the run goes on."""
    c = shrink(get_config(), steps=1, eval_every=1)
    c.runtime.mode, c.gateway.max_attempts = "sync", 1
    c.task.agent = "tests.test_agents:fails_after_one_turn"
    assert experiment.run(c, str(tmp_path), log=lambda *_: None)["version"] == 1
    (step,) = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    sessions = c.runtime.prompts_per_batch * c.sampler.num_samples
    assert step["gateway/scored_after_failure"] == step["gateway/agent_errors"] == sessions
    assert step["episode/count"] == sessions and np.isfinite(step["loss"])


def test_agents_play_a_local_dataset_through_its_chat_template(tokenizer_dir, tmp_path):
    """`configs/agent_math.py` (task.source=math, the calculator agent with its tool, shrunk, on a
    tiny local chat model): sessions are rendered by the tokenizer's chat template. A turn closes at
    <|im_end|> (the sampler's turn stop) and a row ends at <|endoftext|>, while evaluation samples
    the dataset as `task.name=math` does and the policy keeps <|im_end|> as its end; the agent's one
    user message renders exactly the task's prompt ids; a run trains each session, the task
    scoring it against the problem's gold answer."""
    from configs import agent_math
    from tests.test_math_dataset import TRAIN, _write_jsonl

    c = shrink(agent_math.get_config())
    c.task.update(dict(path=str(_write_jsonl(tmp_path / "train.jsonl", TRAIN)), eval_size=2, max_answer_len=8,
                       eval_holdout=0.5))
    c.model.hf_path, c.gateway.agent_processes, c.gateway.max_prompt_tokens = str(tokenizer_dir), 0, 0
    c.runtime.mode = "sync"  # each step trains exactly its draw's sessions
    p = plan.resolve(c)
    tok = p.task.tokenizer
    end, turn = (tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert chat.turn_stop_id(tok) == turn and isinstance(p.task.format, chat.ChatFormat)
    assert (p.sampler.turn_stop_ids, p.sampler.eos_token_id) == ((turn,), end)
    assert (p.greedy.turn_stop_ids, p.greedy.eos_token_id) == ((), turn)
    assert p.task.max_turns == c.task.max_turns  # an agent may bring tools of its own: turns per session
    prompt = p.task.prompts(np.random.default_rng(0), 1)[0]
    user = chat.normal({"role": "user", "content": p.task.problem(prompt)["prompt"]})
    assert p.task.format.prompt([user]) == prompt
    # The task's check scores the model's turns against the problem's gold answer (a symbolic one
    # through the run's checker processes): an answer in a tool's output is not the model's.
    from types import SimpleNamespace

    from jaxrl_llm import tasks

    (half,) = [ids for ids, g in p.task.source.train if "frac" in g]
    said, told = (tok.encode(t, add_special_tokens=False) for t in ("so \\boxed{0.5}", "\\boxed{\\frac{1}{2}}"))
    vague = tok.encode("so that is it", add_special_tokens=False)
    rows = [half + said, half + told + vague]
    width = max(map(len, rows))
    batch = SimpleNamespace(tokens=np.asarray([r + [0] * (width - len(r)) for r in rows]),
                            loss_mask=np.asarray([[0] * len(half) + [1] * len(said) + [0] * (width - len(rows[0])),
                                                  [0] * (len(half) + len(told)) + [1] * len(vague)]))
    assert p.task._checked([half, half], batch, [0, 1]).tolist() == [1.0, 0.0]
    p.task.scorer = tasks.scorer(p.task, c.task)
    try:
        assert p.task._checked([half, half], batch, [0, 1]).tolist() == [1.0, 0.0] and p.task.scorer.in_workers
    finally:
        p.task.scorer.close()

    c.gateway.max_prompt_tokens = 2 * p.task.prompt_buckets[-1]  # room for an agent's system prompt or tools
    assert plan.resolve(c).task.prompt_buckets == p.task.prompt_buckets + (c.gateway.max_prompt_tokens,)
    c.gateway.max_prompt_tokens = 0

    summary = experiment.run(c, str(tmp_path / "run"), log=lambda *_: None)
    assert summary["version"] == 2 and summary["reward_failures"] == 0
    steps = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    sessions = c.runtime.prompts_per_batch * c.sampler.num_samples
    assert [r["episode/count"] for r in steps] == [sessions, 2 * sessions]
    assert all(r["gateway/sessions_closed"] >= r["episode/count"] and r["gateway/agent_errors"] == 0 for r in steps)
    assert all(np.isfinite(r["loss"]) for r in steps)
    from jaxrl_llm.store import workdir

    assert json.load(open(tmp_path / "run" / workdir.POLICY))["model"]["eos_token_id"] == turn  # what exports say
    c.task.chat_template = False
    with pytest.raises(ValueError, match="math or math_tools with task.chat_template=True"):
        plan.resolve(c)


@pytest.mark.serial
def test_a_remote_run_trains_the_sessions_its_nodes_agents_play(tmp_path):
    """runtime.mode=remote: the sampler node (here in this process) hosts a gateway on its own
    loopback, with a key of its own, and plays the agents itself (`task.agent`, in a worker
    process); the learner trains the groups its sessions make, checked as any node's (the
    prompt and reward checks aside: an agent's own), none refused even with every group
    drawn for verification."""
    import signal
    import sys
    import threading

    from jaxrl_llm.parallel.launch import free_port
    from jaxrl_llm.remote import node as sampler_node
    from tests.test_distributed import ENV, TINY
    from tests.test_node import _Processes, _records, _wait_step

    port, wd = free_port(), str(tmp_path / "run")
    learner = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/agent_calculator.py", *TINY[1:],
               f"--workdir={wd}", "--config.runtime.mode=remote", f"--config.runtime.remote.port={port}",
               "--config.sampler.slots=3", "--config.task.max_turns=3", "--config.gateway.concurrency=4",
               "--config.gateway.agent_processes=1", "--config.train.steps=1000", "--config.train.eval_every=1000",
               "--config.train.save_every=1000", "--config.runtime.remote.verify_fraction=1.0"]
    with _Processes(tmp_path, port, ENV) as run:
        lrn = run.start(learner, "l")
        node = sampler_node.Node(f"127.0.0.1:{port}", "", "a", None, 0.5)
        thread = threading.Thread(target=node.run, daemon=True)
        thread.start()
        _wait_step(wd, 2, lrn)
        task = node.producer.task
        closed, url = task.gateway.counts()["closed"], task.server.url()
        node.stop(release=True)
        thread.join(timeout=30)
        node.close()
        lrn.send_signal(signal.SIGTERM)
        assert lrn.wait(timeout=60) == 143, (tmp_path / "l.log").read_text()[-3000:]
    assert isinstance(task, agents.AgentTask) and not task.external and url.startswith("http://127.0.0.1:")
    steps = [r for r in _records(wd) if "loss" in r]
    trained = sum(len(r["remote/origins"]) for r in steps) * 4  # groups x G sessions
    assert len(steps) >= 2 and 0 < trained <= closed and steps[-1]["remote/rejected"] == 0
    # the node's heartbeats bring its sessions into the run's episode counts
    assert 0 < steps[-1]["episode/count"] <= closed and steps[-1]["episode/turns"] > 0
    # ... and its gateway's counters and request latencies into the run's `gateway/*`
    assert 0 < steps[-1]["gateway/sessions_closed"] <= closed and steps[-1]["gateway/agent_errors"] == 0
    assert any(r.get("gateway/request_p50_ms", 0) > 0 for r in steps)
    assert all(np.isfinite(r["loss"]) for r in steps) and not thread.is_alive()
