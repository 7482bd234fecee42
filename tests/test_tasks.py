"""`jaxrl_llm.tasks`: reward failures score 0 and are counted; every task declares its reward range."""

import numpy as np

from jaxrl_llm import tasks
from jaxrl_llm.tasks import arithmetic as A


def test_raising_and_non_finite_rewards_score_zero_and_are_counted():
    from jaxrl_llm import tasks

    class Task:
        def reward(self, prompt, completion):
            return {0: 1.0, 1: float("nan"), 2: float("inf")}.get(completion[0]) if completion[0] < 3 else 1 / 0

    tokens = np.array([[0], [1], [2], [3]])
    rewards, failures = tasks.score(Task(), [[9]] * 4, tokens, np.ones_like(tokens, bool), 1)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and failures == 3


def test_every_task_declares_its_reward_range_and_a_summed_multi_turn_one_spans_its_turns():
    from jaxrl_llm.tasks.multiturn import TurnConfig
    from jaxrl_llm.tasks.tool_arithmetic import ToolArithmetic

    assert tasks.reward_range(A.Arithmetic()) == (0.0, 1.0)
    assert tasks.reward_range(ToolArithmetic(turn=TurnConfig(turn_reward="last", max_turns=4))) == (0.0, 1.0)
    assert tasks.reward_range(ToolArithmetic(turn=TurnConfig(turn_reward="sum", max_turns=4))) == (0.0, 4.0)
    assert tasks.reward_range(object()) == tasks.UNDECLARED_RANGE
