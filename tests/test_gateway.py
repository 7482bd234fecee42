"""`gateway/`: agents on the stock `openai` client, sessions in the sampler's slots, and rows that
hold exactly the ids the sampler drew.

The policy is scripted so that turns are predictable: a word-level tokenizer of 19 tokens, a
one-hot embedding and an unembedding that gives each script token's successor a logit 16 above
the rest (`\\n` -> <tool_call> -> a call's JSON -> </tool_call> -> <|im_end|>; another token
about once in 10^5 draws) on top of random layers, so every turn is one tool call and the
log-probs (about -3e-6) still depend on the context."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from hypothesis import given, strategies as st

from jaxrl_llm.gateway import chat, responses, server as server_lib, service
from jaxrl_llm.learner import forward
from jaxrl_llm.models import decoder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.rollout import Sampler, SamplerConfig


CALL = '{"name": "calc", "arguments": {"x": 2}}'
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "\n", CALL]
WORDS = ["<unk>", "user", "assistant", "tool", "system", "what", "is", "two", "plus", "three", "five", "hi"]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "what is two plus three"}]


@functools.cache
def tokenizer(template=None):
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from jaxrl_llm.testing import CHAT_TEMPLATE

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIAL])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = template or CHAT_TEMPLATE
    return fast


def ids(*tokens):
    return tokenizer().convert_tokens_to_ids(list(tokens))


CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, tie_word_embeddings=False)


@functools.cache
def params(calls_again: bool = False):
    """`calls_again`: a call is followed by another (</tool_call> -> <tool_call>), never by the
    turn's end, so a turn calls until its limit."""
    p = decoder.init_params(CFG, jax.random.key(0))
    script = dict(zip(ids("\n", "<tool_call>", CALL, "</tool_call>"), ids("<tool_call>", CALL, "</tool_call>",
                                                                          "<tool_call>" if calls_again else
                                                                          "<|im_end|>")))
    head = np.asarray(p["lm_head"]).copy()
    for t, nxt in script.items():  # the final norm maps one-hot e_t to sqrt(D) e_t: logit 16
        head[t, nxt] += 16 / np.sqrt(CFG.hidden_size)
    return {**p, "embed": jnp.eye(CFG.vocab_size, CFG.hidden_size), "lm_head": jnp.asarray(head)}


@functools.cache
def sampler():
    eot, end = ids("<|endoftext|>", "<|im_end|>")
    return Sampler(CFG, SamplerConfig(max_new_tokens=48, temperature=1.0, capture_topk=2, num_samples=1,
                                      prompt_buckets=(32,), decode_segment=4, eos_token_id=eot, pad_token_id=eot,
                                      turn_stop_ids=(end,), batching="continuous", slots=4))


class Clock:
    """The monotonic clock, which a test may move forward."""
    ahead = 0.0

    def __call__(self):
        import time

        return time.monotonic() + self.ahead


@pytest.fixture(scope="module")
def served():
    fmt = chat.ChatFormat(tokenizer(), ids("<|im_end|>")[0])
    gw = service.Gateway(sampler(), fmt, params(), version=3, slots=4, max_turns=4, timeout_s=30, max_obs=16,
                         clock=Clock())
    srv = server_lib.Server(gw, token="sesame")
    yield gw, srv
    srv.close()
    gw.close()


def test_idle_connections_are_closed_by_the_stock_client_first(served):
    """The server keeps an idle connection longer than the `openai` client's pool does: with equal
    times, a client reusing one as the server closes it gets a connection error (seen in CI)."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    _, srv = served
    assert srv.config.timeout_keep_alive > 2 * DEFAULT_CONNECTION_LIMITS.keepalive_expiry


def _client(srv, session, key="sesame"):
    return openai.OpenAI(base_url=srv.url(session), api_key=key, max_retries=0, timeout=60)


def _reward(srv, session, value, key="sesame"):
    import json
    import urllib.request

    req = urllib.request.Request(f"http://{srv.host}:{srv.port}/rl/sessions/{session}/reward", method="POST",
                                 data=json.dumps({"reward": value}).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _closed(gw, n=1):
    import time

    got, deadline = [], time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        got += gw.closed()
        time.sleep(0.02)
    assert len(got) == n, gw.counts()
    return got


def test_three_tool_call_turns_round_trip_and_train_exactly_as_sampled(served):
    """Three turns through the stock client: each answer is a parsed tool call; the session's row
    is the first request rendered, then each turn's drawn ids and each tool result's rendered
    ids (loss 0, version -1); the learner's forward over it gives every behaviour log-prob."""
    gw, srv = served
    client, msgs, usage, slots = _client(srv, "s-three"), list(QUESTION), [], gw.slot_use()
    for turn in range(3):
        out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        usage.append((out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens))
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "calc"
        assert choice.message.tool_calls[0].function.arguments == '{"x": 2}'
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "five"}]
    _reward(srv, "s-three", 1.0)
    (done,) = _closed(gw)
    b = jax.tree.map(np.asarray, done.batch)
    assert done.session == "s-three" and done.reward == 1.0 and b.rewards.tolist() == [1.0]
    fmt = gw.format
    prompt = fmt.prompt([chat.normal(m) for m in QUESTION])
    turn = ids("<tool_call>", CALL, "</tool_call>", "<|im_end|>")
    ext = fmt.extension([chat.normal(m) for m in msgs[:2]], [chat.normal(msgs[2])])
    assert ext == ids("\n", "<|im_start|>", "tool", "\n", "five", "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n")
    real = b.input_mask[0] > 0
    row = b.tokens[0][real].tolist()
    want = prompt + turn + ext + turn + ext + turn
    assert row[:len(want)] == want  # the fourth turn was decoding when the reward came
    # each turn read the prompt and the turns and tool results before it; it drew its 4 ids
    before = [len(prompt) + t * (len(turn) + len(ext)) for t in range(3)]
    assert usage == [(n, len(turn), n + len(turn)) for n in before]
    p = 32
    drawn = b.loss_mask[0] > 0
    obs = real & ~drawn
    obs[:p] = False
    assert obs.sum() == 2 * len(ext) and (b.versions[0][obs] == -1).all() and (b.versions[0][drawn] == 3).all()
    # the slots' counters (`gateway/slot_occupancy`): this row's every position past its prompt,
    # drawn or forced, against 4 slots times the decode steps run
    tokens, capacity = (now - then for now, then in zip(gw.slot_use(), slots))
    assert tokens == real[p:].sum() and capacity % 4 == 0 and tokens <= capacity
    stats = forward.batch_stats(forward.Forward(CFG, PolicyDist(1.0), 16, None), params(),
                                jax.tree.map(jnp.asarray, done.batch), None, gather=False)
    # log(1 + ~3e-6) in float32 is a few dozen ulps of 1: equal within 20%; a token read at the
    # wrong position would be off by a factor of 1e6 (its logit 16 lower)
    np.testing.assert_allclose(np.asarray(stats["logp"])[0][drawn], b.behav_logp[0][drawn], rtol=0.2, atol=0)
    assert (b.behav_logp[0][drawn] < 0).all()


