"""Math with a Python tool (`tasks.math_tools`): calls in the tokenizer's own format, observations
rendered by its chat template and appended as ids (token in, token out), rewards by math-verify;
the same task played by an agent through the gateway (`task.source=math_tools`)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models, tasks
from jaxrl_llm.learner import forward
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.tasks import envs, math_tools, multiturn
from tests import hf_fixtures

TRAIN = [("What is 6 times 7?", "#### 42"), ("What is 12 + 60?", "#### 72"), ("Half of 10?", "#### 5")]
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tool_chat_model")
    tok = hf_fixtures.make_tokenizer(str(d), corpus=[q + " " + a for q, a in TRAIN] + [CALL, math_tools.INSTRUCTION],
                                     special=(math_tools.CALL_OPEN, math_tools.CALL_CLOSE))
    hf_fixtures.save(hf_fixtures.make_hf_model("qwen2_tied", vocab=len(tok)), str(d))
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in TRAIN))
    c = tasks.default_config()
    c.update(dict(name="math_tools", path=str(data), eval_size=1, eval_holdout=0.34, reward_workers=1, tool_timeout=5.0,
                  max_obs_tokens=64, max_turns=3))
    task = tasks.make(c, str(d))
    yield task, d
    task.close()


def test_a_call_is_answered_in_the_chat_templates_own_words(setup):
    task, _ = setup
    tok = task.tokenizer
    prompt = task.train[0][0]
    turn = tok.encode(CALL, add_special_tokens=False)
    assert turn[-1] == task.turn_stop_ids[0] and tok.convert_ids_to_tokens(turn[-1]) == "</tool_call>"
    env = task.environment()
    reply = env.reply(prompt, turn, [False] * len(turn)).result(timeout=60)
    assert reply.tool_calls == 1 and reply.tool_errors == 0 and not reply.done
    # the row (prompt, the model's ids, the observation) reads as the template renders the conversation
    user = {"role": "user", "content": f"{TRAIN[0][0]}\n{math_tools.INSTRUCTION}"}
    want = tok.apply_chat_template([user, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42\n"}],
                                   tools=[math_tools.PYTHON], add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompt + turn + list(reply.obs_ids)) == want
    obs = [False] * len(turn) + [True] * len(reply.obs_ids)
    answer = tok.encode("So \\boxed{42}", add_special_tokens=False)
    episode = turn + list(reply.obs_ids) + answer
    assert env.final(prompt, episode, obs + [False] * len(answer)) == 1.0
    assert env.final(prompt, episode[:-3] + tok.encode("41}", add_special_tokens=False), obs + [False] * 4) == 0.0


@pytest.mark.parametrize("call,problem", [
    ("</tool_call>", "without <tool_call>"),
    ("<tool_call>print(1)</tool_call>", "not JSON"),
    ('<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>', "unknown tool"),
])
def test_a_bad_call_is_an_error_observation_and_is_counted(setup, call, problem):
    task, _ = setup
    turn = task.tokenizer.encode(call, add_special_tokens=False)
    reply = task.environment().reply(task.train[0][0], turn, [False] * len(turn)).result(timeout=60)
    assert reply.tool_errors == reply.tool_calls == 1 and problem in task.tokenizer.decode(list(reply.obs_ids))
    long = task.observation("9" * 500, 24)  # a long output is cut inside the frame, which stays whole
    assert len(long) == 24 and long[-len(task._frame[1]):] == tuple(task._frame[1])


def test_token_in_token_out_through_the_chat_template(setup):
    """Sampled episodes of a random model: every observation is exactly the template's frame
    (never re-tokenised model text), and the learner's forward over each row's ids gives every
    drawn token the log-prob it was sampled with."""
    task, d = setup
    params, cfg = models.load_params(str(d))
    scfg = SamplerConfig(max_new_tokens=96, temperature=1.0, capture_topk=0, num_samples=16,
                         prompt_buckets=task.prompt_buckets, eos_token_id=task.eos_id, pad_token_id=task.pad_id,
                         decode_segment=16, turn_stop_ids=task.turn_stop_ids)
    prompts = [ids for ids, _ in task.train]
    batch, totals = multiturn.generate(Sampler(cfg, scfg), task, params, prompts, jax.random.key(3))
    real, drawn = batch.input_mask > 0, batch.loss_mask > 0
    obs = real & ~drawn
    p = batch.tokens.shape[1] - 96
    obs[:, :p] = False
    assert obs.any() and envs.summary(totals)["episode/turns"] > 1
    frame = task.observation("error: a </tool_call> without <tool_call>", 64)
    for r in np.flatnonzero(obs.any(1)):
        spans = np.split(np.flatnonzero(obs[r]), np.flatnonzero(np.diff(np.flatnonzero(obs[r])) > 1) + 1)
        for span in spans:
            assert tuple(batch.tokens[r, span]) == frame[:len(span)]  # (cut only at the row's budget)
    fwd = forward.Forward(cfg, PolicyDist(1.0), 16, None)
    stats = forward.batch_stats(fwd, params, jax.tree.map(jnp.asarray, batch), None, gather=False)
    np.testing.assert_allclose(np.asarray(stats["logp"])[drawn], batch.behav_logp[drawn], atol=2e-4)


async def brings_its_python(client, problem):
    """An agent with a Python tool of its own (`math_tools`' schema), which runs no code: every
    call prints 42."""
    from jaxrl_llm.tasks.math_tools import PYTHON

    messages = [{"role": "user", "content": problem["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            return None
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "42\n"} for call in message.tool_calls]
    return None


def test_agents_play_the_math_tools_task_with_a_python_tool_of_their_own(setup, tmp_path):
    """task.source=math_tools: the agent's user message and its Python tool render exactly the
    task's prompt ids; a turn closes at the chat turn's end (<|im_end|>), the tool call parsed
    from it, not at </tool_call> as in the built-in environment; the task scores the turn after
    the last observation (math-verify, as its built-in environment does); a run trains."""
    from types import SimpleNamespace

    from configs import agent_math
    from jaxrl_llm.gateway import chat
    from jaxrl_llm.run import experiment, plan
    from jaxrl_llm.tasks.math_tools import PYTHON
    from tests.test_experiment import shrink

    _, d = setup
    c = shrink(agent_math.get_config())
    c.task.update(dict(source="math_tools", agent="tests.test_math_tools:brings_its_python", path=str(d / "train.jsonl"),
                       eval_size=1, eval_holdout=0.34, max_answer_len=64, max_obs_tokens=32, max_turns=3,
                       tool_timeout=5.0))
    c.model.hf_path, c.gateway.agent_processes, c.gateway.max_prompt_tokens = str(d), 0, 0
    c.runtime.mode = "sync"
    p = plan.resolve(c)
    f, tok = p.task.format, p.task.tokenizer
    call_end = tok.convert_tokens_to_ids("</tool_call>")
    assert p.sampler.turn_stop_ids == (chat.turn_stop_id(tok),) != (call_end,)
    assert p.greedy.turn_stop_ids == (call_end,)  # evaluation: the built-in environment runs the tool
    (prompt, _), = [(ids, g) for ids, g in p.task.source.train if TRAIN[0][0] in p.task.problem(ids)["prompt"]]
    user = chat.normal({"role": "user", "content": p.task.problem(prompt)["prompt"]})
    assert f.prompt([user], [PYTHON]) == prompt
    # a session as the gateway keeps it: the model's call turn, the tool's output, the answer
    said = tok.encode(CALL, add_special_tokens=False) + [f.stop_id]
    message, _ = f.reply(said, "0")  # in the OpenAI shape, as the agent got it
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "python" and json.loads(call["function"]["arguments"])["code"] == "print(6 * 7)"
    tool = chat.normal({"role": "tool", "tool_call_id": call["id"], "content": "42\n"})
    obs = f.extension([user, chat.normal(message)], [tool], [PYTHON])
    rows = [prompt + said + obs + tok.encode(f"So \\boxed{{{a}}}", add_special_tokens=False) + [f.stop_id]
            for a in (42, 41)]
    width = max(map(len, rows))
    model = [[0] * len(prompt) + [1] * len(said) + [0] * len(obs) + [1] * (len(r) - len(prompt) - len(said) - len(obs))
             for r in rows]
    batch = SimpleNamespace(**{k: np.asarray([x + [0] * (width - len(x)) for x in v]) for k, v in
                               (("tokens", rows), ("input_mask", [[1] * len(r) for r in rows]), ("loss_mask", model))})
    p.task.gateway = SimpleNamespace(width=len(prompt))  # the prompt span `_checked` reads
    try:
        assert p.task._checked([prompt, prompt], batch, [0, 1]).tolist() == [1.0, 0.0]
    finally:
        p.task.gateway = None
        p.task.close()
    summary = experiment.run(c, str(tmp_path / "run"), log=lambda *_: None)
    assert summary["version"] == 2 and summary["reward_failures"] == 0
    steps = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert [r["episode/count"] for r in steps] == [2 * c.sampler.num_samples * k for k in (1, 2)]
    assert all(r["gateway/agent_errors"] == 0 and np.isfinite(r["loss"]) for r in steps)
