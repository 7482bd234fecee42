"""`gateway/sessions.py`: the session protocol with an injected clock and a stub format (no
slots, no HTTP): extension, branch, the model's side ending a row, rewards and timeouts."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_llm.gateway import chat, sessions


class Format:
    """Renders a message as [role id, one id per content character]; the turn closes with 99."""
    stop_id = 99

    def prompt(self, msgs, tools=None):
        return [t for m in msgs for t in [len(m["role"])] + [ord(c) for c in m["content"]]]

    def extension(self, before, new, tools=None):
        return [-1] + self.prompt(new)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def reply(self, ids, turn_id):
        text = "".join(chr(i) for i in ids if i != 99)
        return {"role": "assistant", "content": text}, []


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def _table(max_turns=4, timeout=10.0):
    clock = Clock()
    return sessions.Sessions(Format(), max_turns, timeout, clock=clock), clock


USER = {"role": "user", "content": "hi"}


def test_a_session_extends_its_row_and_a_reward_closes_it():
    t, _ = _table()
    answer, row = t.request("a", [USER])
    assert row.prompt == [4, ord("h"), ord("i")] and not row.branched
    reply = t.respond(row.id, [ord("o"), ord("k"), 99], [False] * 3)
    # usage: the prompt's 3 ids were read, "o" "k" and the closing 99 drawn
    assert answer.result() == sessions.Answer({"role": "assistant", "content": "ok"}, "stop",
                                              {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
    nxt, again = t.request("a", [USER, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "5"}])
    assert again is None and reply.result().obs_ids == (-1, 4, ord("5")) and not reply.result().done
    with pytest.raises(chat.ChatError, match="in flight"):  # one request at a time per session
        t.request("a", [USER])
    t.respond(row.id, [ord("o"), ord("k"), 99, -1, 4, 53, ord("x"), 99], [False] * 3 + [True] * 3 + [False] * 2)
    assert nxt.result()[0]["content"] == "x" and row.turns == 2
    assert nxt.result()[2] == {"prompt_tokens": 3 + 6, "completion_tokens": 2, "total_tokens": 11}  # after 3 obs
    assert t.reward("a", 1.0) == [row.id] and row.state == "closed" and t.counts["closed"] == 1
    with pytest.raises(chat.ChatError, match="closed"):
        t.request("a", [USER])
    with pytest.raises(chat.ChatError, match="already"):
        t.reward("a", 0.0)
    with pytest.raises(KeyError):
        t.reward("nobody", 0.0)


@pytest.mark.parametrize("edit", ["changed", "dropped", "ended"])
def test_anything_but_an_exact_continuation_branches(edit):
    t, _ = _table()
    _, row = t.request("b", [USER])
    reply = t.respond(row.id, [ord("o"), 99], [False, False])
    said = {"role": "assistant", "content": "o"}
    if edit == "ended":  # the model's side ended the row (EOS): nothing can be appended to it
        t.finished(row.id, [ord("o"), 99], [False, False], eos=True)
        msgs = [USER, said, USER]
    else:
        msgs = [{"role": "user", "content": "ho"}, said, USER] if edit == "changed" else [USER]
    _, new = t.request("b", msgs)
    assert new is not None and new.branched and new.prompt == Format().prompt([chat.normal(m) for m in msgs])
    assert row.state == "closed" and reply.result().done and t.counts["branched"] == 1


def test_the_turn_limit_ends_the_row_and_the_model_side_answers_a_waiting_request():
    t, _ = _table(max_turns=1)
    answer, row = t.request("c", [USER])
    assert t.respond(row.id, [ord("a"), 99], [False, False]).result().done and row.ended
    answer2, row2 = t.request("d", [USER])
    t.finished(row2.id, [ord("z")] * 3, [False] * 3, eos=False)  # the budget ran out mid-turn
    assert answer2.result() == sessions.Answer({"role": "assistant", "content": "zzz"}, "length",
                                               {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})


def test_idle_sessions_time_out_and_are_dropped_counted():
    t, clock = _table(timeout=10.0)
    _, row = t.request("e", [USER])
    reply = t.respond(row.id, [ord("a"), 99], [False, False])
    _, busy = t.request("f", [USER])  # generating: the slots still owe it an answer, never expired
    clock.now = 11.0
    assert t.expire() == ["e"] and reply.result().done and t.counts["timed_out"] == 1
    assert t.rewards["e"] != t.rewards["e"]  # nan: handed over as dropped
    assert busy.state == "generating"


def test_messages_are_checked_by_field():
    t, _ = _table()
    for bad, field in (([{"role": "wizard", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
                       ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                          "arguments": "{"}}]}],
                        "messages[0].tool_calls[0].function.arguments"), ([], "messages"),
                       ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                          "arguments": "[" * 10**5}}]}],
                        "messages[0].tool_calls[0].function.arguments"),
                       ([{"role": "assistant", "content": "", "tool_calls": [{"function": {
                           "name": "f", "arguments": '{"a":' * 40 + "1" + "}" * 40}}]}],
                        "messages[0].tool_calls[0].function.arguments: nested")):
        with pytest.raises(chat.ChatError, match=field.replace("[", r"\[").replace("]", r"\]")):
            t.request("g", bad)


def test_tools_are_checked_by_position_before_any_template_sees_them():
    deep = {}
    for _ in range(995):  # past Python's recursion limit: looked at no deeper than the limit
        deep = {"a": deep}
    fn = {"name": "calc", "parameters": {"type": "object"}}
    for bad, field in (("calc", "tools"), ([{"type": "function"}], r"tools\[0\]"),
                       ([{"type": "web_search"}], r"tools\[0\]"),
                       ([{"type": "function", "function": {**fn, "name": "a b"}}], r"tools\[0\].function.name"),
                       ([{"type": "function", "function": {**fn, "description": 3}}], r"tools\[0\].function.desc"),
                       ([{"type": "function", "function": {**fn, "parameters": deep}}], r"tools\[0\].function.param"),
                       ([{"type": "function", "function": fn}] * 129, "tools")):
        with pytest.raises(chat.ChatError, match=field):
            chat.check_tools(bad)
    assert chat.check_tools([{"type": "function", "function": fn}]) == [{"type": "function", "function": fn}]
    assert chat.check_tools([]) is None and chat.check_tools(None) is None


def test_tool_calls_parse_from_the_models_own_format():
    msg, calls = chat.parse_turn('I will add. <tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
                                 '<tool_call>{"name": 3}</tool_call>', "t0")
    assert calls == [{"name": "calc", "arguments": {"x": 1}}] and msg["content"] == 'I will add. <tool_call>{"name": 3}</tool_call>'
    assert msg["tool_calls"] == [{"id": "call_t0_0", "type": "function",
                                  "function": {"name": "calc", "arguments": '{"x": 1}'}}]
    assert chat.normal(msg)["tool_calls"] == calls  # what a client echoes back compares equal
    plain, none = chat.parse_turn("just text", "t1")
    assert plain == {"role": "assistant", "content": "just text"} and none == []


def test_a_text_session_goes_on_when_its_prompt_extends_the_text_so_far():
    """`/v1/completions`: the next prompt must start with the prompt and the completion returned;
    the rest is encoded alone. Another prefix branches."""
    t, _ = _table()
    answer, row = t.complete("t", "2+2=")
    assert row.prompt == [ord(c) for c in "2+2="]
    reply = t.respond(row.id, [ord("4"), 99], [False, False])
    assert answer.result()[:2] == ("4", "stop") and row.messages == "2+2=4"
    nxt, same = t.complete("t", "2+2=4 and 3+3=")
    assert same is None and reply.result().obs_ids == tuple(ord(c) for c in " and 3+3=")
    t.respond(row.id, [ord("4"), 99] + [ord(c) for c in " and 3+3="] + [ord("6"), 99], [False] * 2 + [True] * 9 + [False] * 2)
    assert nxt.result() == sessions.Answer("6", "stop",
                                           {"prompt_tokens": 4 + 11, "completion_tokens": 2, "total_tokens": 17})
    _, branch = t.complete("t", "2+2=5 and")
    assert branch is not None and branch.branched and t.counts["branched"] == 1
    with pytest.raises(chat.ChatError, match="prompt"):
        t.complete("u", ["not", "text"])


def test_a_prompt_past_the_largest_bucket_is_refused_before_any_row_exists():
    """Nothing is registered for it: no row to feed, close or wait for at hand-over."""
    t = sessions.Sessions(Format(), 4, 10.0, max_prompt=3)
    with pytest.raises(chat.ChatError, match="messages: 4 prompt tokens exceed"):
        t.request("long", [{"role": "user", "content": "abc"}])
    assert t.rows == {} and t.latest == {} and t.counts["opened"] == 0
    _, row = t.request("long", [USER])  # 3 ids: fits
    assert row is not None and t.counts["opened"] == 1


def test_a_run_that_names_its_sessions_opens_no_other():
    """`named`: a made-up name, a name the run stopped waiting for, and the name of a session
    already handed over open nothing (no row for the slots, none left unclaimed); a name handed
    out opens once, and a refused first request (too long) does not use it up."""
    t = sessions.Sessions(Format(), 4, 10.0, max_prompt=3, named=True)
    t.expect(["a", "b"])
    with pytest.raises(chat.UnknownSession, match="'intruder'"):
        t.request("intruder", [USER])
    with pytest.raises(chat.ChatError, match="exceed"):
        t.request("a", [{"role": "user", "content": "abc"}])
    _, row = t.request("a", [USER])
    assert row is not None and t.expected == {"b"}
    t.respond(row.id, [ord("k"), 99], [False, False])
    _, branch = t.request("a", [{"role": "user", "content": "yo"}])  # its own session goes on (a branch)
    assert branch is not None and branch.branched
    t.forget(["b"])
    with pytest.raises(chat.UnknownSession):
        t.request("b", [USER])
    t.reward("a", 1.0)
    del t.latest["a"], t.rewards["a"]  # handed over (`service.Gateway._settle`)
    with pytest.raises(chat.UnknownSession):
        t.request("a", [USER])
    assert t.rows.keys() == {row.id, branch.id} and t.counts["opened"] == 1


def test_a_turn_asked_for_logprobs_gets_the_recorded_ones():
    """Each id the turn drew (not the observation before it), with its recorded log-prob and the
    top ids asked for; ids of probability 0 (top-p) are left out, and a request that does not ask
    gets none."""
    t, _ = _table()
    inf = float("inf")
    answer, row = t.request("lp", [USER], ask=sessions.Ask(logprobs=1))
    scores = ([-0.5, -0.25], [[ord("o"), ord("x")], [99, ord("y")]], [[-0.5, -1.0], [-inf, -inf]])
    reply = t.respond(row.id, [ord("o"), 99], [False, False], scores)
    content = answer.result().logprobs["content"]
    assert content == [{"token": "o", "logprob": -0.5, "bytes": [ord("o")], "top_logprobs": [
                           {"token": "o", "logprob": -0.5, "bytes": [ord("o")]}]},
                       {"token": "c", "logprob": -0.25, "bytes": [ord("c")], "top_logprobs": []}]
    plain, _ = t.request("lp", [USER, {"role": "assistant", "content": "o"}, USER])
    more = [ord("o"), 99, -1, 4, 104, 105, ord("z"), 99]
    t.respond(row.id, more, [False] * 2 + [True] * 4 + [False] * 2,
              tuple(np.zeros((8, 2)) if i else np.zeros(8) for i in range(3)))
    assert reply.result().obs_ids and plain.result().logprobs is None


def test_a_turn_cut_at_max_tokens_answers_length_and_the_session_goes_on_after_its_closing_token():
    """The turn stopped at `max_tokens` without its closing token (99): finish `length`; the next
    request's observation closes it first (as the template renders the turn) and carries the new
    request's limit; a turn that draws its closing token answers as usual."""
    t, _ = _table()
    answer, row = t.request("m", [USER], ask=sessions.Ask(max_tokens=2))
    reply = t.respond(row.id, [ord("o"), ord("k")], [False, False])
    assert answer.result()[:2] == ({"role": "assistant", "content": "ok"}, "length") and row.cut
    nxt, same = t.request("m", [USER, {"role": "assistant", "content": "ok"}, USER], ask=sessions.Ask(max_tokens=5))
    assert same is None and reply.result().obs_ids == (99, -1, 4, ord("h"), ord("i"))
    assert reply.result().max_tokens == 5
    t.respond(row.id, [ord("o"), ord("k"), 99, -1, 4, ord("h"), ord("i"), ord("x"), 99],
              [False] * 2 + [True] * 5 + [False] * 2)
    assert nxt.result()[:2] == ({"role": "assistant", "content": "x"}, "stop") and not row.cut


