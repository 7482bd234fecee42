"""Tools in the sandbox (`tasks.sandbox`, `tasks.tools`): a hard timeout, no network, a scratch
directory, bounded output; failures become observations and are counted."""

import ast
import os
import socket
import time

import pytest

from jaxrl_llm.tasks import isolation, sandbox, tools
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
        port = server.getsockname()[1]
        out = runner.run(checkers.connect, port)
        assert out.status == "error" and "connected" not in out.text
        with pytest.raises(socket.timeout):
            server.accept()  # nothing arrived
    assert runner.isolation == isolation.FULL
    with pytest.raises(sandbox.SandboxError, match="task.tool_isolation=weak"):
        sandbox.ToolRunner(workers=1, namespaces=False)  # as where the kernel refuses namespaces
    weak = sandbox.ToolRunner(workers=1, timeout=5.0, namespaces=False, require=False)
    try:
        assert weak.isolation == ("socket-guard", "unprivileged")  # root became nobody all the same
        assert weak.run(checkers.connect, port).text.startswith("tool error: PermissionError")
    finally:
        weak.close()


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
    assert set(seen) <= {*sandbox.ENV_KEPT, "HOME", "TMPDIR"}


def _named(name: str) -> list:
    """Processes on this machine whose name (/proc/PID/comm) is `name`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/comm").read().strip() == name:
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("as_nobody", [True, False], ids=["nobody", "user-namespace"])
def test_tool_code_reads_no_secret_writes_only_its_scratch_and_cannot_signal_the_learner(tmp_path, as_nobody):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text('{"token": "s3cret"}')
    r = sandbox.ToolRunner(workers=1, timeout=10.0, max_output_bytes=4096, as_nobody=as_nobody)
    try:
        assert r.isolation == isolation.FULL
        paths = [str(workdir / "config.json"), "/etc/shadow", f"/proc/{os.getpid()}/environ", "/root/.bash_history"]
        out = r.run(checkers.reach, paths, os.getpid())
    finally:
        r.close()
    assert out.status == "ok", out.text
    lines = out.text.splitlines()
    assert lines == [f"refused {p}: FileNotFoundError" for p in paths] + [
        "refused write: FileNotFoundError", "refused signal: ProcessLookupError"], out.text
    assert sorted(os.listdir(workdir)) == ["config.json"]


def test_fifty_forks_meet_the_process_limit_and_none_outlives_the_call():
    r = sandbox.ToolRunner(workers=1, timeout=20.0, processes=16)
    try:
        out = r.run(checkers.fork_children, 50, "jaxrl_fork_a")
        alive = _named("jaxrl_fork_a")
    finally:
        r.close()
    assert out.status == "ok" and 0 < int(out.text) < 16, out.text
    assert alive == []  # killed and collected before the call returned


def test_a_timed_out_tool_and_every_child_it_forked_are_killed_and_the_next_call_runs():
    r = sandbox.ToolRunner(workers=1, timeout=1.0)
    try:
        t = time.perf_counter()
        out = r.run(checkers.fork_children, 10, "jaxrl_fork_b", True)
        took = time.perf_counter() - t
        deadline = time.time() + 5
        while _named("jaxrl_fork_b") and time.time() < deadline:
            time.sleep(0.05)
        assert out.status == "timeout" and took < 4.0, (out, took)
        assert _named("jaxrl_fork_b") == []
        assert r.run(tools.calculator, "2 + 2").text == "4"
        r.submit(checkers.fork_children, [(3, "jaxrl_fork_c", True)])
        deadline = time.time() + 5
        while len(_named("jaxrl_fork_c")) < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert len(_named("jaxrl_fork_c")) == 3
    finally:
        r.close()
    deadline = time.time() + 5
    while _named("jaxrl_fork_c") and time.time() < deadline:
        time.sleep(0.05)
    assert _named("jaxrl_fork_c") == []  # close() took them down with their worker


def test_64_megabytes_written_to_file_descriptor_1_are_cut_and_never_reach_the_learner(capfd):
    r = sandbox.ToolRunner(workers=1, timeout=20.0, max_output_bytes=256)
    try:
        out = r.run(checkers.write_fd, 64 << 20)
    finally:
        r.close()
    assert out.status == "ok" and len(out.text.encode()) <= 256, out.text
    assert out.text.startswith("wrotewww")
    dropped = int(out.text.rsplit("[... ", 1)[1].split(" ")[0])
    assert dropped == (64 << 20) + len("wrote") - (256 - len(f"\n[... {dropped} more bytes cut]"))
    assert "www" not in capfd.readouterr().out
