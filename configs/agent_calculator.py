"""The embedded calculator task played by an OpenAI function-calling agent through the gateway
(`examples/calculator_agent.py`): the same problems, warm start and training as
`configs/tool_arithmetic.py`, but every episode is a session of the agent's own loop. No downloads.

    python -m jaxrl_llm.main --config=configs/agent_calculator.py --workdir=runs/agent_calculator
"""

from configs import tool_arithmetic


def get_config(arg: str = "a3po"):
    c = tool_arithmetic.get_config(arg)
    c.task.update(dict(name="agent", source="tool_arithmetic", agent="examples.calculator_agent:agent"))
    return c
