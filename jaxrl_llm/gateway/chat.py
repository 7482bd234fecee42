"""OpenAI chat messages <-> the token ids a session's row holds, through the tokenizer's chat
template. No I/O.

The rule that keeps "trained exactly as sampled": the model's turns are never encoded from
text. A session's row starts with its first request rendered by the template (the prompt);
after each model turn, the next request's new messages (tool results, a user message) are
rendered *as the template renders what follows that turn* and tokenised on their own
(`ChatFormat.extension`): the text after the turn's closing token in the rendering of the
whole conversation. The row then reads: prompt, sampled tokens, extension, sampled tokens, ...

Tool calls are the Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
inside the assistant's turn, parsed into OpenAI `tool_calls` (`parse_turn`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Optional, Sequence

CALL_OPEN = "<tool_call>"  # Hermes / Qwen tool calls: <tool_call>{"name": ..., "arguments": ...}</tool_call>
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ChatError(ValueError):
    """A request the session cannot take, with the field that is wrong."""


class UnknownSession(ChatError):
    """A request naming a session the run did not hand out (or one already handed over)."""


class TurnFailed(ChatError):
    """A model turn this gateway could not answer (its own fault, not the request's)."""


def text_of(content: Any, where: str, kinds: Sequence[str] = ("text",)) -> str:
    """A message's content as text: a string, or a list of text parts (of `kinds`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError(f"{where}: a string or a list of text parts")
    for i, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
            raise ChatError(f"{where}[{i}]: only text parts are supported ({', '.join(kinds)})")
    return "".join(p["text"] for p in content)


def _content(msg: dict, where: str) -> str:
    c = msg.get("content")
    return "" if c is None else text_of(c, f"{where}.content")


MAX_TOOLS, MAX_TOOL_DEPTH = 128, 32  # tools a request may declare (OpenAI's limit), nesting of each
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def _deeper(x: Any, limit: int) -> bool:
    """Whether JSON `x` nests deeper than `limit` (looking no deeper than that)."""
    items = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
    return limit < 1 or any(_deeper(v, limit - 1) for v in items if isinstance(v, (dict, list)))


def check_tools(tools: Any) -> Optional[list]:
    """A request's `tools` as OpenAI takes them (function tools: a name, an optional description
    and JSON-schema `parameters`), or None for none; anything else refused at its position, before
    the chat template sees it."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ChatError(f"tools: a list of at most {MAX_TOOLS} function tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatError(f"tools[{i}]: a function tool ({{\"type\": \"function\", \"function\": {{...}}}})")
        if not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise ChatError(f"tools[{i}].function.name: 1 to 64 of A-Z a-z 0-9 _ -")
        if not isinstance(fn.get("description", ""), str):
            raise ChatError(f"tools[{i}].function.description: a string")
        if not isinstance(fn.get("parameters", {}), dict) or _deeper(fn.get("parameters", {}), MAX_TOOL_DEPTH):
            raise ChatError(f"tools[{i}].function.parameters: a JSON schema object, nested at most {MAX_TOOL_DEPTH} "
                            "deep")
    return tools


