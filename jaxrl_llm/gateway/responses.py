"""OpenAI's Responses API (`POST /v1/responses`, what the OpenAI Agents SDK sends by default) as
the chat completions the gateway serves. No I/O.

A request's `instructions` and `input` items become chat messages (`to_chat`): a message item
its role and text; the `function_call` items after an assistant turn that turn's tool calls; a
`function_call_output` a tool message. The turn is then played as a chat turn of the session,
with the same rule (each request repeats the conversation so far, then adds to it), so a session
driven through this endpoint holds exactly the row the same conversation through chat completions
would. The answer becomes a `response` (`response`): the turn's text as a `message` item, each
tool call as a `function_call` item whose `call_id` the next request's output answers.

A stream (`stream=true`) sends OpenAI's events (`Stream`): the response created, the turn's
text as `response.output_text.delta` while the slots decode it, each item done, and the response
completed (or incomplete, for a turn cut at its token limit) whole.

`previous_response_id` continues from one of the session's own responses: the conversation
that response ended (`history`, its instructions left out, as OpenAI carries none over), then
the new input, under the new request's instructions. The session's rule is then the chat rule:
from its latest response it goes on; from an older one it branches.

Not served: reasoning items, built-in tools and structured outputs; each is refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional, Sequence

from jaxrl_llm.gateway import chat

# Responses fields the chat check takes as they are, and those only allowed at a neutral value
PASSED = ("model", "temperature", "top_p", "tool_choice", "parallel_tool_calls", "store", "metadata", "user",
          "stream")
NEUTRAL = {"reasoning": (None,), "include": (None, []),
           "truncation": (None, "disabled"), "background": (None, False), "stream_options": (None, {})}
TEXT_PARTS = ("input_text", "output_text", "text")


def to_chat(body: Any, previous: Optional[list] = None) -> dict:
    """A Responses request -> the chat completions body of the same turn; anything this gateway
    cannot serve refused by its Responses name. `previous`: the `history` of the response that
    `previous_response_id` names (None when the request names none, or one this session lacks)."""
    if not isinstance(body, dict):
        raise chat.ChatError("body: a JSON object")
    for k, v in body.items():
        if k in NEUTRAL and v not in NEUTRAL[k]:
            raise chat.ChatError(f"{k}: not served by this gateway's /v1/responses (only {NEUTRAL[k][-1]!r})")
        if k not in NEUTRAL and k not in PASSED and k not in ("input", "instructions", "tools", "max_output_tokens",
                                                              "text", "previous_response_id"):
            raise chat.ChatError(f"{k}: not supported by this gateway")
    named = body.get("previous_response_id")
    if named is not None and (not isinstance(named, str) or previous is None):
        raise chat.ChatError("previous_response_id: not a response of this session (the gateway keeps a session's "
                             "responses until it ends)")
    fmt = body.get("text")
    if fmt is not None and fmt not in ({}, {"format": {"type": "text"}}):
        raise chat.ChatError("text.format: only text (structured outputs constrain what is sampled)")
    out = {k: body[k] for k in PASSED if k in body}
    out["messages"] = messages(body.get("instructions"), body.get("input"), previous or [])
    if body.get("tools") is not None:
        out["tools"] = tools(body["tools"])
    cap = body.get("max_output_tokens")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise chat.ChatError("max_output_tokens: a positive integer")
        out["max_tokens"] = cap
    return out


def tools(value: Any) -> list:
    """Responses function tools ({type, name, description, parameters, strict}) as chat tools."""
    if not isinstance(value, list):
        raise chat.ChatError("tools: a list of function tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise chat.ChatError(f"tools[{i}].type: only function tools (built-in tools run at OpenAI)")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if k in t}})
    return out


def messages(instructions: Any, items: Any, previous: Sequence[dict] = ()) -> list:
    """`instructions`, the `previous` conversation and the `input` items as chat messages; a
    turn's function calls join the assistant message before them (or open one with no text)."""
    if instructions is not None and not isinstance(instructions, str):
        raise chat.ChatError("instructions: a string")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise chat.ChatError("input: a string or a list of at least one item")
    out = ([{"role": "system", "content": instructions}] if instructions else []) + list(previous)
    turn = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise chat.ChatError(f"{where}.role: one of user, system, developer, assistant")
            out.append({"role": role, "content": chat.text_of(item.get("content"), f"{where}.content", TEXT_PARTS)})
            turn = out[-1] if role == "assistant" else None
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise chat.ChatError(f"{where}.{k}: a string")
            chat.arguments(item["arguments"], f"{where}.arguments")
            if turn is None:
                out.append(turn := {"role": "assistant", "content": ""})
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise chat.ChatError(f"{where}.call_id: a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": chat.text_of(item.get("output"), f"{where}.output", TEXT_PARTS)})
            turn = None
        else:
            raise chat.ChatError(f"{where}.type: one of message, function_call, function_call_output (got "
                                 f"{repr(kind)[:40]})")
    return out