def test_the_responses_api_plays_the_same_row_as_chat_completions(served):
    """An agent on `client.responses.create` (the OpenAI Agents SDK's default), its function calls
    answered by `function_call_output` items, three turns: each answer a `function_call` item, and
    the session's row the very row the same conversation through chat completions holds: ids,
    loss mask, versions. What the endpoint cannot serve is refused by its Responses name."""
    gw, srv = served
    client = _client(srv, "s-responses")
    tools = [{"type": "function", **TOOLS[0]["function"], "strict": False}]
    for bad, field in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"input": [{"type": "reasoning", "summary": []}]}, r"input\[0\].type"),
                       ({"tools": [{"type": "web_search"}]}, r"tools\[0\].type"),
                       ({"text": {"format": {"type": "json_object"}}}, "text.format"), ({"temperature": 0.5},
                                                                                         "temperature")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.responses.create(**{"model": "policy", "input": "what is two plus three", **bad})
    items, msgs = [{"role": "user", "content": "what is two plus three"}], list(QUESTION)
    chat_client = _client(srv, "s-responses-chat")
    for turn in range(3):
        if turn == 1:  # streamed: OpenAI's events, the whole response in the last
            events = list(client.responses.create(model="policy", input=items, tools=tools, stream=True))
            assert [e.type for e in events] == [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
            assert [e.sequence_number for e in events] == list(range(6))
            assert events[4].item == events[5].response.output[0]
            out = events[-1].response
        else:
            out = client.responses.create(model="policy", input=items, tools=tools)
        (call,) = out.output
        assert (out.status, call.type, call.name, call.arguments) == ("completed", "function_call", "calc", '{"x": 2}')
        assert out.usage.output_tokens == 4
        items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                        "output": "five"}]
        said = chat_client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS).choices[0].message
        msgs += [said.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": said.tool_calls[0].id,
                                                      "content": "five"}]
    # the same conversation and tools as chat messages (this test's template renders no tools)
    same = responses.to_chat({"input": items, "tools": tools})
    def said(conversation):  # the tool call ids are each session's own
        return [{k: v for k, v in chat.normal(m).items() if k != "tool_call_id"} for m in conversation]

    assert said(same["messages"]) == said(msgs) and len(same["messages"]) == 7
    assert same["tools"] == [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}]
    for name in ("s-responses", "s-responses-chat"):
        _reward(srv, name, 1.0)
    rows = {c.session: jax.tree.map(np.asarray, c.batch) for c in _closed(gw, 2)}
    a, b = rows["s-responses"], rows["s-responses-chat"]
    for field in ("tokens", "input_mask", "loss_mask", "versions"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_allclose(a.behav_logp, b.behav_logp, rtol=0.2, atol=0)  # as drawn in other slots
    assert (a.loss_mask[0] > 0).sum() == 12  # three turns of 4 drawn ids


def test_previous_response_id_continues_a_sessions_own_responses(served):
    """A request naming the session's latest response with only the new input (and its own
    instructions, which OpenAI does not carry over) extends the row; naming an older response
    is an edited history, so a branch; a response of another session, or none, is refused by
    name."""
    gw, srv = served
    client, tools = _client(srv, "s-chained"), [{"type": "function", **TOOLS[0]["function"]}]
    first = client.responses.create(model="policy", instructions="hi", input="what is two plus three", tools=tools)
    branched = gw.counts()["branched"]

    def after(response, **kw):
        (call,) = response.output
        return client.responses.create(model="policy", instructions="hi", tools=tools, previous_response_id=response.id,
                                       input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": "five"}], **kw)

    second = after(first)
    third = list(after(second, stream=True))[-1].response
    assert [r.output[0].type for r in (second, third)] == ["function_call"] * 2
    assert third.previous_response_id == second.id and gw.counts()["branched"] == branched
    after(first)  # from an older response: the conversation edited
    assert gw.counts()["branched"] == branched + 1
    other = _client(srv, "s-chained-other")
    for named in (first.id, "resp_none"):
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            other.responses.create(model="policy", input="five", previous_response_id=named)
    _reward(srv, "s-chained", 1.0)
    (done,) = _closed(gw)
    assert done.branched.tolist() == [False, True] and done.turns.tolist() == [3, 1]  # the branch: its answer


def test_an_openai_agents_sdk_agent_trains_unchanged_over_responses_or_chat(served):
    """An agent of the OpenAI Agents SDK (`openai-agents`, its default Responses model, streamed or
    not, chaining its requests by `previous_response_id` or not, and its chat completions model)
    with a function tool, run for 3 turns (the scripted policy calls its tool every turn): one row
    each, nothing branched (each request continued the conversation exactly), 3 turns and 3 tool
    calls, every row the same ids."""
    import asyncio

    import agents

    gw, srv = served
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def calc(x: int) -> str:
        """add"""
        return "five"

    async def play(session, model_class, **run):
        client = openai.AsyncOpenAI(base_url=srv.url(session), api_key="sesame", max_retries=0)
        agent = agents.Agent(name="adder", tools=[calc], model=model_class(model="policy", openai_client=client))
        with pytest.raises(agents.exceptions.MaxTurnsExceeded):
            await agents.Runner.run(agent, "what is two plus three", max_turns=3, **run)
        await client.close()

    async def play_streamed(session):  # Runner.run_streamed: the Responses model's streams
        client = openai.AsyncOpenAI(base_url=srv.url(session), api_key="sesame", max_retries=0)
        agent = agents.Agent(name="adder", tools=[calc], model=agents.OpenAIResponsesModel(model="policy",
                                                                                              openai_client=client))
        run = agents.Runner.run_streamed(agent, "what is two plus three", max_turns=3)
        with pytest.raises(agents.exceptions.MaxTurnsExceeded):
            async for _ in run.stream_events():
                pass
        await client.close()

    plays = {"s-sdk-responses": lambda s: play(s, agents.OpenAIResponsesModel),
             "s-sdk-chat": lambda s: play(s, agents.OpenAIChatCompletionsModel), "s-sdk-streamed": play_streamed,
             "s-sdk-chained": lambda s: play(s, agents.OpenAIResponsesModel, auto_previous_response_id=True)}
    for session, how in plays.items():
        asyncio.run(how(session))
        gw.reward(session, 1.0)
    done = {c.session: c for c in _closed(gw, len(plays))}
    for c in done.values():
        assert (c.branched.tolist(), c.turns.tolist(), c.tool_calls.tolist()) == ([False], [3], [3]), c.session
    a, *others = (jax.tree.map(np.asarray, done[s].batch) for s in plays)
    for b in others:
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_turns_cut_by_max_tokens_or_a_stop_string_go_on_and_train_as_sampled(served):
    """Turns of the scripted 4 ids capped at 2 (the first, from its prompt) and 1 (after an
    observation), one stopped at a string inside its second id (the slots undo the 2 drawn past
    it in the segment), then one whole: the cut ones finish `length` / `stop`, the stopped one's
    text ends before the string; the row holds each one's kept ids, its closing token forced
    (loss 0, version -1) before the next request's ids, and the last turn whole; the learner
    reproduces every behaviour log-prob."""
    gw, srv = served
    client, msgs = _client(srv, "s-cut"), list(QUESTION)
    steps = (({"max_tokens": 2}, "length", 2), ({"max_completion_tokens": 1}, "length", 1),
             ({"stop": ['"x"']}, "stop", 2), ({}, "tool_calls", 4))
    for kw, finish, n in steps:
        out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, **kw)
        assert (out.choices[0].finish_reason, out.usage.completion_tokens) == (finish, n)
        msgs += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "five"}]
    assert '"x"' not in msgs[5]["content"] and msgs[5]["content"].startswith("<tool_call>")  # the stopped turn
    _reward(srv, "s-cut", 1.0)
    (done,) = _closed(gw)
    b, fmt = jax.tree.map(np.asarray, done.batch), gw.format
    script, close = ids("<tool_call>", CALL, "</tool_call>", "<|im_end|>"), ids("<|im_end|>")
    want, kinds = fmt.prompt([chat.normal(m) for m in QUESTION]), []
    for t, (_, _, n) in enumerate(steps[:-1]):
        ext = fmt.extension([chat.normal(m) for m in msgs[:2 * t + 2]], [chat.normal(msgs[2 * t + 2])])
        want, kinds = want + script[:n] + close + ext, kinds + [True] * n + [False] * (len(close) + len(ext))
    want, kinds = want + script, kinds + [True] * len(script)
    real = b.input_mask[0] > 0
    assert b.tokens[0][real].tolist() == want
    drawn, gen = b.loss_mask[0] > 0, np.flatnonzero(real[32:]) + 32  # the positions after the prompt
    assert drawn[gen].tolist() == kinds and (b.versions[0][gen[~np.asarray(kinds)]] == -1).all()
    stats = forward.batch_stats(forward.Forward(CFG, PolicyDist(1.0), 16, None), params(),
                                jax.tree.map(jnp.asarray, done.batch), None, gather=False)
    np.testing.assert_allclose(np.asarray(stats["logp"])[0][drawn], b.behav_logp[0][drawn], rtol=0.2, atol=0)


