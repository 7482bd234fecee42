"""Many processes on JAX's multi-controller runtime, as local processes with gloo collectives."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxrl_llm.parallel import launch
from tests import processes

ROOT = processes.ROOT
ENV = processes.env()  # devices come from cpu_devices
TINY = ["--config=configs/default.py", "--config.task.eval_size=8", "--config.model.hidden_size=16",
        "--config.model.intermediate_size=32", "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
        "--config.model.head_dim=8", "--config.model.num_layers=1", "--config.warm_start.steps=5",
        "--config.runtime.prompts_per_batch=2", "--config.sampler.num_samples=4",
        "--config.learner.num_minibatches=2", "--config.train.progress=False", "--config.train.tensorboard=False",
        "--config.learner.schedule=constant"]  # the default cosine spans train.steps, which resumes here change


def _launch(args, processes=2, devices=1, timeout=300):
    cmd = [sys.executable, "-m", "jaxrl_llm.launch", f"--processes={processes}",
           f"--devices_per_process={devices}", "--", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _records(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.serial
def test_two_processes_equal_one_process_on_the_same_global_batch(tmp_path):
    # gepo: group ids distinct across processes; m2po: a mask over every process's tokens
    objective = "decoupled_ppo,gepo,m2po"  # each in turn, in the same processes

    def run(n, devices):
        port = launch.free_port()
        out = str(tmp_path / f"p{n}.npz")
        cmds = [[sys.executable, "-m", "tests.multihost_worker", str(i), str(n), str(port), str(devices), out,
                 objective] for i in range(n)]
        procs = [subprocess.Popen(c, cwd=ROOT, env=ENV) for c in cmds]
        assert all(p.wait(timeout=300) == 0 for p in procs)
        return np.load(out)

    one, two = run(1, 4), run(2, 2)  # 1 x 4 devices vs 2 x 2 devices, mesh data=2 x fsdp=2
    assert set(one.files) == set(two.files) and len(one.files) > 30
    assert {k.split("/")[0] for k in one.files} == set(objective.split(","))
    for k in one.files:
        np.testing.assert_allclose(two[k], one[k], atol=1e-5, rtol=0, err_msg=k)


def test_batch_scheduling_reaches_the_threads_started_after_it():
    import threading

    from jaxrl_llm.parallel import distributed
    seen = {}

    def child():
        seen["child"] = os.sched_getscheduler(0)

    def caller():
        seen["set"] = distributed.batch_scheduling()
        seen["caller"] = os.sched_getscheduler(0)
        t = threading.Thread(target=child)
        t.start(), t.join()

    main_policy = os.sched_getscheduler(0)
    t = threading.Thread(target=caller)
    t.start(), t.join()
    assert seen == {"set": True, "caller": os.SCHED_BATCH, "child": os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == main_policy  # a thread's own policy: the test process is untouched


def test_batch_scheduling_is_for_cpu_runs_only(monkeypatch, tmp_path):
    """SCHED_BATCH follows the backend JAX will pick: the first platform named, else CPU unless an
    accelerator plugin is installed (found as JAX finds it, under the jax_plugins namespace)."""
    from jaxrl_llm.parallel import distributed
    before = jax.config.jax_platforms  # read from JAX_PLATFORMS at import: "cpu" in the tests
    jax.config.update("jax_platforms", None)
    try:
        for names, cpu in (("cpu", True), ("cuda,cpu", False), ("tpu", False), (" cpu , cuda", True)):
            monkeypatch.setenv("JAX_PLATFORMS", names)
            assert distributed.on_cpu() is cpu, names
        monkeypatch.delenv("JAX_PLATFORMS")
        assert distributed.on_cpu()  # this machine: jax without an accelerator plugin
        (tmp_path / "jax_plugins" / "fake_cuda_plugin").mkdir(parents=True)
        (tmp_path / "jax_plugins" / "fake_cuda_plugin" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        assert not distributed.on_cpu()
    finally:
        jax.config.update("jax_platforms", before)


def test_the_launcher_gives_each_process_its_own_accelerators():
    cpu = launch.commands(2, 4, ["--x"], 1234)
    assert not any("local_device_ids" in a for c in cpu for a in c)  # CPU devices are the process's own anyway
    gpu = launch.commands(2, 4, ["--x"], 1234, accelerator=True)
    assert [[a for a in c if "local_device_ids" in a] for c in gpu] == [
        ["--config.distributed.local_device_ids=0,1,2,3"], ["--config.distributed.local_device_ids=4,5,6,7"]]


def test_start_up_names_the_backend_and_warns_when_an_accelerator_sits_unused(monkeypatch, tmp_path):
    """A GPU's device node with JAX on the CPU (a shadowed or missing plugin) is said at start-up,
    unless JAX_PLATFORMS asked for the CPU."""
    from jaxrl_llm.parallel import distributed

    node = tmp_path / "nvidia0"
    line, warning = distributed.backend_line(nodes=(str(node),))
    assert line.startswith("backend cpu: 8 device(s)") and warning is None  # no node: nothing to say
    node.write_text("")
    assert distributed.backend_line(nodes=(str(node),))[1] is None  # JAX_PLATFORMS=cpu in the tests
    monkeypatch.setattr(distributed, "_platforms", lambda: [])
    warning = distributed.backend_line(nodes=(str(node),))[1]
    assert warning.startswith(f"{node} exists but JAX runs on the CPU") and ".[gpu]" in warning


@pytest.mark.serial
@pytest.mark.parametrize("mode,extra", [  # sync: the resume and kill tests; offpolicy takes iterative's path here
    ("iterative", ["--config.runtime.reuse=2"]), ("simulated", []), ("async", []),
    # continuous batching with multi-turn episodes: rows wait on the sandboxed calculator in their slots
    ("async", ["--config.sampler.batching=continuous", "--config.sampler.slots=3", "--config.task.name=tool_arithmetic",
               "--config.task.ops=*", "--config.task.terms=3", "--config.task.max_turns=3"]),
])
def test_every_mode_runs_on_two_processes(mode, extra, tmp_path):
    r = _launch([*TINY, f"--workdir={tmp_path}", "--config.train.steps=3", "--config.train.eval_every=3",
                 f"--config.runtime.mode={mode}", *extra])
    assert r.returncode == 0, r.stdout[-3000:]
    recs = _records(tmp_path)
    steps = [x for x in recs if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3] and all(x["processes"] == 2 for x in steps)
    assert [x["step"] for x in recs if "eval/reward" in x] == [0, 3]
    assert "[0] " in r.stdout and "[1] " not in r.stdout.replace("[1] [Gloo]", "")  # only process 0 prints
    # the final version is saved with each process's own data position (async: one draw per step)
    saved = [json.load(open(tmp_path / "checkpoints" / "3.runtime" / f"process_{i}.json")) for i in range(2)]
    if "--config.task.name=tool_arithmetic" in extra:  # episodes of both processes, counted once each
        assert steps[-1]["episode/count"] >= 3 * 2 * 8 and steps[-1]["episode/turns"] >= 1
        assert len(steps[-1]["staleness/turn"]) == 3
    if mode == "async" and not extra:
        assert [s["position"]["workers"]["0"] for s in saved] == [{"next": 3, "partial": {}}] * 2


def _start(args):
    cmds = launch.commands(2, 1, args, launch.free_port())
    return [subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for c in cmds]


def _wait(done, procs):
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not done():
        assert all(p.poll() is None for p in procs), "a process ended early"
        time.sleep(0.1)
    assert done(), "not reached within the deadline"


def _steps(workdir):
    path = workdir / "metrics.jsonl"
    return [x["step"] for x in _records(workdir) if "loss" in x] if path.exists() else []


def _checkpoints(workdir):
    d = workdir / "checkpoints"
    return sorted(int(c.name) for c in d.iterdir() if c.name.isdigit()) if d.is_dir() else []


@pytest.mark.serial
def test_preemption_a_lost_process_and_kill_9_each_stop_every_process_and_resumes_equal_a_straight_run(tmp_path):
    """One two-process run, interrupted three ways in turn (each used to be its own launch):
    1. SIGTERM to one process (preemption of one host): the processes agree on the step, each
       saves it and exits 143; while the run lives, process 0 holds the workdir.
    2. Resumed, then SIGKILL to one process once a checkpoint past the first stop exists and a
       step past it was logged: the coordination service ends the other, naming the lost one,
       without saving (as kill -9 of every process).
    3. Resumed to 2 steps past the last logged one: it restores a checkpoint at or before that
       step, cuts the records logged past it, and equals an uninterrupted run of that length
       with one metrics record per step."""
    args = [*TINY, "--config.runtime.mode=sync", "--config.train.eval_every=2", "--config.train.save_every=2",
            "--config.distributed.heartbeat_timeout_s=10"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    procs = _start([*args, f"--workdir={run}", "--config.train.steps=100000"])
    try:
        _wait(lambda: _steps(run), procs)
        from jaxrl_llm.run import experiment
        from jaxrl_llm.store.workdir import WorkdirBusy
        from tests.test_experiment import _tiny

        with pytest.raises(WorkdirBusy, match=rf'held by a live run \(.*"pid": {procs[0].pid}'):
            experiment.run(_tiny(), str(run), log=lambda *_: None)
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [143, 143], outs[0][-2000:] + outs[1][-2000:]
    stopped = int(outs[0].split("interrupted (SIGTERM) at version")[1].split(":")[0])
    assert _checkpoints(run)[-1] == stopped and _steps(run) == list(range(1, stopped + 1))

    procs = _start([*args, f"--workdir={run}", "--config.train.steps=100000"])
    try:
        _wait(lambda: any(c > stopped for c in _checkpoints(run)) and max(_steps(run)) > _checkpoints(run)[-1],
              procs)
        procs[1].send_signal(signal.SIGKILL)
        t = time.monotonic()
        out, _ = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0 and time.monotonic() - t < 120
    # The coordination service names the lost task; a collective already under way may fail
    # first with gloo's own error about the closed connection to that peer.
    assert ("stopped sending heartbeats):\n1\n" in out) or ("Gloo" in out and "onnection" in out), out[-2000:]
    assert f"at version {stopped}" in out  # it had resumed from the SIGTERM save

    logged = max(_steps(run))
    r = _launch([*args, f"--workdir={run}", f"--config.train.steps={logged + 2}"])
    assert r.returncode == 0 and "resumed" in r.stdout, r.stdout[-3000:]
    restored = int(r.stdout.split("resumed from")[1].split("at version")[1].split()[0])
    assert stopped < restored <= logged  # records past the restored version were logged, then cut
    assert _launch([*args, f"--workdir={straight}", f"--config.train.steps={logged + 2}"]).returncode == 0
    assert _steps(run) == list(range(1, logged + 3)), "one record per step"
    for x, y in zip(*([x for x in _records(w) if "loss" in x] for w in (straight, run))):
        for k in ("loss", "grad_norm", "param_norm", "reward/mean"):
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-7), (x["step"], k)


class _Lines(list):
    """The launcher's output stream, kept as the lines it writes."""

    def write(self, s):
        self.append(s)

    def flush(self):
        pass


