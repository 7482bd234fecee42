"""The embedded calculator task (`tasks.tool_arithmetic`), its environment through the sandbox,
the episode bookkeeping (`tasks.envs`) and multi-turn generation (`tasks.multiturn`)."""

from concurrent.futures import Future

import jax
import numpy as np
import pytest

from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.tasks import envs, multiturn, sandbox, warmstart
from jaxrl_llm.tasks import tool_arithmetic as T
from jaxrl_llm.tasks.arithmetic import EOS, encode
from tests import checkers

TASK = T.ToolArithmetic()


@pytest.fixture(scope="module")
def runner():
    r = sandbox.ToolRunner(workers=1, timeout=1.0)
    yield r
    r.close()


def test_traces_call_the_tool_and_observations_carry_no_loss():
    traces = TASK.supervised(np.random.default_rng(0), 16)
    tokens, loss, real = (np.asarray(x) for x in warmstart.pack(traces, TASK.max_prompt_len + TASK.max_answer_len))
    for (prompt, episode, keep), row_loss in zip(traces, loss):
        assert len(episode) <= TASK.max_answer_len and episode.count(T.CALL) == 2 and episode[-1] == EOS
        obs = [not k for k in keep]
        assert TASK.final_answer(episode[:-1], obs[:-1]) == TASK.answer(prompt)  # the trace's answer is right
        np.testing.assert_array_equal(row_loss[len(prompt):len(prompt) + len(episode)], keep)
    assert envs.make("calculator", TASK, None).stop_ids == (T.END,)
    with pytest.raises(ValueError, match="unknown environment 'abacus'; valid: (.*, )?calculator"):
        envs.make("abacus")


def test_the_calculator_answers_in_the_sandbox_and_errors_are_observations(runner):
    env = T.Calculator(TASK, runner)
    prompt = [1] + encode("37*48*91=")
    turn = [T.CALL] + encode("37*48") + [T.END]
    reply = env.reply(prompt, turn, [False] * len(turn)).result(timeout=30)
    assert reply.obs_ids == tuple(encode("1776")) and reply.tool_calls == 1 and not reply.done
    # the second turn reads only what follows the observation
    episode = turn + list(reply.obs_ids) + [T.CALL] + encode("1776*91") + [T.END]
    obs = [False] * len(turn) + [True] * 4 + [False] * 9
    second = env.reply(prompt, episode, obs).result(timeout=30).obs_ids
    assert second == tuple(encode(str(1776 * 91)))
    assert env.reply(prompt, [T.END], [False]).result(timeout=30).obs_ids == (T.ERR,)  # a tag with no call
    bad = [T.CALL] + encode("3**") + [T.END]
    r = env.reply(prompt, bad, [False] * len(bad)).result(timeout=30)
    assert r.obs_ids == (T.ERR,) and r.tool_errors == 1
    answer, obs = episode + list(second) + encode(str(37 * 48 * 91)), obs + [True] * 6 + [False] * 6
    assert env.final(prompt, answer, obs) == 1.0 and env.final(prompt, answer[:-1], obs[:-1]) == 0.0


def test_a_hanging_tool_times_out_into_an_observation_and_the_episode_goes_on(runner):
    env = T.Calculator(TASK, runner, tool=checkers.hang)
    eps = envs.Episodes(env, lambda row: [1] + encode("1*2*3="), max_turns=4)
    turn = [T.CALL] + encode("1*2") + [T.END]
    reply = eps.respond(0, turn, [False] * len(turn)).result(timeout=30)
    assert reply.obs_ids == (T.ERR,) and not reply.done
    assert eps.stats["tool_timeouts"] == 1 and eps.stats["tool_calls"] == 1


class _Loud:
    stop_ids = (T.END,)

    def reply(self, prompt, episode, obs):
        f = Future()
        f.set_result(envs.Reply(obs_ids=tuple([5] * 500), reward=0.25))
        return f

    def final(self, prompt, episode, obs):
        return 1.0


