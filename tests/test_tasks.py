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
