"""`tasks/arithmetic.py`: the embedded task against Python arithmetic."""
import re

import numpy as np
import pytest

from jaxrl_llm.tasks import arithmetic as A


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


def test_terms_and_scratchpad_knobs_against_python_arithmetic():
    """Operands are evaluated left to right; the scratchpad writes each running result."""
    task = A.Arithmetic(digits=2, ops="+-*", terms=4, scratchpad=True)
    rng = np.random.default_rng(1)
    for prompt_text, want in (task.problem(rng) for _ in range(200)):
        nums, ops = [int(n) for n in re.split(r"[-+*]", prompt_text[:-1])], re.findall(r"[-+*]", prompt_text[:-1])
        running, acc = [], nums[0]
        for op, n in zip(ops, nums[1:]):
            acc = eval(f"({acc}){op}({n})")
            running.append(str(acc))
        assert want == "=".join(running) and len(nums) == 4
        prompt = [A.BOS] + A.encode(prompt_text)
        assert task.answer(prompt) == running[-1] and len(prompt) <= task.max_prompt_len
        assert len(A.encode(want)) + 1 <= task.max_answer_len
        assert task.reward(prompt, A.encode(want) + [A.EOS]) == 1.0
        assert task.reward(prompt, A.encode(running[-1]) + [A.EOS]) == 1.0  # only the final result is graded
        assert task.reward(prompt, A.encode("0=" + running[-1] + "1") + [A.EOS]) == 0.0
        assert task.final_answer(A.encode(want) + [A.EOS, A.encode("5")[0]]) == running[-1]  # what maj@k votes on
    assert A.Arithmetic(digits=2, ops="+").max_answer_len == 4  # 99+99 = 198, <eos>
    assert A.Arithmetic(digits=2, ops="+*", terms=3).max_answer_len == 7  # 99*99*99 = 970299, <eos>
    assert A.Arithmetic(digits=1, ops="-", terms=3, scratchpad=True).max_answer_len >= 3 + 4  # "-9=" "-18<eos>"
    with pytest.raises(ValueError, match="terms >= 2"):
        A.Arithmetic(terms=1)


def test_digits_reward_gives_partial_credit():
    task = A.Arithmetic(digits=2, reward_kind="digits")
    prompt = [A.BOS] + A.encode("37+48=")  # 85
    assert task.reward(prompt, A.encode("85") + [A.EOS]) == 1.0
    assert task.reward(prompt, A.encode("84") + [A.EOS]) == 0.5
    assert task.reward(prompt, A.encode("850") + [A.EOS]) == pytest.approx(2 / 3)  # too long: penalised
    assert task.reward(prompt, [A.EOS]) == 0.0 and task.final_answer([A.EOS]) is None
    assert task.final_answer(A.encode("84") + [A.EOS]) == "84"
    with pytest.raises(ValueError, match="valid: exact, digits"):
        A.Arithmetic(reward_kind="partial")
