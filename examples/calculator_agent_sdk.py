"""The embedded calculator task written with the OpenAI Agents SDK (`pip install openai-agents`):
an `Agent` with a `function_tool`, run by `Runner` on the SDK's default model (the Responses
API), no jaxrl_llm import. Trained through the gateway as it is:

    python -m jaxrl_llm.main --config=configs/agent_calculator.py --workdir=runs/agent_calculator_sdk \\
        --config.task.agent=examples.calculator_agent_sdk:agent

The run hands each session a client pointed at the gateway; the agent gives it to the SDK's
model. Returning None leaves the reward to the task (its check of the final answer).
"""

from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException

from examples.calculator_agent import calculate

set_tracing_disabled(True)  # traces go to OpenAI's servers otherwise


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - *."""
    return calculate(expression)


async def agent(client, problem, max_turns: int = 4):
    solver = Agent(name="calculator", tools=[calculator], model=OpenAIResponsesModel(model="policy",
                                                                                     openai_client=client))
    try:
        await Runner.run(solver, problem["prompt"], max_turns=max_turns)
    except AgentsException:  # out of turns, or the session's token budget spent: the task checks the transcript
        pass
    return None
