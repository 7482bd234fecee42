"""The embedded calculator task written as an ordinary OpenAI function-calling agent: the stock
client, the `tools=[...]` API, its own tool, no jaxrl_llm import. Trained through the gateway:

    python -m jaxrl_llm.main --config=configs/agent_calculator.py --workdir=runs/agent_calculator

The run hands each session a client pointed at the gateway and a problem ({"prompt": "37*48*91="}).
Returning None leaves the reward to the task (its check of the final answer); an agent that can
judge its own episode returns a number instead.
"""

import json
import re

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - *.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    """The tool: integers joined by + - *, evaluated left to right with * first."""
    if not re.fullmatch(r"\d+([-+*]\d+)*", expression or ""):
        return "error: not an expression of integers and + - *"
    total = 0
    for term in re.findall(r"[-+]?[^-+]+", expression):
        sign = -1 if term.startswith("-") else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return str(total)


async def agent(client, problem, max_turns: int = 4):
    messages = [{"role": "user", "content": problem["prompt"]}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            return None  # an answer, or the session's token budget is spent: the task checks it
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(args.get("expression"))})
    return None