def arguments(raw: Any, where: str):
    """A tool call's `arguments` (JSON text, or already parsed), parsed; nested at most
    MAX_TOOL_DEPTH deep (deeper ones would reach Python's recursion limit where they are compared
    or rendered)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser goes
            raise ChatError(f"{where}: not JSON") from None
    if _deeper(raw, MAX_TOOL_DEPTH):
        raise ChatError(f"{where}: nested deeper than {MAX_TOOL_DEPTH}")
    return raw


def normal(msg: Any, where: str = "messages") -> dict:
    """A message as the template and the history check see it: role, text content, and for an
    assistant its tool calls (name, parsed arguments); a tool message its call id. Anything
    else a client echoes back (refusal: None, annotations, ids of our choosing) is dropped."""
    if not isinstance(msg, dict):
        raise ChatError(f"{where}: a message object")
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ChatError(f"{where}.role: one of system, developer, user, assistant, tool (got {repr(role)[:40]})")
    out = {"role": "system" if role == "developer" else role, "content": _content(msg, where)}
    if role == "assistant" and msg.get("tool_calls"):
        calls = []
        for i, c in enumerate(msg["tool_calls"]):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ChatError(f"{where}.tool_calls[{i}].function.name: missing")
            said = arguments(fn.get("arguments"), f"{where}.tool_calls[{i}].function.arguments")
            calls.append({"name": fn["name"], "arguments": said})
        out["tool_calls"] = calls
    if role == "tool":
        if not isinstance(msg.get("tool_call_id", ""), (str, type(None))):
            raise ChatError(f"{where}.tool_call_id: a string")
        out["tool_call_id"] = msg.get("tool_call_id") or ""
    return out


def _template_message(m: dict) -> dict:
    """A normal message as HF chat templates take it (tool calls in the OpenAI shape)."""
    if "tool_calls" not in m:
        return dict(m)
    calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
    return {"role": "assistant", "content": m["content"], "tool_calls": calls}


def _call(block: str) -> Optional[dict]:
    """A `<tool_call>` block's JSON as a call ({"name": str, "arguments": ...} nested no deeper than
    a request's may be, so that the session takes it back), or None."""
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser goes
        return None
    named = isinstance(obj, dict) and isinstance(obj.get("name"), str)
    return obj if named and not _deeper(obj.get("arguments"), MAX_TOOL_DEPTH) else None


def first_call_end(text: str) -> Optional[int]:
    """Where the turn's first tool call (a `<tool_call>` block `parse_turn` takes) ends in `text`
    (None: no call is complete yet)."""
    return next((m.end() for m in CALL.finditer(text) if _call(m.group(1)) is not None), None)


def parse_turn(text: str, turn_id: str) -> tuple[dict, list]:
    """A model turn's text (its closing token dropped) -> (assistant message in the OpenAI shape,
    its tool calls as `normal` records them). A block that is not a JSON call stays as text."""
    calls, api = [], []
    kept = text
    for i, m in enumerate(CALL.finditer(text)):
        obj = _call(m.group(1))
        if obj is None:
            continue
        args = obj.get("arguments", {})
        calls.append({"name": obj["name"], "arguments": args})
        api.append({"id": f"call_{turn_id}_{i}", "type": "function",
                    "function": {"name": obj["name"], "arguments": json.dumps(args)}})
        kept = kept.replace(m.group(0), "", 1)
    msg = {"role": "assistant", "content": kept.strip() if calls else text}
    if api:
        msg["tool_calls"] = api
    return msg, calls


_SENTINEL = "\u2063turn\u2063"  # text no template writes on its own


