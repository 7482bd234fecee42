"""What an OpenAI request may ask of a turn here, checked field by field before any session sees
it (`check`), and what a checked one asks of its turn (`ask`). No I/O.

The run's sampling distribution is fixed (its tokens are trained as drawn): a field that would
change it (another temperature, a penalty, a constrained choice of tool) is refused by name, as
is any field this gateway does not know; a field of the wrong shape is refused at its name too.
"""

from __future__ import annotations

import math

from jaxrl_llm.gateway import chat, sessions

# what the run's sampling distribution fixes (checked for equality), what is taken, and what is
# ignored; any other field is refused by name
FIXED = ("temperature", "top_p", "top_k")
TAKEN = ("model", "messages", "prompt", "tools", "tool_choice", "stream", "stream_options", "max_tokens",
         "max_completion_tokens", "n", "parallel_tool_calls", "logprobs", "top_logprobs", "stop", "return_token_ids")
IGNORED = ("user", "metadata", "store")
BOOLS = ("stream", "parallel_tool_calls", "return_token_ids")  # `logprobs`: an integer on /v1/completions
ZERO = ("presence_penalty", "frequency_penalty")  # accepted at their neutral value only
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # stop strings a request may give (OpenAI's limit), characters each


def ask(body: dict, format) -> sessions.Ask:
    """What a (checked) request asks of its turn: log-probs, a shorter turn, its calls, its ids.
    A format that is not a chat template's (the embedded calculator's) closes every turn at its
    one call."""
    caps = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    calls = body.get("tool_choice") != "none"
    one_call = calls and body.get("parallel_tool_calls") is False and bool(body.get("tools"))
    return sessions.Ask(logprobs=(body.get("top_logprobs") or 0) if body.get("logprobs") else None,
                        max_tokens=min(caps) if caps else None, stop=chat.stop_strings(body.get("stop")),
                        one_call=one_call and isinstance(format, chat.ChatFormat), calls=calls,
                        token_ids=bool(body.get("return_token_ids")))


def check(body, kind: str, cfg, format) -> None:
    """Refuse (`chat.ChatError`, starting with the field's name) a request `body` of `kind`
    (`messages`: chat completions; `prompt`: text completions) that the run's sampler config
    `cfg` cannot serve as drawn, or that is not the shape OpenAI gives it."""
    if not isinstance(body, dict):
        raise chat.ChatError("body: a JSON object")
    other = "prompt" if kind == "messages" else "messages"
    if other in body or (kind == "prompt" and ("tools" in body or "tool_choice" in body)):
        raise chat.ChatError(f"{other if other in body else 'tools'}: not a field of this endpoint")
    for k, v in body.items():
        _field(k, v, cfg)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or any(
            k not in ("include_usage", "include_obfuscation") or v not in (None, True, False)
            for k, v in options.items())):
        raise chat.ChatError("stream_options: an object of include_usage (true or false)")
    if not isinstance(body.get("model", ""), str):
        raise chat.ChatError("model: a string")
    if body.get("return_token_ids") and body.get("stream"):
        raise chat.ChatError("return_token_ids: not with stream=true (as SGLang; ask without streaming)")
    if body.get("n") not in (None, 1):
        raise chat.ChatError("n: one choice per request (open more sessions for more samples)")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise chat.ChatError("tool_choice: 'auto' or 'none' (the model decides, as it was sampled: 'required' or a "
                             "named function would constrain what is drawn)")
    _logprobs(body, kind, cfg.capture_topk)
    _stop(body, format)
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise chat.ChatError(f"{k}: a positive integer (the turn's tokens at most; the session's own budget is "
                                 f"sampler.max_new_tokens={cfg.max_new_tokens})")


def _field(k: str, v, cfg) -> None:
    if k in FIXED:
        run = getattr(cfg, k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise chat.ChatError(f"{k}: a number (this run samples with {k}={run})")
        if v is not None and not math.isclose(float(v), float(run), rel_tol=0, abs_tol=1e-9):
            raise chat.ChatError(f"{k}: this run samples with {k}={run}; its tokens are trained as drawn")
    elif k in ZERO:
        if v not in (None, 0, 0.0):
            raise chat.ChatError(f"{k}: only 0 (the run's sampling distribution)")
    elif k not in TAKEN and k not in IGNORED:
        raise chat.ChatError(f"{k}: not supported by this gateway")
    elif k in BOOLS and v not in (None, True, False):
        raise chat.ChatError(f"{k}: true or false")


def _stop(body: dict, format) -> None:
    stop = body.get("stop")
    if stop is None:
        return
    stops = chat.stop_strings(stop) if isinstance(stop, (str, list)) else ()  # anything else: refused
    if not 1 <= len(stops) <= MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise chat.ChatError(f"stop: a string or a list of 1 to {MAX_STOPS}, each of 1 to {MAX_STOP_CHARS} characters")
    if not isinstance(format, chat.ChatFormat):
        raise chat.ChatError("stop: not with this task's format (the embedded calculator's ids)")


def _logprobs(body: dict, kind: str, k: int) -> None:
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "prompt" and asked not in (None, 0):
        raise chat.ChatError("logprobs: chat completions only (/v1/chat/completions)")
    if asked not in (None, True, False):
        raise chat.ChatError("logprobs: true or false")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= k):
        raise chat.ChatError(f"top_logprobs: an integer from 0 to {k} (the top-K the run's samplers record, "
                             "sampler.capture_topk)")
    if top and not asked:
        raise chat.ChatError("top_logprobs: needs logprobs=true")