def test_parallel_tool_calls_false_ends_the_turn_at_its_first_call_as_drawn():
    """A policy that calls again after every call: a turn capped at 7 ids answers both calls it
    completed (`length`); with `parallel_tool_calls=false` (chat, or the Responses API) the slots
    end each turn at the id completing its first call (undoing the one drawn past it in the
    segment): one call, `tool_calls`. The row holds each turn's 3 drawn ids, its closing token
    forced (loss 0) before the tool result; the learner reproduces every behaviour log-prob."""
    fmt = chat.ChatFormat(tokenizer(), ids("<|im_end|>")[0])
    gw = service.Gateway(sampler(), fmt, params(calls_again=True), version=3, slots=4, max_turns=4, timeout_s=30,
                         max_obs=16)
    srv = server_lib.Server(gw, token="sesame")
    try:
        out = _client(srv, "s-many").chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS,
                                                             max_tokens=7).choices[0]
        assert out.finish_reason == "length" and len(out.message.tool_calls) == 2
        client, msgs = _client(srv, "s-one"), list(QUESTION)
        for turn in range(2):
            out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
            (call,) = out.choices[0].message.tool_calls
            assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("tool_calls", 3)
            msgs += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "five"}]
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        said = _client(srv, "s-one-responses").responses.create(model="policy", input="what is two plus three",
                                                                 tools=tools, parallel_tool_calls=False)
        assert [i.type for i in said.output] == ["function_call"] and said.parallel_tool_calls is False
        _reward(srv, "s-one", 1.0)
        (done,) = _closed(gw)
    finally:
        srv.close()
        gw.close()
    b = jax.tree.map(np.asarray, done.batch)
    call, close = ids("<tool_call>", CALL, "</tool_call>"), ids("<|im_end|>")
    ext = fmt.extension([chat.normal(m) for m in msgs[:2]], [chat.normal(msgs[2])])
    real, drawn = b.input_mask[0] > 0, b.loss_mask[0] > 0
    assert b.tokens[0][real].tolist() == fmt.prompt([chat.normal(m) for m in QUESTION]) + call + close + ext + call
    gen = np.flatnonzero(real[32:]) + 32
    assert drawn[gen].tolist() == [True] * 3 + [False] * (1 + len(ext)) + [True] * 3
    stats = forward.batch_stats(forward.Forward(CFG, PolicyDist(1.0), 16, None), params(calls_again=True),
                                jax.tree.map(jnp.asarray, done.batch), None, gather=False)
    np.testing.assert_allclose(np.asarray(stats["logp"])[0][drawn], b.behav_logp[0][drawn], rtol=0.2, atol=0)


