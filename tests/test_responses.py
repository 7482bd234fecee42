"""`gateway/responses.py`: OpenAI Responses requests as chat turns and chat answers as responses
(no model; the endpoint through the stock client is in tests/test_gateway.py)."""

import json

import pytest
from hypothesis import given, strategies as st

from jaxrl_llm.gateway import chat, responses
from jaxrl_llm.gateway.sessions import Answer

TOOL = {"type": "function", "name": "calc", "description": "add", "parameters": {"type": "object"}, "strict": True}


def test_a_turns_text_and_function_calls_are_one_assistant_message():
    """A message item and the function_call items after it are one assistant turn; a call with no
    text before it opens one of empty text; outputs are tool messages; instructions the system
    message; plain text input one user message."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "two plus "}, {"type": "input_text",
                                                                                        "text": "three"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me add"}]},
             {"type": "function_call", "call_id": "a", "name": "calc", "arguments": '{"x": 2}'},
             {"type": "function_call", "call_id": "b", "name": "calc", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "a", "output": "5"},
             {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "0"}]},
             {"type": "function_call", "call_id": "c", "name": "calc", "arguments": "{}"}]
    got = responses.to_chat({"model": "m", "instructions": "be brief", "input": items, "tools": [TOOL],
                             "max_output_tokens": 7, "temperature": 1.0})
    calls = lambda *xs: [{"id": i, "type": "function", "function": {"name": "calc", "arguments": a}}  # noqa: E731
                         for i, a in xs]
    assert got["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus three"},
        {"role": "assistant", "content": "let me add", "tool_calls": calls(("a", '{"x": 2}'), ("b", "{}"))},
        {"role": "tool", "tool_call_id": "a", "content": "5"}, {"role": "tool", "tool_call_id": "b", "content": "0"},
        {"role": "assistant", "content": "", "tool_calls": calls(("c", "{}"))}]
    assert got["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                                     "parameters", "strict")}}]
    assert (got["max_tokens"], got["temperature"], got["model"]) == (7, 1.0, "m") and "max_output_tokens" not in got
    assert responses.to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_an_answer_is_a_response_of_message_and_function_call_items():
    usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 2}'}}
    out = responses.response(Answer({"role": "assistant", "content": "adding", "tool_calls": [call]}, "tool_calls",
                                    usage), {"tools": [TOOL]}, "policy")
    text, fc = out["output"]
    assert (text["type"], text["content"][0]["text"]) == ("message", "adding")
    assert (fc["type"], fc["call_id"], fc["name"], fc["arguments"]) == ("function_call", "call_1", "calc", '{"x": 2}')
    assert out["status"] == "completed" and out["usage"]["input_tokens"] == 10 and out["usage"]["output_tokens"] == 4
    only_calls = responses.response(Answer({"role": "assistant", "content": "", "tool_calls": [call]}, "tool_calls",
                                           usage), {}, "policy")
    assert [o["type"] for o in only_calls["output"]] == ["function_call"]
    cut = responses.response(Answer({"role": "assistant", "content": "abc"}, "length", usage), {}, "policy")
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    # the next request repeats the output items: the same assistant message as the chat answer
    again = responses.to_chat({"input": [{"role": "user", "content": "q"}, *out["output"]]})["messages"][1]
    assert chat.normal(again) == chat.normal({"role": "assistant", "content": "adding", "tool_calls": [call]})


def test_a_stream_is_openais_events_and_ends_with_the_whole_response():
    """The events of a turn streamed as "Hel", "lo " then ended as "Hello there" with a tool call,
    each validated by the `openai` package's own models (strictly, not as its client constructs
    them): the deltas and the rest make the final text; every item added is done; the response
    completed is the one a request without `stream` gets, its ids those the events named."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    usage = {"prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19}
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 2}'}}
    answer = Answer({"role": "assistant", "content": "Hello there", "tool_calls": [call]}, "tool_calls", usage)
    stream = responses.Stream({"tools": [TOOL]}, "policy")
    raw = stream.start() + stream.text("Hel") + stream.text("lo ") + stream.end(answer, "Hello ")
    parse = TypeAdapter(ResponseStreamEvent).validate_python
    events = [parse(json.loads(e.split("data: ", 1)[1])) for e in raw]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert all(e.split("\n", 1)[0] == f"event: {p.type}" for e, p in zip(raw, events))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    final = events[-1].response
    assert [e.item for e in events if e.type == "response.output_item.done"] == final.output
    assert final.id == events[0].response.id and final.output[0].id == events[2].item.id
    alone = Response.model_validate(responses.response(answer, {"tools": [TOOL]}, "policy", stream.ids))
    assert alone.model_dump(exclude={"created_at"}) == final.model_dump(exclude={"created_at"})
    cut = responses.Stream({}, "policy").end(Answer({"role": "assistant", "content": "abc"}, "length", usage), "")
    assert json.loads(cut[-1].split("data: ", 1)[1])["type"] == "response.incomplete"


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 9) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(["type", "role", "content", "text", "name", "call_id", "output", "x"]), inner,
                         max_size=3), max_leaves=6)
