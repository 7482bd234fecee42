import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.tasks import arithmetic as A
from jaxrl_llm.tasks import warmstart


def test_tokenizer_round_trip_and_rewards():
    assert A.decode(A.encode("12+34=")) == "12+34="
    assert A.decode(A.encode("46") + [A.EOS] + A.encode("99")) == "46"
    task = A.Arithmetic(digits=2, ops="+-*")
    rng = np.random.default_rng(0)
    for prompt in task.prompts(rng, 50):
        text = A.decode(prompt[1:])
        a, op, b = next((text[:-1].split(o, 1)[0], o, text[:-1].split(o, 1)[1]) for o in "+-*" if o in text[:-1])
        truth = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        right = A.encode(str(truth)) + [A.EOS, 5, 6]
        assert task.reward(prompt, right) == 1.0
        assert task.reward(prompt, A.encode(str(truth + 1)) + [A.EOS]) == 0.0
        assert task.reward(prompt, A.encode(str(truth)) + A.encode("0")) == float(str(truth) + "0" == str(truth))
        assert len(prompt) <= task.max_prompt_len and len(A.encode(str(truth))) + 1 <= task.max_answer_len
    assert task.eval_prompts() == task.eval_prompts()  # fixed held-out set
    with pytest.raises(ValueError, match="valid: \\+, -, \\*"):
        A.Arithmetic(ops="/")
    with pytest.raises(ValueError, match="not in the arithmetic vocabulary"):
        A.encode("1/2")


def test_digits_reward_gives_partial_credit():
    task = A.Arithmetic(digits=2, reward_kind="digits")
    prompt = [A.BOS] + A.encode("37+48=")  # 85
    assert task.reward(prompt, A.encode("85") + [A.EOS]) == 1.0
    assert task.reward(prompt, A.encode("84") + [A.EOS]) == 0.5
    assert task.reward(prompt, A.encode("850") + [A.EOS]) == pytest.approx(2 / 3)  # too long: penalised
    assert task.reward(prompt, [A.EOS]) == 0.0
    with pytest.raises(ValueError, match="valid: exact, digits"):
        A.Arithmetic(reward_kind="partial")


def test_warm_start_learns_and_accuracy_is_measured():
    task = A.Arithmetic(digits=1, ops="+", eval_size=32)
    cfg = ModelConfig(vocab_size=A.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    params = models.init_params(cfg, jax.random.key(0))
    greedy = Sampler(cfg, SamplerConfig(max_new_tokens=task.max_answer_len, temperature=0.0, eos_token_id=A.EOS,
                                        pad_token_id=A.PAD, prompt_buckets=(task.max_prompt_len,)))
    before = warmstart.accuracy(params, greedy, task, task.eval_prompts())
    params, losses = warmstart.warm_start(params, cfg, task, steps=300, batch_size=64, lr=3e-3)
    after = warmstart.accuracy(params, greedy, task, task.eval_prompts())
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:5])
    assert after > before + 0.3, (before, after)


def test_raising_and_non_finite_rewards_score_zero_and_are_counted():
    from jaxrl_llm import tasks

    class Task:
        def reward(self, prompt, completion):
            return {0: 1.0, 1: float("nan"), 2: float("inf")}.get(completion[0]) if completion[0] < 3 else 1 / 0

    tokens = np.array([[0], [1], [2], [3]])
    rewards, failures = tasks.score(Task(), [[9]] * 4, tokens, np.ones_like(tokens, bool), 1)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and failures == 3