def test_launcher_names_the_process_that_died_first():
    code = "import os, sys, time; i = int(sys.argv[-1].split('=')[-1]); time.sleep(0.5 if i else 60); sys.exit(3)"
    cmds = [[sys.executable, "-c", code, f"--config.distributed.process_id={i}"] for i in range(2)]
    lines = _Lines()
    t = time.monotonic()
    assert launch.run(cmds, out=lines) == 3 and time.monotonic() - t < 30  # the sleeper was ended
    assert any("process 1 died first (exit code 3)" in line for line in lines)


def test_launcher_forwards_sigterm_and_lets_every_process_save():
    """Preemption of the launcher: each process gets SIGTERM, finishes its save (here: 1 s) and
    exits 143; the launcher waits for all of them instead of ending the slower one."""
    child = ("import signal, sys, time\n"
             "def done(*_):\n    time.sleep(1.0 + float(sys.argv[1])); print('saved', flush=True); sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, done)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    parent = (f"import sys; from jaxrl_llm.parallel import launch; child = {child!r}\n"
              "sys.exit(launch.run([[sys.executable, '-c', child, str(i)] for i in range(2)]))")
    p = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    seen = [p.stdout.readline() for _ in range(2)]  # both children have their handler installed
    assert all("ready" in line for line in seen), seen
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 143, out
    assert out.count("saved") == 2 and "stopped by SIGTERM" in out, out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_children_die_with_a_killed_launcher():
    """kill -9 of the launcher ends its processes too: an orphan would go on training and writing
    the checkpoints a resumed run reads."""
    child = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    parent = (f"import sys; from jaxrl_llm.parallel import launch; child = {child!r}\n"
              "sys.exit(launch.run([[sys.executable, '-c', child] for i in range(2)]))")
    p = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    pids = [int(p.stdout.readline().split()[-1]) for _ in range(2)]
    p.kill()
    p.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), pids


def test_core_sets_split_the_cores_into_equal_disjoint_blocks():
    assert launch.core_sets(2, {0, 1, 2, 3}) == [{0, 1}, {2, 3}]
    assert launch.core_sets(3, range(7)) == [{0, 1}, {2, 3}, {4, 5}]  # equal shares; core 6 unused
    assert launch.core_sets(1, [5, 3]) == [{3, 5}]
    assert launch.core_sets(3, {0, 1}) is None  # fewer cores than processes: leave them shared


def test_launcher_binds_each_process_to_its_own_cores():
    lines = _Lines()
    cores = [{c} for c in sorted(os.sched_getaffinity(0))][:2] * 2
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    assert launch.run([[sys.executable, "-c", code]] * len(cores), out=lines, cores=cores) == 0
    assert sorted(lines) == sorted(f"[{i}] {sorted(c)}\n" for i, c in enumerate(cores))