def test_a_turn_the_gateway_cannot_answer_ends_its_session_not_the_slots(served, monkeypatch):
    """A turn whose answer raises in the slots' thread (here a parse made to fail once) gets an
    HTTP 500 naming its session; the slots go on: the gateway reports no error, the next request
    of that session starts a branch, and another session is answered as usual."""
    gw, srv = served
    parse, failed = gw.format.reply, []

    def reply(ids, turn_id):  # `turn_id`: "<row>_<turn>"
        if not failed and gw.sessions.rows[int(turn_id.split("_")[0])].session == "s-fail":
            failed.append(turn_id)
            raise RuntimeError("a parse this gateway got wrong")
        return parse(ids, turn_id)

    monkeypatch.setattr(gw.format, "reply", reply)
    failures = gw.counts()["failed"]
    with pytest.raises(openai.InternalServerError, match="'s-fail'.*a parse this gateway got wrong"):
        _client(srv, "s-fail").chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
    gw.check()
    branched = gw.counts()["branched"]
    assert gw.counts()["failed"] == failures + 1  # `gateway/turns_failed`
    for name in ("s-fail", "s-fine"):
        out = _client(srv, name).chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
        assert out.choices[0].finish_reason == "tool_calls"
        _reward(srv, name, 1.0)
    assert gw.counts()["branched"] == branched + 1 and len(failed) == 1
    assert sorted(c.session for c in _closed(gw, 2)) == ["s-fail", "s-fine"]