@pytest.mark.parametrize("how,want", [("sum", 1.5), ("last", 1.0)])
def test_observations_are_cut_turns_are_limited_and_turn_rewards_combine(how, want):
    eps = envs.Episodes(_Loud(), lambda row: [1], max_turns=3, turn_reward=how, max_obs_tokens=16)
    assert len(eps.respond(0, [T.END], [False]).result().obs_ids) == 16 and eps.stats["obs_cut"] == 1
    assert not eps.respond(0, [T.END], [False]).result().done
    assert eps.respond(0, [T.END], [False]).result().done and 0 in eps.truncated  # the third call: the limit
    eps.finish(0, [EOS], [False])  # the third turn, ended by the limit: its reward is the final one
    rewards, truncated, totals = eps.take([0])
    assert rewards[0] == pytest.approx(want) and truncated.tolist() == [True]
    m = envs.summary(totals)
    assert m["episode/turns"] == 3 and m["episode/truncated"] == 1.0 and m["episode/obs_cut"] == 2
    assert eps.stats["obs_cut"] == 0  # taken: forgotten


def test_multi_turn_generation_scores_each_episode():
    cfg = ModelConfig(vocab_size=T.VOCAB_SIZE, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, head_dim=16)
    scfg = SamplerConfig(max_new_tokens=TASK.max_answer_len, temperature=1.0, capture_topk=0, num_samples=4,
                         prompt_buckets=(TASK.max_prompt_len,), decode_segment=8, eos_token_id=EOS,
                         turn_stop_ids=(T.END,))
    params = decoder.init_params(cfg, jax.random.key(0))  # random: it draws </calc> now and then, calls or not
    prompts = TASK.prompts(np.random.default_rng(0), 3)
    task = T.ToolArithmetic(turn=multiturn.TurnConfig(max_turns=3, max_obs_tokens=64))
    try:
        batch, totals = multiturn.generate(Sampler(cfg, scfg), task, params, prompts, jax.random.key(1))
    finally:
        task.close()
    metrics = envs.summary(totals)
    assert batch.rewards.shape == (12,) and set(np.asarray(batch.rewards).tolist()) <= {0.0, 1.0}
    real, loss = np.asarray(batch.input_mask) > 0, np.asarray(batch.loss_mask) > 0
    assert metrics["episode/turns"] > 1 and metrics["episode/obs_tokens"] > 0 and (loss <= real).all()
    tokens = np.asarray(batch.tokens)
    assert ((tokens == T.ERR) & real & ~loss).any()  # a turn that closed no call was answered with <err>
    # a sampler node's episodes are played again on the learner: the same rewards, row by row
    p = tokens.shape[1] - scfg.max_new_tokens
    task = T.ToolArithmetic(turn=multiturn.TurnConfig(max_turns=3, max_obs_tokens=64))
    try:
        for r in range(len(tokens)):
            keep = real[r, p:]
            got = multiturn.replay(task, prompts[r // 4], tokens[r, p:][keep], (real & ~loss)[r, p:][keep],
                                   scfg.max_new_tokens)
            assert got == (float(batch.rewards[r]), None), r
    finally:
        task.close()


def test_replay_refuses_observations_the_environment_did_not_give():
    task = T.ToolArithmetic(turn=multiturn.TurnConfig(max_turns=3))
    try:
        prompt, episode, keep = TASK.supervised(np.random.default_rng(1), 1)[0]
        obs = [k == 0 for k in keep]
        budget = TASK.max_answer_len
        assert multiturn.replay(task, prompt, episode, obs, budget) == (1.0, None)
        first = obs.index(True)
        forged = list(episode)
        forged[first] = encode("9")[0] if episode[first] != encode("9")[0] else encode("8")[0]
        assert "not the environment's answer" in multiturn.replay(task, prompt, forged, obs, budget)[1]
        no_call = [False] * (first - 1) + [True] + obs[first:]  # an observation right after a digit
        assert "follows no tool call" in multiturn.replay(task, prompt, episode, no_call, budget)[1]
        short = multiturn.TurnConfig(max_turns=2)
        with_limit = T.ToolArithmetic(turn=short)
        try:  # two calls and an answer: the second call is the last turn allowed
            assert "past task.max_turns=2" in multiturn.replay(with_limit, prompt, episode, obs, budget)[1]
        finally:
            with_limit.close()
    finally:
        task.close()
