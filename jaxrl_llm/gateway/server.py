"""The gateway's HTTP face: OpenAI-compatible chat completions in front of `service.Gateway`.

FastAPI on uvicorn: the stack `openai`-style servers in Python use (vLLM, SGLang, AReaL's proxy),
with pydantic-free handlers here because every field is checked by `fields.check`
and refused by name. A session is named by the base URL (`/s/<session>/v1`, what a stock client
takes as `base_url`) or by the `X-Session-Id` header. Loopback by default; any other host needs
the run's token, sent as the bearer key (`api_key=` of the stock client).

  POST /v1/chat/completions          one assistant turn (`stream=true`: server-sent events, the text
                                     as the slots decode it, segment by segment; tool calls once parsed)
  POST /v1/responses                 one assistant turn, OpenAI's Responses API (`responses.py`; streams too)
  POST /v1/completions               one text turn (the session's text so far, then new text; streams too)
  GET  /v1/models                    the one model served
  POST /rl/sessions/{id}/reward      {"reward": r} (null: the task's check): the session closes, is trained
  GET  /rl/prompts?max=n             gateway.external: up to n sessions to play ({session, problem, base_url})
  GET  /rl/stats                     the sessions' counters
"""

import asyncio
import hmac
import ipaddress
import json
import re
import threading
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxrl_llm.gateway import chat, responses

SESSION_HEADER = "x-session-id"
MAX_BODY = 4 << 20  # bytes a request body may have
SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
KEEP_ALIVE_S = 75  # seconds an idle connection stays open: longer than clients keep theirs (`Server`)