def test_tool_choice_none_answers_the_turn_as_its_text_and_the_session_goes_on(served):
    """`tool_choice="none"` (vLLM's way, without constraining the draw): the turn's text is the
    answer, its call not parsed (`stop`), streamed or not; the agent sends it back and the
    session extends its row. `required` or a named function would constrain what is drawn:
    refused by name."""
    gw, srv = served
    client, msgs, branched = _client(srv, "s-choice-none"), list(QUESTION), gw.counts()["branched"]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS,
                                                         tool_choice="none", stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish, calls = chunks[-1].choices[0].finish_reason, [c.choices[0].delta.tool_calls for c in chunks]
        else:
            out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, tool_choice="none")
            text, finish, calls = out.choices[0].message.content, out.choices[0].finish_reason, [
                out.choices[0].message.tool_calls]
        assert (finish, calls.count(None), text) == ("stop", len(calls), gw.format.decode(ids("<tool_call>", CALL,
                                                                                             "</tool_call>")))
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "five"}]
    assert client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS).choices[0].message.tool_calls
    for choice in ("required", {"type": "function", "function": {"name": "calc"}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            _client(srv, "s-choice-required").chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS,
                                                                    tool_choice=choice)
    _reward(srv, "s-choice-none", 1.0)
    (done,) = _closed(gw)
    assert (done.branched.tolist(), done.turns.tolist(), gw.counts()["branched"]) == ([False], [3], branched)


def test_return_token_ids_gives_the_ids_each_turn_read_and_drew_as_vllm_does(served):
    """vLLM's `return_token_ids`, which RL agent frameworks (verifiers, for prime-rl) read instead
    of tokenising again: `prompt_token_ids` the ids the turn read (the row so far), `token_ids`
    those it drew (its closing token too), as many as the usage counts; each turn's read ids go on
    from the last turn's read and drawn ids, and the trained row is the last turn's. A text
    completion carries both in its choice. With `stream=true`: refused by name."""
    gw, srv = served
    client, msgs, seen, asked = _client(srv, "s-ids"), list(QUESTION), [], {"return_token_ids": True}
    for turn in range(2):
        out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, extra_body=asked)
        read, drew = out.prompt_token_ids, out.choices[0].token_ids
        assert (len(read), len(drew)) == (out.usage.prompt_tokens, out.usage.completion_tokens)
        seen.append(read + drew)
        msgs += [out.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": out.choices[0].message.tool_calls[0].id, "content": "five"}]
    assert seen[0] == gw.format.prompt([chat.normal(m) for m in QUESTION]) + ids("<tool_call>", CALL, "</tool_call>",
                                                                                  "<|im_end|>")
    assert seen[1][:len(seen[0])] == seen[0] and len(seen[1]) > len(seen[0])
    text = _client(srv, "s-ids-text").completions.create(model="policy", prompt="what is two plus three",
                                                         extra_body=asked)
    assert text.choices[0].prompt_token_ids == gw.format.encode("what is two plus three")
    assert len(text.choices[0].token_ids) == text.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, stream=True, extra_body=asked)
    for name in ("s-ids", "s-ids-text"):
        _reward(srv, name, 1.0)
    rows = {c.session: jax.tree.map(np.asarray, c.batch) for c in _closed(gw, 2)}
    b = rows["s-ids"]
    assert b.tokens[0][b.input_mask[0] > 0].tolist()[:len(seen[1])] == seen[1]  # a third turn may have begun


# Qwen3's rule: an assistant turn before the last user message is rendered without its reasoning
DROPS_REASONING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and "
    "loop.index0 < ns.last and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


def test_a_template_that_drops_earlier_reasoning_still_extends_the_row_token_for_token():
    """Qwen3's template renders a turn's reasoning only until a user message follows it, so the
    conversation rendered again no longer starts with the row (before, such a request was refused):
    the new ids are what the template writes after the model's turn (the user message, the next
    header), the same as where nothing is rewritten; the row keeps the reasoning the model drew
    and read. Tool results alone keep it, and extend exactly as before."""
    fmt = chat.ChatFormat(tokenizer(DROPS_REASONING), ids("<|im_end|>")[0])
    plain = chat.ChatFormat(tokenizer(), ids("<|im_end|>")[0])
    before = [{"role": "user", "content": "what is two plus three"},
              {"role": "assistant", "content": "<think> hi </think> five"}]
    user, tool = {"role": "user", "content": "what is five plus two"}, {"role": "tool", "content": "five"}
    full = fmt._render(before + [user], None, True)
    assert "hi" not in full and not full.startswith(fmt._render(before, None, False))  # rewritten
    after = ids("\n", "<|im_start|>", "user", "\n", "what", "is", "five", "plus", "two", "<|im_end|>", "\n",
                "<|im_start|>", "assistant", "\n")
    assert fmt.extension(before, [user]) == plain.extension(before, [user]) == after
    assert fmt.rewrites and not plain.rewrites
    assert fmt.extension(before, [tool]) == plain.extension(before, [tool])
    cut = len(plain._render(before, None, False).rstrip("\n"))  # just after the turn's closing token
    assert plain._after_turn(before, [tool], None, "\n") == plain._render(before + [tool], None, True)[cut:]