_AT = (("input",), ("input", 0), ("input", 0, "content"), ("input", 1, "type"), ("input", 1, "arguments"),
       ("input", 2, "output"), ("input", 2, "call_id"), ("tools",), ("tools", 0), ("instructions",),
       ("max_output_tokens",), ("text",), ("background",), ("previous_response_id",), ("include",), ("reasoning",),
       ("service_tier",))


@given(at=st.sampled_from(_AT), value=_JSON)
def test_any_value_anywhere_converts_or_is_refused_by_its_responses_name(at, value):
    body = {"input": [{"role": "user", "content": "q"},
                      {"type": "function_call", "call_id": "a", "name": "calc", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "a", "output": "5"}], "tools": [dict(TOOL)]}
    where = body
    for k in at[:-1]:
        where = where[k]
    where[at[-1]] = value
    try:
        got = responses.to_chat(body)
    except chat.ChatError as e:
        assert str(e).startswith(at[0]), (at, value, str(e))
        return
    json.dumps(got)
    for i, m in enumerate(got["messages"]):  # every message the chat check then reads
        chat.normal(m, f"messages[{i}]")


@pytest.mark.parametrize("body,field", [({"input": []}, "input"), ({"input": [{"type": "reasoning"}]}, "input[0].type"),
                                        ({"input": "q", "background": True}, "background"),
                                        ({"input": "q", "seed": 1}, "seed"),
                                        ({"input": "q", "text": {"format": {"type": "json_schema"}}}, "text.format"),
                                        ({"input": "q", "max_output_tokens": 0}, "max_output_tokens"),
                                        ({"input": [{"type": "function_call", "call_id": "a", "name": "f",
                                                     "arguments": "[" * 10**5}]}, "input[0].arguments")])
def test_what_cannot_be_served_is_refused_by_name(body, field):
    with pytest.raises(chat.ChatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        responses.to_chat(body)


def test_previous_response_id_puts_the_new_input_after_the_conversation_that_response_ended():
    """`history` keeps a response's conversation without its instructions (OpenAI carries none
    over); `to_chat` puts the new request's instructions first, then that conversation, then the
    new input; a name with no conversation (another session's, an unknown one) is refused by it."""
    first = {"instructions": "be brief", "input": "q", "tools": [dict(TOOL)]}
    asked = responses.to_chat(first)
    said = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}
    before = responses.history(first, asked, said)
    assert before == [{"role": "user", "content": "q"}, said]
    nxt = {"instructions": "be kind", "previous_response_id": "resp_1",
           "input": [{"type": "function_call_output", "call_id": "c1", "output": "5"}]}
    assert responses.to_chat(nxt, before)["messages"] == [{"role": "system", "content": "be kind"}, *before,
                                                           {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    assert responses.history({}, responses.to_chat({"input": "q"}), said) == before
    for bad in ("resp_1", 7):
        with pytest.raises(chat.ChatError, match="^previous_response_id"):
            responses.to_chat({**nxt, "previous_response_id": bad})