def _error(status: int, message: str, param: Optional[str] = None):
    kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 500: "server_error"}.get(
        status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _param(message: str) -> str:
    head = message.split(":", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return head if head.replace("_", "").isalnum() else None


def app(gateway, token: Optional[str] = None, prompts=None):
    """The ASGI app over `gateway`; `token`: the bearer key every request must carry (None: none);
    `prompts(n)`: sessions for agents elsewhere (`GET /rl/prompts`; None: the run plays its own)."""
    # The guard runs inside each handler: starlette's middleware class cost as much CPU per request
    # as the handler itself (py-spy), on the cores the slots decode with.
    api = FastAPI(title="jaxrl_llm gateway", docs_url=None, redoc_url=None, openapi_url=None)
    want = None if token is None else f"Bearer {token}".encode()

    def refused(request: Request):
        if want is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(), want):
            return _error(401, "a bearer token is required (the run's token)")
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            return _error(413, f"request body over {MAX_BODY} bytes")
        return None

    def turns(kind: str):
        """The two routes of a kind of turn: the session in the header, or in the base URL."""
        async def plain(request: Request):
            return refused(request) or await _answer(gateway, request, request.headers.get(SESSION_HEADER), kind)

        async def named(session: str, request: Request):
            return refused(request) or await _answer(gateway, request, session, kind)

        return plain, named

    for path, kind in (("chat/completions", "chat"), ("responses", "responses"), ("completions", "text")):
        plain, named = turns(kind)
        api.post(f"/v1/{path}")(plain)
        api.post(f"/s/{{session}}/v1/{path}")(named)

    async def models(request: Request):
        return refused(request) or {"object": "list", "data": [{"id": gateway.model, "object": "model",
                                                                "owned_by": "jaxrl_llm", "created": 0}]}

    api.get("/v1/models")(models)
    api.get("/s/{session}/v1/models")(models)

    @api.post("/rl/sessions/{session}/reward")
    async def reward(session: str, request: Request):
        return refused(request) or await _reward(gateway, session, request)

    @api.get("/rl/prompts")
    async def waiting(request: Request):
        if prompts is None:
            return refused(request) or _error(404, "this run plays its agents itself (gateway.external=False)")
        try:
            n = int(request.query_params.get("max", "1"))
        except ValueError:
            n = 0
        if not 1 <= n <= 1024:
            return refused(request) or _error(400, "max: an integer from 1 to 1024", "max")
        return refused(request) or {"sessions": prompts(n)}

    @api.get("/rl/stats")
    async def stats(request: Request):
        return refused(request) or gateway.counts()

    return api


async def _body(request: Request) -> dict:
    """The request's JSON, read no further than `MAX_BODY` bytes (a chunked body names no length)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise chat.ChatError(f"body: over {MAX_BODY} bytes")
    try:
        return json.loads(raw)
    except ValueError:
        raise chat.ChatError("body: not JSON") from None
    except RecursionError:  # arrays or objects nested deeper than Python's parser goes
        raise chat.ChatError("body: nested too deeply") from None


async def _answer(gateway, request: Request, session: Optional[str], kind: str):
    """One turn of `session` for a chat (`kind="chat"`) or text completion request."""
    if not session or not SESSION_ID.fullmatch(session):
        return _error(400, "a session id (1-128 of A-Z a-z 0-9 _ . : -): /s/<session>/v1 as the base URL, "
                      "or the X-Session-Id header", "session")
    start = time.perf_counter()
    try:
        body = await _body(request)
        if kind == "responses":
            asked = responses.to_chat(body, gateway.recall(session, body.get("previous_response_id")))
            future = gateway.chat(session, asked)
        else:
            future = (gateway.chat if kind == "chat" else gateway.complete)(session, body)
    except chat.UnknownSession as e:
        return _error(404, str(e), "session")
    except chat.ChatError as e:
        return _error(409 if "in flight" in str(e) else 400, str(e), _param(str(e)))
    head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": gateway.model}
    if body.get("stream") and kind == "responses":
        return StreamingResponse(_streamed_response(gateway, session, gateway.watch(session), future, body, asked,
                                                    start),
                                 media_type="text/event-stream")
    if body.get("stream"):
        usage = isinstance(body.get("stream_options"), dict) and bool(body["stream_options"].get("include_usage"))
        stop = chat.stop_strings(body.get("stop"))
        return StreamingResponse(_streamed(gateway, gateway.watch(session), future, head, kind, start, usage, stop),
                                 media_type="text/event-stream")
    try:
        got = await asyncio.wrap_future(future)
    except chat.ChatError as e:
        return _error(500 if isinstance(e, chat.TurnFailed) else 409, str(e))
    gateway.answered(1e3 * (time.perf_counter() - start))
    if kind == "responses":
        out = responses.response(got, body, gateway.model)
        gateway.remember(session, out["id"], responses.history(body, asked, got.message))
        return JSONResponse(out)
    ids = {} if got.ids is None else {"prompt_token_ids": got.ids[0], "token_ids": got.ids[1]}  # as vLLM's
    if kind == "text":
        choice = {"index": 0, "text": got.message, "finish_reason": got.finish, "logprobs": None, **ids}
        return JSONResponse({**head, "object": "text_completion", "choices": [choice], "usage": got.usage})
    choice = {"index": 0, "message": got.message, "finish_reason": got.finish, "logprobs": got.logprobs}
    if ids:  # chat: the prompt's at the top, the turn's in its choice
        head, choice = {**head, "prompt_token_ids": ids["prompt_token_ids"]}, {**choice, "token_ids": ids["token_ids"]}
    return JSONResponse({**head, "object": "chat.completion", "usage": got.usage, "choices": [choice]})


async def _reward(gateway, session: str, request: Request):
    try:
        body = await _body(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise chat.ChatError("reward: a number, or null for the task's check")
        value = body["reward"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise chat.ChatError("reward: a number, or null for the task's check")
        value = None if value is None else float(value)
        gateway.reward(session, value)
    except KeyError:
        return _error(404, f"no session {session!r}")
    except chat.ChatError as e:
        return _error(400, str(e), _param(str(e)))
    return JSONResponse({"session": session, "reward": value})


def _visible(text: str, kind: str, stop=()) -> str:
    """What of a turn's text so far can be sent: a chat turn's up to its first tool call (sent as
    `tool_calls` once parsed), nothing from a stop string on, and never a marker's or a stop
    string's first characters (the next tokens may complete it); no character a later token may
    complete (a replacement character)."""
    text = text[:chat.first_stop(text, stop)]
    marks = ([chat.CALL_OPEN] if kind == "chat" else []) + list(stop)
    if kind == "chat":
        text = text.split(chat.CALL_OPEN, 1)[0]
    held = max((k for m in marks for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
    return text[:len(text) - held].rstrip("\ufffd")


async def _growing(gateway, row: int, future, kind: str, stop: tuple = (), blank: bool = True):
    """What of the turn's text `_visible` lets through, each piece once as it grows (the slots'
    segments), until its answer is ready; `blank=False`: nothing while it is only whitespace."""
    sent = ""
    while not future.done():
        text = _visible(gateway.so_far(row), kind, stop)
        if len(text) > len(sent) and text.startswith(sent) and (blank or text.strip()):
            yield text[len(sent):]
            sent = text
        await asyncio.sleep(0.01)


def _event(head: dict, kind: str, delta, reason=None, logprobs=None) -> str:
    """One server-sent event: a chat.completion.chunk (`delta` a dict) or a text_completion
    (`delta` the text). `head` carries `usage: null` when the stream ends with its usage, as
    OpenAI's chunks do."""
    if kind == "chat":
        c = {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                                      "finish_reason": reason}]}
    else:
        c = {**head, "object": "text_completion", "choices": [{"index": 0, "text": delta, "finish_reason": reason,
                                                                "logprobs": None}]}
    return f"data: {json.dumps(c)}\n\n"