def turn_stop_id(tokenizer) -> int:
    """The token the chat template closes an assistant turn with (Qwen / ChatML: <|im_end|>): the
    first token after an assistant message's text in the template's rendering."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the gateway needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}],
                                         tokenize=False)
    after = text[text.index(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in text else ""
    ids = tokenizer.encode(after, add_special_tokens=False) if after.strip() else []
    if not ids or not after.startswith(tokenizer.decode(ids[:1])):
        raise ValueError("the chat template closes no assistant turn with a token of its own")
    return int(ids[0])


class ChatFormat:
    """A tokenizer's chat template, the turn-closing token and the tools a session declared."""

    def __init__(self, tokenizer, stop_id: int):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the gateway needs a tokenizer with a chat template")
        self.tokenizer, self.stop_id = tokenizer, int(stop_id)
        self.stop_text = tokenizer.decode([self.stop_id])
        self.rewrites = False  # the template was seen rendering earlier turns anew (`_after_turn`)

    def _render(self, msgs: Sequence[dict], tools, generation: bool) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template([_template_message(m) for m in msgs], tokenize=False,
                                                  add_generation_prompt=generation, **kw)

    def encode(self, text: str) -> list:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, msgs: Sequence[dict], tools=None) -> list:
        """The first request's ids: the messages rendered, the assistant header open."""
        return self.encode(self._render(msgs, tools, True))

    def extension(self, before: Sequence[dict], new: Sequence[dict], tools=None) -> list:
        """The ids that follow a model turn (`before` ends with it) when `new` messages come:
        the whole conversation rendered, from just after the turn's closing token on. A template
        that renders earlier turns anew once new messages follow (Qwen3's drops the reasoning of
        the turns before the last user message) gives what it writes after the turn instead
        (`_after_turn`): the row keeps every turn as the model drew and read it."""
        said = self._render(before, tools, False)
        cut = said.rfind(self.stop_text)
        if cut < 0:
            raise ChatError(f"the chat template does not close an assistant turn with {self.stop_text!r}")
        cut += len(self.stop_text)
        full = self._render(list(before) + list(new), tools, True)
        if full.startswith(said[:cut]):
            return self.encode(full[cut:])
        return self.encode(self._after_turn(before, new, tools, said[cut:]))

    def _after_turn(self, before: Sequence[dict], new: Sequence[dict], tools, tail: str) -> str:
        """What the template writes after the model's last turn (`before[-1]`) and its closing
        token when `new` follow, found after a sentinel standing for that turn's text; `tail`:
        what it writes after a last turn's closing token (a newline), which must follow."""
        last = before[-1]
        if any(self.stop_text in json.dumps(c) for c in last.get("tool_calls", ())):
            raise ChatError(f"the model's last turn calls a tool with {self.stop_text!r} in it, and the chat template "
                            "renders earlier turns anew: this session cannot be extended token for token")
        marked = self._render(list(before[:-1]) + [{**last, "content": _SENTINEL}] + list(new), tools, True)
        at = marked.find(_SENTINEL)
        end = marked.find(self.stop_text, at + len(_SENTINEL)) if at >= 0 else -1
        rest = marked[end + len(self.stop_text):]
        if end < 0 or not rest.startswith(tail):
            raise ChatError("the chat template renders the earlier conversation differently once new messages "
                            "follow, and not the model's last turn as it was: this session cannot be extended token "
                            "for token")
        if not self.rewrites:
            self.rewrites = True
            logging.getLogger(__name__).warning(
                "the chat template renders earlier turns anew once new messages follow (as Qwen3's drops earlier "
                "reasoning); the gateway's rows keep every turn as the model drew and read it")
        return rest

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def reply(self, ids: Sequence[int], turn_id: str) -> tuple[dict, list]:
        """The model's turn (`ids`, the closing token included if it was drawn) -> `parse_turn`."""
        body = list(ids[:-1]) if len(ids) and ids[-1] == self.stop_id else list(ids)
        return parse_turn(self.tokenizer.decode(body), turn_id)


def logprobs(format, ids, logp, top_ids, top_logp, top: int) -> dict:
    """OpenAI's `choices[].logprobs` of a turn: each id it drew (its closing token too: every id
    is trained) with the log-prob the sampler recorded for it, and the `top` likeliest ids of the
    distribution it was drawn from (those of probability 0 under top-p / top-k left out)."""
    def entry(t, lp):
        text = format.decode([int(t)])
        return {"token": text, "logprob": float(lp), "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, q) for i, q in zip(ti[:top], tq[:top])
                                                          if math.isfinite(q)]}
                        for t, lp, ti, tq in zip(ids, logp, top_ids, top_logp)]}


def stop_strings(value) -> tuple:
    """A request's `stop` (a string, a list of them, or none) as a tuple of strings."""
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def first_stop(text: str, stop: Sequence[str]) -> Optional[int]:
    """Where `text` first holds one of the strings `stop` (None: nowhere)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def ends_turn(text: str, stop: Sequence[str] = (), one_call: bool = False) -> bool:
    """Whether a turn's text holds one of `stop`, or (`one_call`) a whole tool call."""
    if stop and first_stop(text, stop) is not None:
        return True
    return one_call and first_call_end(text) is not None


def turn_cut(format, ids, stop: Sequence[str] = (), one_call: bool = False) -> Optional[int]:
    """How many of a turn's `ids` to keep when its text `ends_turn`: up to the id that completes
    the first stop string or call (its draws past it are undone); None when there is none."""
    ids = [int(i) for i in ids]
    if not ends_turn(format.decode(ids), stop, one_call):
        return None
    return next(k for k in range(1, len(ids) + 1) if ends_turn(format.decode(ids[:k]), stop, one_call))


def first_difference(a: Sequence[dict], b: Sequence[dict]) -> Optional[int]:
    """The first index where two normal message lists differ (None: `a` is a prefix of `b`)."""
    for i, m in enumerate(a):
        if i >= len(b) or b[i] != m:
            return i
    return None