def history(body: dict, chat_body: dict, message: dict) -> list:
    """The conversation a response ended, as `previous_response_id` continues it: the chat
    messages of its request (`to_chat`'s), its instructions left out, then its answer."""
    return chat_body["messages"][1 if body.get("instructions") else 0:] + [message]


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _head(body: dict, model: str, rid: str, status: str) -> dict:
    """The fields a response states before its output: what it is and what its request set."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "status": status,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True)}


def response(answer, body: dict, model: str, ids: tuple = ()) -> dict:
    """A chat turn's `sessions.Answer` as a Responses `response`: its text as a message item (when
    it has text, or no tool call), each tool call as a function_call item. `ids`: the response's
    and its message item's, when a stream named them already."""
    rid, mid = ids or (f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}")
    msg, output = answer.message, []
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(_message(mid, msg.get("content") or ""))
    for call in msg.get("tool_calls", ()):
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "status": "completed",
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    cut = answer.finish == "length"
    used = answer.usage
    return {**_head(body, model, rid, "incomplete" if cut else "completed"),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "output": output, "instructions": body.get("instructions"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "metadata": body.get("metadata"),
            "previous_response_id": body.get("previous_response_id"), "reasoning": None, "store": False,
            "truncation": "disabled",
            "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": used["prompt_tokens"], "output_tokens": used["completion_tokens"],
                      "total_tokens": used["total_tokens"],
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


class Stream:
    """A Responses stream's server-sent events, numbered in order (`sequence_number`)."""

    def __init__(self, body: dict, model: str):
        self.body, self.model, self.n, self.opened = body, model, 0, False
        self.ids = (f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}")

    def _event(self, kind: str, **fields) -> str:
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.n - 1, **fields})}\n\n"

    def start(self) -> list:
        shell = {**_head(self.body, self.model, self.ids[0], "in_progress"), "output": [], "error": None,
                 "incomplete_details": None}
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def text(self, delta: str) -> list:
        """The turn's next text; the first opens its message item."""
        out = []
        if not self.opened:
            self.opened = True
            opened = _message(self.ids[1], "", "in_progress")
            out = [self._event("response.output_item.added", output_index=0, item=opened),
                   self._event("response.content_part.added", item_id=self.ids[1], output_index=0, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]
        return out + [self._event("response.output_text.delta", item_id=self.ids[1], output_index=0, content_index=0,
                                  delta=delta, logprobs=[])]

    def end(self, answer, sent: str) -> list:
        """The rest of the turn once it ended: the text not yet sent, each item done, and the whole
        response (`response.completed`, or `response.incomplete` for a turn cut at its limit)."""
        final, out = response(answer, self.body, self.model, self.ids), []
        for i, item in enumerate(final["output"]):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                rest = text[len(sent):] if text.startswith(sent) else ""
                out += self.text(rest) if rest or not self.opened else []
                out += [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                    text=text, logprobs=[]),
                        self._event("response.content_part.done", item_id=item["id"], output_index=i,
                                    content_index=0, part=item["content"][0])]
            else:
                out += [self._event("response.output_item.added", output_index=i, item={**item, "arguments": "",
                                                                                         "status": "in_progress"}),
                        self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                    name=item["name"], arguments=item["arguments"])]
            out.append(self._event("response.output_item.done", output_index=i, item=item))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=final)]

    def error(self, message: str) -> str:
        return self._event("error", code=None, message=message, param=None)
