"""The suite itself: no test dropped to save time, and its processes share the CPU as declared."""

import glob
import json
import multiprocessing
import os

import pytest

from tests import processes

HERE = os.path.dirname(os.path.abspath(__file__))


def _whole_suite(config, items) -> bool:
    files = {os.path.basename(str(i.path)) for i in items}
    on_disk = {os.path.basename(p) for p in glob.glob(os.path.join(HERE, "test_*.py"))}
    chosen = config.getoption("keyword") or config.getoption("markexpr") or config.getoption("deselect")
    return files == on_disk and not chosen


def test_no_test_was_dropped(request):
    items = request.session.items
    if not _whole_suite(request.config, items):
        pytest.skip("part of the suite was collected")
    recorded = json.load(open(os.path.join(HERE, "suite_size.json")))["tests"]
    assert len(items) >= recorded, f"{len(items)} tests collected, {recorded} recorded in tests/suite_size.json"


def test_subprocesses_keep_the_fast_compile_flags_but_not_the_fake_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", " ".join(["--xla_cpu_max_isa=AVX2", processes.FAKE_DEVICES, *processes.FAST_COMPILE]))
    flags = processes.env()["XLA_FLAGS"].split()
    assert flags == ["--xla_cpu_max_isa=AVX2", *processes.FAST_COMPILE]
    assert processes.env()["JAX_COMPILATION_CACHE_DIR"] == os.environ["JAX_COMPILATION_CACHE_DIR"]


def _take(name, serial, ready, release, log):
    def say(what):  # O_APPEND writes land in the order they happen
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.write(fd, f"{what} {name}\n".encode())
        os.close(fd)

    with processes.turn(serial):
        say("in")
        ready.set()
        release.wait(30)
        say("out")


def test_a_serial_test_runs_alone_and_ordinary_ones_share(monkeypatch, tmp_path):
    monkeypatch.setenv(processes.SHARED, str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw9")
    ctx = multiprocessing.get_context("fork")
    log, tests = tmp_path / "events", {}
    log.touch()

    def start(name, serial):
        ready, release = ctx.Event(), ctx.Event()
        tests[name] = (ctx.Process(target=_take, args=(name, serial, ready, release, str(log))), ready, release)
        tests[name][0].start()
        return ready

    assert start("a", False).wait(30) and start("b", False).wait(30)  # ordinary tests share the CPU
    assert not start("serial", True).wait(0.5)  # a serial one waits for both
    assert not start("late", False).wait(0.5)  # a later ordinary one waits behind it: no starvation
    tests["a"][2].set(), tests["b"][2].set()
    assert tests["serial"][1].wait(30) and not tests["late"][1].wait(0.5)  # it runs alone
    tests["serial"][2].set()
    assert tests["late"][1].wait(30)
    tests["late"][2].set()
    for p, *_ in tests.values():
        p.join(30)
    at = {line: i for i, line in enumerate(log.read_text().splitlines())}
    assert len(at) == 8 and max(at["out a"], at["out b"]) < at["in serial"] < at["out serial"] < at["in late"]