def test_a_turn_stopped_by_a_stop_string_answers_up_to_it_and_goes_on_after_its_closing_token():
    """The slots cut the turn at the id completing "k!" (`chat.turn_cut`, the earliest completion
    of any of the strings): the answer is its text before the string, finish `stop`; the row keeps
    what was drawn, and the next request's observation closes the turn first."""
    assert chat.turn_cut(Format(), [ord(c) for c in "ok!yes"], ("k!", "zz")) == 3
    assert chat.turn_cut(Format(), [ord(c) for c in "abcd"], ("bc", "c")) == 3 and chat.first_stop("abcd", ("c",)) == 2
    assert chat.turn_cut(Format(), [ord(c) for c in "ok"], ("k!",)) is None
    t, _ = _table()
    answer, row = t.request("st", [USER], ask=sessions.Ask(stop=("k!",)))
    reply = t.respond(row.id, [ord("o"), ord("k"), ord("!")], [False] * 3)
    assert answer.result()[:2] == ({"role": "assistant", "content": "o"}, "stop") and row.cut
    nxt, same = t.request("st", [USER, {"role": "assistant", "content": "o"}, USER])
    assert same is None and reply.result().obs_ids == (99, -1, 4, ord("h"), ord("i"))


def test_a_turn_allowed_one_tool_call_answers_that_call_and_goes_on_after_its_closing_token():
    """`parallel_tool_calls=false` (`Ask.one_call`): the slots cut the turn at the id completing its
    first whole call (a block that is no call does not count; a stop string before it cuts first).
    The answer holds that call alone, finish `tool_calls`, and the next request's observation
    closes the turn first. A turn that drew a second call before it could be cut (its closing
    token in the same segment) answers its first call only; the row keeps what was drawn."""
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = "a<tool_call>no</tool_call>" + call + call.replace('"f"', '"g"')
    drawn, first = [ord(c) for c in text], len("a<tool_call>no</tool_call>" + call)
    assert chat.turn_cut(Format(), drawn, one_call=True) == first and chat.turn_cut(Format(), drawn) is None
    assert chat.turn_cut(Format(), drawn, ("no",), one_call=True) == len("a<tool_call>no")
    assert chat.first_call_end(text) == first and chat.first_call_end(text[:first - 1]) is None
    class Calls(Format):
        stop_id = 1  # not a character of a call ("c" is 99)

    t = sessions.Sessions(Calls(), 4, 10.0, clock=Clock())
    answer, row = t.request("one", [USER], ask=sessions.Ask(one_call=True))
    reply = t.respond(row.id, drawn[:first], [False] * first)
    msg, finish = answer.result()[:2]
    assert finish == "tool_calls" and row.cut and msg["content"] == "a<tool_call>no</tool_call>"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("f", '{"x": 1}')]
    nxt, same = t.request("one", [USER, msg, {"role": "tool", "content": "1", "tool_call_id": "c"}])
    assert same is None and reply.result().obs_ids == (1, -1, 4, ord("1"))
    whole, row = t.request("both", [USER], ask=sessions.Ask(one_call=True))
    t.respond(row.id, drawn + [1], [False] * (len(drawn) + 1))
    assert [c["function"]["name"] for c in whole.result()[0]["tool_calls"]] == ["f"] and not row.cut
    assert whole.result()[1] == "tool_calls" and whole.result()[2]["completion_tokens"] == len(drawn) + 1


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8)