async def _streamed(gateway, row: int, future, head: dict, kind: str, start: float, usage: bool = False,
                    stop: tuple = ()):
    """A turn as server-sent events while the slots decode it: its text as it grows (each
    segment's tokens), then the rest of its content, each tool call, the finish reason (with the
    turn's `logprobs` when asked: every drawn id's, in that one chunk, since the text streamed is
    the decoded text so far and not cut at ids), the turn's usage (`stream_options.include_usage`:
    a chunk of no choices, the others `usage: null`, as OpenAI sends it) and [DONE]. A client that
    leaves stops the events; its turn still ends in the slots."""
    sent, final = "", head
    head = {**head, "usage": None} if usage else head
    try:
        if kind == "chat":
            yield _event(head, kind, {"role": "assistant", "content": ""})
        async for piece in _growing(gateway, row, future, kind, stop):
            yield _event(head, kind, {"content": piece} if kind == "chat" else piece)
            sent += piece
        try:
            message, finish, counted, logprobs = future.result()[:4]
        except chat.ChatError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        gateway.answered(1e3 * (time.perf_counter() - start))
        # the rest of the content (a turn with tool calls strips its text: what was sent may then
        # end in whitespace its content lacks, and nothing more is sent)
        content = (message.get("content") or "") if kind == "chat" else message
        if content.startswith(sent) and len(content) > len(sent):
            yield _event(head, kind, {"content": content[len(sent):]} if kind == "chat" else content[len(sent):])
        for i, call in enumerate(message.get("tool_calls", ()) if kind == "chat" else ()):
            yield _event(head, kind, {"tool_calls": [{"index": i, **call}]})
        yield _event(head, kind, {} if kind == "chat" else "", finish, logprobs)
        if usage:
            chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
            yield f"data: {json.dumps({**final, 'object': chunk, 'choices': [], 'usage': counted})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        gateway.unwatch(row)


async def _streamed_response(gateway, session: str, row: int, future, body: dict, asked: dict, start: float):
    """A Responses turn as server-sent events (`responses.Stream`): its text as the slots decode
    it (from its first visible character on), then each item and the whole response. `asked`:
    the request as chat (`responses.to_chat`)."""
    events, sent = responses.Stream(body, gateway.model), ""
    try:
        for e in events.start():
            yield e
        async for piece in _growing(gateway, row, future, "chat", blank=False):
            for e in events.text(piece):
                yield e
            sent += piece
        try:
            got = future.result()
        except chat.ChatError as e:
            yield events.error(str(e))
            return
        gateway.answered(1e3 * (time.perf_counter() - start))
        gateway.remember(session, events.ids[0], responses.history(body, asked, got.message))
        for e in events.end(got, sent):
            yield e
    finally:
        gateway.unwatch(row)


class Server:
    """uvicorn serving `app(gateway, token)` on a thread; `port=0` picks a free one (`.port`)."""

    def __init__(self, gateway, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None, prompts=None):
        import uvicorn

        if not _loopback(host) and not token:
            raise ValueError(f"gateway.host={host!r} is not loopback: the gateway needs the run's token there")
        # An idle connection is closed by the client first: the stock client's pool keeps one 5 s,
        # uvicorn's default too, and a client reusing one as the server closed it got a connection
        # error (an agent error) when a step left the agents idle about that long.
        self.config = uvicorn.Config(app(gateway, token, prompts), host=host, port=port, log_level="warning",
                                     access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="gateway-http")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway could not serve on {host}:{port}")
            time.sleep(0.01)
        self.host, self.port = host, self.server.servers[0].sockets[0].getsockname()[1]

    def url(self, session: Optional[str] = None) -> str:
        base = f"http://{self.host}:{self.port}"
        return f"{base}/s/{session}/v1" if session else f"{base}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