def test_a_turn_asked_for_logprobs_carries_those_its_row_is_trained_with(served):
    """`logprobs=True, top_logprobs=2` through the stock client, answered whole or streamed: each
    drawn id of the turn, in order, with the behaviour log-prob and top-K the learner's row holds
    for it, bit for bit."""
    gw, srv = served
    client = _client(srv, "s-logprobs")
    for bad, field in (({"top_logprobs": 3, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 1}, "top_logprobs"),
                       ({"stop": ["a"] * 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop": "a" * 257}, "stop")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model="policy", messages=QUESTION, **bad)
    asked = dict(model="policy", messages=QUESTION, tools=TOOLS, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**asked)
    chunks = list(_client(srv, "s-logprobs-streamed").chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}))
    # OpenAI's chunks: `usage` null but in the last; log-probs as lists a client joins
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1]) and chunks[-1].usage
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    for name, content in (("s-logprobs", out.choices[0].logprobs.content), ("s-logprobs-streamed", streamed)):
        _reward(srv, name, 0.0)
        (done,) = _closed(gw)
        assert done.session == name
        b = jax.tree.map(np.asarray, done.batch)
        drawn = np.flatnonzero(b.loss_mask[0] > 0)[:len(content)]
        assert len(content) == out.usage.completion_tokens == chunks[-1].usage.completion_tokens == 4
        assert [c.token for c in content] == [tokenizer().decode([t]) for t in b.tokens[0][drawn]]
        np.testing.assert_array_equal([c.logprob for c in content], b.behav_logp[0][drawn])
        top = [[(x.token, x.logprob) for x in c.top_logprobs] for c in content]
        assert top == [[(tokenizer().decode([int(i)]), float(q)) for i, q in zip(ids_, qs)]
                       for ids_, qs in zip(b.topk_ids[0][drawn], b.topk_logp[0][drawn])]


def test_requests_outside_the_runs_distribution_or_token_are_refused_by_name(served):
    gw, srv = served
    client = _client(srv, "s-refused")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="policy", messages=QUESTION, temperature=0.5)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model="policy", messages=QUESTION, logit_bias={"3": 1.0})
    with pytest.raises(openai.BadRequestError, match="n: one choice"):
        client.chat.completions.create(model="policy", messages=QUESTION, n=2)
    # the session named by a header instead of the base URL, on each kind of turn's route
    unnamed = openai.OpenAI(base_url=srv.url(), api_key="sesame", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="session"):
        unnamed.responses.create(model="policy", input="what is two plus three")
    headed = unnamed.with_options(default_headers={"X-Session-Id": "s-header"})
    assert headed.responses.create(model="policy", input="what is two plus three").output[0].type == "function_call"
    _reward(srv, "s-header", 0.0)
    assert [c.session for c in _closed(gw)] == ["s-header"]
    with pytest.raises(openai.AuthenticationError):
        _client(srv, "s-refused", key="wrong").chat.completions.create(model="policy", messages=QUESTION)
    for wrong in (_client(srv, "s-refused", key="wrong").models.list, lambda: _reward(srv, "s-three", 1.0, key="x")):
        with pytest.raises((openai.AuthenticationError, OSError), match="401|Unauthorized|token"):
            wrong()
    assert [m.id for m in client.models.list().data] == ["policy"]
    import urllib.error
    import urllib.request

    def get(path, key="sesame"):
        req = urllib.request.Request(f"http://{srv.host}:{srv.port}{path}", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    for path, key, code in (("/rl/prompts", "sesame", 404), ("/rl/prompts", "x", 401)):
        with pytest.raises(urllib.error.HTTPError, match=str(code)):  # this gateway plays its own agents
            get(path, key)
    with pytest.raises(urllib.error.HTTPError, match="400"):  # null is the task's check; text is no reward
        _reward(srv, "s-none", "high")
    deep = urllib.request.Request(f"{srv.url('s-deep')}/chat/completions", data=b"[" * 10**5 + b"]" * 10**5,
                                  headers={"Authorization": "Bearer sesame"}, method="POST")
    with pytest.raises(urllib.error.HTTPError, match="400") as refused:
        urllib.request.urlopen(deep, timeout=30)
    assert "body: nested too deeply" in refused.value.read().decode()
    sent, status = _endless_chunked_body(srv, "/s/s-endless/v1/chat/completions")
    assert status.split()[1] == "400" and sent < 4 * server_lib.MAX_BODY  # refused once past the limit


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 70) | st.floats() | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                 max_size=3), max_leaves=6)
_FIELDS = (("temperature",), ("top_k",), ("n",), ("stream",), ("stream_options",), ("max_tokens",), ("stop",),
           ("logprobs",), ("top_logprobs",), ("tool_choice",), ("model",), ("parallel_tool_calls",), ("tools",),
           ("tools", 0), ("tools", 0, "function"), ("tools", 0, "function", "name"),
           ("tools", 0, "function", "parameters"), ("messages",), ("messages", 0), ("messages", 0, "role"),
           ("messages", 0, "content"), ("messages", 0, "tool_call_id"), ("messages", 0, "tool_calls"),
           ("return_token_ids",))


_LATER = (("messages", 1, "content"), ("messages", 1, "tool_calls", 0, "function", "arguments"),
          ("messages", 1, "tool_calls", 0, "id"), ("messages", 2), ("messages", 2, "role"), ("messages", 2, "content"),
          ("messages", 2, "tool_call_id"), ("tools", 0, "function", "description"))


