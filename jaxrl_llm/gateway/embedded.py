"""The embedded calculator task's vocabulary as a chat format, so that an ordinary OpenAI
function-calling agent can play `tool_arithmetic` through the gateway with no downloads.

  user message "37*48*91="           -> <bos> 3 7 * 4 8 * 9 1 =    (the task's own prompt ids)
  model turn   "<calc>37*48</calc>"  -> a `calculator` tool call, {"expression": "37*48"}
  tool message "1776"                -> 1 7 7 6                    (the built-in tool's observation)
  model turn   "161616<eos>"         -> the answer, finish reason "stop"

A tool result outside the vocabulary (an error message) becomes <err>, as the built-in
calculator answers a failing call. The task has no system role and one user message.
"""

from __future__ import annotations

import json
from typing import Sequence

from jaxrl_llm.gateway import chat
from jaxrl_llm.tasks import arithmetic, tool_arithmetic as ta

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - *.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _encode(text: str, where: str) -> list:
    if not text or set(text) - set(arithmetic.VOCAB):
        raise chat.ChatError(f"{where}: text of the task's characters ({''.join(arithmetic.VOCAB)})")
    return arithmetic.encode(text)


class ArithmeticChat:
    """`chat.ChatFormat`'s methods over `tool_arithmetic`'s ids; a turn closes at </calc>."""

    stop_id = ta.END

    def encode(self, text: str) -> list:
        return _encode(text, "prompt")

    def decode(self, ids: Sequence[int]) -> str:
        return ta.text(ids)

    def prompt(self, msgs: Sequence[dict], tools=None) -> list:
        if len(msgs) != 1 or msgs[0]["role"] != "user":
            raise chat.ChatError("messages: the calculator task starts with exactly one user message")
        return [arithmetic.BOS] + _encode(msgs[0]["content"], "messages[0].content")

    def extension(self, before: Sequence[dict], new: Sequence[dict], tools=None) -> list:
        out = []
        for i, m in enumerate(new):
            if m["role"] != "tool":
                raise chat.ChatError(f"messages[{len(before) + i}].role: only tool results follow a model turn here")
            text = m["content"].strip()
            out += arithmetic.encode(text) if text and not set(text) - set(arithmetic.VOCAB) else [ta.ERR]
        return out

    def reply(self, ids: Sequence[int], turn_id: str) -> tuple[dict, list]:
        ids = [int(i) for i in ids]
        if ta.CALL in ids and ids[-1:] == [ta.END]:
            start = len(ids) - 1 - ids[::-1].index(ta.CALL)
            expr = arithmetic.decode([t for t in ids[start + 1:-1] if t not in ta._TEXT])
            call = {"name": "calculator", "arguments": {"expression": expr}}
            msg = {"role": "assistant", "content": ta.text(ids[:start]),
                   "tool_calls": [{"id": f"call_{turn_id}_0", "type": "function",
                                   "function": {"name": "calculator", "arguments": json.dumps(call["arguments"])}}]}
            return msg, [call]
        return {"role": "assistant", "content": ta.text(ids)}, []
