"""Tools in the sandbox (`tasks.sandbox`, `tasks.tools`): a hard timeout, no network, a scratch
directory, bounded output; failures become observations and are counted."""

import ast
import os
import socket

import pytest

from jaxrl_llm.tasks import sandbox, tools
from tests import checkers


@pytest.fixture(scope="module")
def runner():
    r = sandbox.ToolRunner(workers=1, timeout=1.0, max_output_bytes=256)
    yield r
    r.close()


def test_calculator_is_exact_arithmetic_and_refuses_anything_else():
    assert tools.calculator("37 * 48 * 91") == str(37 * 48 * 91)
    assert tools.calculator("(7 - 10) / 4") == "-0.75" and tools.calculator("2 ** 10 // 3") == "341"
    for bad in ("__import__('os')", "x + 1", "9 ** 9 ** 9", "[1, 2]"):
        with pytest.raises(ValueError):
            tools.calculator(bad)


def test_a_failing_tool_is_an_observation_and_is_counted(runner):
    before = (runner.calls, runner.errors)
    ok = runner.run(tools.calculator, "12 * 12")
    bad = runner.run(tools.calculator, "open('/etc/passwd')")
    assert ok.status == "ok" and ok.text == "144"
    assert bad.status == "error" and bad.text.startswith("tool error: ValueError")
    assert (runner.calls, runner.errors) == (before[0] + 2, before[1] + 1)


def test_a_hanging_tool_is_killed_at_its_timeout_and_the_next_call_runs(runner):
    before = runner.timeouts
    out = runner.submit(checkers.hang, [(), ]).result(timeout=30)
    assert out[0].status == "timeout" and "timed out after 1 s" in out[0].text and runner.timeouts == before + 1
    assert runner.run(tools.calculator, "1 + 1").text == "2"  # a fresh worker took over


def test_ten_megabytes_of_output_are_cut_to_the_limit(runner):
    out = runner.run(checkers.shout, 10 << 20)
    assert out.status == "ok" and len(out.text.encode()) <= 256 and out.text.endswith("more bytes cut]")
    printed = runner.run(tools.python, "print('y' * (10 << 20))")
    assert len(printed.text.encode()) <= 256 and printed.text.startswith("yyyy")


def test_a_tool_cannot_reach_a_listener_on_this_machine(runner):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        out = runner.run(checkers.connect, server.getsockname()[1])
        assert out.status == "error" and "connected" not in out.text
        with pytest.raises(socket.timeout):
            server.accept()  # nothing arrived
    assert runner.isolation in ("netns", "socket-guard")


def test_a_tool_works_in_a_scratch_directory_that_close_removes():
    r = sandbox.ToolRunner(workers=1, timeout=5.0)
    where = r.run(checkers.write_here, "notes.txt").text
    assert where.startswith(r.scratch) and os.path.exists(os.path.join(where, "notes.txt"))
    r.close()
    assert not os.path.exists(r.scratch)


def test_tool_code_sees_none_of_the_run_s_environment(monkeypatch):
    monkeypatch.setenv("JAXRL_REMOTE_TOKEN", "s3cret-token")
    r = sandbox.ToolRunner(workers=1, timeout=10.0, max_output_bytes=1 << 16)
    try:
        out = r.run(checkers.environment)
    finally:
        r.close()
    assert out.status == "ok" and "'HOME'" in out.text, out.text
    assert "s3cret-token" not in out.text and "JAXRL_REMOTE_TOKEN" not in out.text
    seen = ast.literal_eval(out.text.split("}", 1)[0] + "}")
    assert set(seen) <= {*sandbox.ENV_KEPT, "HOME", "TMPDIR", "JAXRL_TOOL_NETNS"}
