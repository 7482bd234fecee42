"""Math with a Python tool (`tasks.math_tools`): calls in the tokenizer's own format, observations
rendered by its chat template and appended as ids (token in, token out), rewards by math-verify."""

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