@given(field=st.sampled_from(_FIELDS + _LATER), value=_JSON)
def test_any_value_at_any_field_is_answered_or_refused_by_name(served, field, value):
    """Whatever JSON a client puts at a field of a session's first request, or of its second
    (the first turn and a tool result after it), the gateway answers the turn or refuses it with
    an error that starts with that field's name; nothing else escapes (a template's or a float()'s
    exception was a 500 before)."""
    import copy
    import uuid

    gw, _ = served
    session = f"s-any-{uuid.uuid4().hex[:8]}"
    body = {"model": "policy", "messages": copy.deepcopy(QUESTION), "tools": copy.deepcopy(TOOLS)}
    if field in _LATER:  # a tool result after the session's first turn
        first = gw.chat(session, copy.deepcopy(body)).result(timeout=60).message
        body["messages"] += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "5"}]
    where = body
    for k in field[:-1]:
        where = where[k]
    where[field[-1]] = value
    try:
        answer = gw.chat(session, body).result(timeout=60)
    except chat.ChatError as e:
        assert str(e).startswith(field[0]), (field, value, str(e))
        if field not in _LATER:
            return  # no session was opened
    else:
        assert answer.finish in ("tool_calls", "stop", "length")
    gw.reward(session, 0.0)
    (done,) = _closed(gw)
    assert done.session == session


def _endless_chunked_body(srv, path: str, cap: int = 256 << 20):
    """Bytes of a chunked body (which names no length, and never ends) sent before the server
    answered, and its status line."""
    import select
    import socket

    s = socket.create_connection((srv.host, srv.port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\nTransfer-Encoding: chunked\r\n"
              "Content-Type: application/json\r\n\r\n".encode())
    chunk, sent = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16)), 0
    try:
        while sent < cap and not select.select([s], [], [], 0)[0]:
            s.sendall(chunk)
            sent += 1 << 16
    except OSError:  # the server closed the connection after answering
        pass
    with s:
        return sent, s.recv(200).split(b"\r\n", 1)[0].decode()


def test_an_edited_history_is_a_flagged_branch_never_spliced(served):
    """The agent rewrites its first message after a turn: a new row of the session, flagged,
    whose prompt is the conversation as sent; the old row keeps only what it had."""
    gw, srv = served
    client = _client(srv, "s-branch")
    first = client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS).choices[0].message
    edited = [{"role": "user", "content": "what is two plus five"}, first.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "five"}]
    second = client.chat.completions.create(model="policy", messages=edited, tools=TOOLS)
    assert second.choices[0].finish_reason == "tool_calls"
    _reward(srv, "s-branch", 0.5)
    (done,) = _closed(gw)
    assert done.branched.tolist() == [False, True] and gw.counts()["branched"] >= 1
    b = jax.tree.map(np.asarray, done.batch)
    fmt = gw.format
    for r, msgs in enumerate((QUESTION, edited)):
        prompt = fmt.prompt([chat.normal(m) for m in msgs])
        assert b.tokens[r][b.input_mask[r] > 0].tolist()[:len(prompt)] == prompt
    obs = (b.input_mask[0] > 0) & (b.loss_mask[0] == 0)
    assert obs[32:].sum() == 0  # nothing was forced into the old row


def test_a_streamed_answer_is_the_same_turn_as_events(served):
    gw, srv = served
    client = _client(srv, "s-stream")
    chunks = list(client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls and calls[0][0].function.name == "calc" and calls[0][0].function.arguments == '{"x": 2}'
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    prompt = len(gw.format.prompt([chat.normal(m) for m in QUESTION], TOOLS))
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        prompt, 4)  # <tool_call> CALL </tool_call> <|im_end|>
    # with a stop string inside the call: the events' text is the answer's, up to the string
    events = list(_client(srv, "s-stream-stop").chat.completions.create(model="policy", messages=QUESTION,
                                                                         stream=True, stop='"x"'))
    text = "".join(c.choices[0].delta.content or "" for c in events if c.choices)
    assert text == '<tool_call> {"name": "calc", "arguments": {' and events[-1].choices[0].finish_reason == "stop"
    for name in ("s-stream", "s-stream-stop"):
        _reward(srv, name, 0.0)
    assert {c.session for c in _closed(gw, 2)} == {"s-stream", "s-stream-stop"}


def test_a_stream_shows_neither_a_stop_string_nor_its_first_characters():
    """What a stream may send of a turn so far: nothing from a stop string on, and not the first
    characters of one (or of a tool call's marker) that the next tokens may complete."""
    v = server_lib._visible
    stop = ("\nObservation:",)
    assert v("it is 4\nObs", "text", stop) == v("it is 4\nObservation: x", "text", stop) == "it is 4"
    assert v("it is 4\nObsolete", "text", stop) == "it is 4\nObsolete"  # no longer a stop's start
    assert v("so <tool_c", "chat") == v("so <tool_call>{", "chat") == "so " and v("so <tool_c", "text") == "so <tool_c"
    assert v("a\ufffd", "text") == "a"