def _block(args: str) -> str:
    return '<tool_call>{"name": "f", "arguments": %s}</tool_call>' % args


_PIECES = st.one_of(st.text(max_size=6), st.sampled_from(["<tool_call>", "</tool_call>", "{", '"name"']),
                    _JSON.map(lambda v: _block(json.dumps(v))),
                    st.integers(0, 1500).map(lambda d: _block("[" * d + "]" * d)))


@settings(max_examples=60, deadline=None)
@given(st.lists(_PIECES, max_size=5).map("".join))
def test_any_model_turn_is_a_message_its_session_takes_back(text):
    """Whatever a model's turn says (calls with any JSON, nested past what a request may hold or
    past Python's parser, broken blocks), it parses into an assistant message that `normal` takes
    with the same calls: the session records it in the slots' thread, where an error would stop
    every session. A call nested deeper than a request's arguments may be (33 and up) stays text."""
    msg, calls = chat.parse_turn(text, "t")
    assert chat.normal(msg).get("tool_calls", []) == calls
    assert all(not chat._deeper(c["arguments"], chat.MAX_TOOL_DEPTH) for c in calls)


def test_a_call_nested_past_a_requests_limit_is_answered_as_text_and_the_session_goes_on():
    """A turn whose call nests 33 deep (before: `ChatError` out of `respond`, which stops the
    gateway's slots) answers as text; one 32 deep is a call."""
    class Calls(Format):
        stop_id = 1

    t = sessions.Sessions(Calls(), 4, 10.0, clock=Clock())
    for depth, called in ((33, False), (32, True)):
        text = _block("[" * depth + "]" * depth)
        answer, row = t.request(f"deep{depth}", [USER], ask=sessions.Ask(stop=("zzz",)))
        t.respond(row.id, [ord(c) for c in text] + [1], [False] * (len(text) + 1))
        msg, finish = answer.result()[:2]
        assert ("tool_calls" in msg, finish) == (called, "tool_calls" if called else "stop")


def test_a_failed_turn_ends_its_row_only_and_the_session_goes_on_as_a_branch():
    """`fail` (the slots could not answer a row's turn): the waiting request gets `TurnFailed`
    naming the session, the row's reply ends it, the count grows; the session's next request
    starts a branch, and another session is untouched."""
    t, _ = _table()
    answer, row = t.request("f", [USER])
    other, row2 = t.request("g", [USER])
    assert t.fail(row.id, ValueError("parse")).result().done and row.ended and t.counts["failed"] == 1
    with pytest.raises(chat.TurnFailed, match="'f'.*ValueError: parse"):
        answer.result()
    again, branch = t.request("f", [USER])
    assert branch.branched and t.counts["branched"] == 1 and not other.done()
    t.respond(row2.id, [ord("o"), 99], [False, False])
    assert other.result()[:2] == ({"role": "assistant", "content": "o"}, "stop")