def test_many_concurrent_sessions_share_the_slots_none_lost_none_twice(served, monkeypatch):
    """32 sessions of two turns each through `AsyncOpenAI` over 4 slots: every session is handed
    over once, with its own reward, and holds its own two turns."""
    import asyncio

    gw, srv = served
    engine, seen = gw._engine, {"park": [], "keys": []}
    park, keys = engine._park, engine._keys
    monkeypatch.setattr(engine, "_park", lambda st, slots: (seen["park"].append(len(slots)), park(st, slots))[1])
    monkeypatch.setattr(engine, "_keys", lambda key, ids: (seen["keys"].append(len(ids)), keys(key, ids))[1])

    async def agent(i):
        client = openai.AsyncOpenAI(base_url=srv.url(f"many-{i}"), api_key="sesame", max_retries=0, timeout=120)
        msgs = list(QUESTION)
        for _ in range(2):
            m = (await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)).choices[0].message
            msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                       "content": "five"}]
        await asyncio.to_thread(_reward, srv, f"many-{i}", float(i))
        await client.close()

    async def main():
        await asyncio.gather(*(agent(i) for i in range(32)))

    asyncio.run(main())
    done = _closed(gw, 32)
    assert sorted(d.session for d in done) == sorted(f"many-{i}" for i in range(32))
    for d in done:
        b = jax.tree.map(np.asarray, d.batch)
        assert b.rewards.tolist() == [float(d.session.split("-")[1])] and d.turns.tolist() in ([2], [3])
        drawn = b.tokens[0][b.loss_mask[0] > 0].tolist()
        assert drawn[:8] == 2 * ids("<tool_call>", CALL, "</tool_call>", "<|im_end|>")
    assert gw.closed() == []
    # Parked pools and fed rows' keys take power-of-two counts, so the programs on them compile
    # once per size class, never once per count (a compile per step in a long run, most of its
    # time on this CPU); a handed-over row is read with a traced index.
    assert seen["park"] and seen["keys"]
    assert all(n & (n - 1) == 0 for n in seen["park"] + seen["keys"]), seen


def test_a_client_that_goes_away_is_timed_out_and_dropped(served):
    """A client that disconnects while its turn decodes: the turn still ends (its row parks, its
    slot goes to others), and with no next request or reward the session times out, is dropped
    and counted; nothing of it is handed over for training."""
    gw, srv = served
    before = gw.counts()["timed_out"]
    impatient = openai.OpenAI(base_url=srv.url("s-gone"), api_key="sesame", max_retries=0, timeout=0.001)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
    import time

    deadline = time.monotonic() + 30
    while gw.sessions.rows.get(gw.sessions.latest.get("s-gone", -1)) is None or \
            gw.sessions.rows[gw.sessions.latest["s-gone"]].state == "generating":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gw.sessions.clock.ahead += 31  # past gateway.session_timeout_s
    assert _closed(gw) == ["s-gone"] and gw.counts()["timed_out"] == before + 1


def test_text_completions_extend_a_session_too(served):
    gw, srv = served
    client = _client(srv, "s-text")
    prompt = "<|im_start|>user\nwhat is two plus three<|im_end|>\n<|im_start|>assistant\n"
    first = client.completions.create(model="policy", prompt=prompt)
    assert first.choices[0].finish_reason == "stop" and CALL in first.choices[0].text
    second = client.completions.create(model="policy", prompt=prompt + first.choices[0].text + " five \n")
    assert CALL in second.choices[0].text
    with pytest.raises(openai.BadRequestError, match="messages"):
        gw_body = {"model": "policy", "prompt": "hi", "messages": QUESTION}
        client.post("/completions", body=gw_body, cast_to=object)
    _reward(srv, "s-text", 1.0)
    (done,) = _closed(gw)
    b = jax.tree.map(np.asarray, done.batch)
    turn = ids("<tool_call>", CALL, "</tool_call>", "<|im_end|>")
    row = b.tokens[0][b.input_mask[0] > 0].tolist()
    want = gw.format.encode(prompt) + turn + ids("five", "\n") + turn
    assert row[:len(want)] == want and done.branched.tolist() == [False]


def test_a_streamed_turn_arrives_segment_by_segment_as_it_decodes(served, monkeypatch):
    """`stream=true` sends a turn's text while the slots decode it (each segment's tokens, read
    after the segment): a text turn of many segments arrives in several events, which together
    are the turn the session recorded. (Each segment is held 0.2 s here: this tiny model decodes
    a whole turn between two of the server's 10 ms looks.)"""
    import time

    gw, srv = served
    progress = service.Gateway.__call__
    monkeypatch.setattr(service.Gateway, "__call__", lambda self, parts: (progress(self, parts), time.sleep(0.2)))
    prompt = "<|im_start|>user\nsay something<|im_end|>\n<|im_start|>assistant"  # no newline: no scripted call
    long = False
    for k in range(24):  # sessions until one's turn outlasts a segment (a row's draws follow its id; about
        # a third of them do)
        name, pieces, finish = f"s-tokens-{k}", [], None
        for c in _client(srv, name).completions.create(model="policy", prompt=prompt, stream=True):
            pieces += [c.choices[0].text] if c.choices[0].text else []
            finish = c.choices[0].finish_reason or finish
        turn = gw.sessions.rows[gw.sessions.latest[name]].messages[len(prompt):]
        assert "".join(pieces) == turn and finish in ("stop", "length")
        _reward(srv, name, 0.0)
        (done,) = _closed(gw)
        assert done.session == name
        drawn = np.asarray(done.batch.tokens[0])[np.asarray(done.batch.loss_mask[0]) > 0]
        if np.isin(drawn, ids("<|endoftext|>", "<|im_end|>"), invert=True).sum() > sampler().cfg.decode_segment:
            long = True
            break
    assert long and len(pieces) >= 2, pieces
