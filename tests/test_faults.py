"""Runs that survive faults: a damaged newest checkpoint (truncated, overwritten, a file
deleted) is reported and the previous one resumes exactly; none readable fails naming the
directory, `train.resume=fresh` starts over and keeps them; non-finite steps in a row stop the
run; SIGTERM saves at the step in flight and exits 143, and the resume is bit-identical."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.run import experiment
from jaxrl_llm.store import checkpoint
from tests.test_experiment import _tiny

STEPS = 4


def _config():
    c = _tiny()
    c.task.reward = "digits"  # partial credit: a tiny model gets non-zero advantages
    c.train.update(dict(steps=STEPS, eval_every=100, save_every=2, keep=3, tensorboard=False))
    return c


def _steps(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"loss"' in line]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run to STEPS, checkpoints at 2 and 4."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    experiment.run(_config(), workdir, log=lambda *_: None)
    records = _steps(workdir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert any(r["reward/mean"] > 0 for r in records) and any(abs(r["loss"]) > 0 for r in records)
    return workdir


def _damage(step_dir, kind):
    """Damage the array data of a checkpoint (its ocdbt `d/` chunk files; orbax also keeps
    superseded chunks that a restore never reads, so every one is hit)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if os.path.basename(r) == "d"]
    assert files
    for path in files:
        if kind == "truncate":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        elif kind == "garbage":
            with open(path, "wb") as f:
                f.write(os.urandom(os.path.getsize(path)))
        else:
            os.remove(path)


@pytest.mark.parametrize("kind", ["truncate", "garbage", "delete"])
def test_damaged_newest_checkpoint_resumes_from_the_previous(straight, tmp_path, kind):
    workdir = str(tmp_path / "run")
    shutil.copytree(straight, workdir)
    newest = os.path.join(workdir, "checkpoints", str(STEPS))
    _damage(newest, kind)
    lines = []
    summary = experiment.run(_config(), workdir, log=lines.append)
    assert summary["version"] == STEPS
    assert any(f"version {STEPS}" in x and newest in x and "unreadable" in x for x in lines), lines
    assert any("resumed" in x and "version 2" in x for x in lines)
    assert os.path.isdir(newest + ".damaged")  # kept for inspection
    got, want = _steps(workdir), _steps(straight)
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # one record per step
    for g, w in zip(got[2:], want[2:]):  # steps 3 and 4 retrained from version 2 exactly
        for k in ("loss", "param_norm", "grad_norm", "reward/mean"):
            assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-9), k


def test_no_readable_checkpoint_fails_naming_the_directory_and_fresh_starts_over(straight, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(straight, workdir)
    ckdir = os.path.join(workdir, "checkpoints")
    for v in os.listdir(ckdir):
        if v.isdigit():
            _damage(os.path.join(ckdir, v), "garbage")
    with pytest.raises(checkpoint.CheckpointError, match=f"no readable checkpoint in {ckdir}.*resume=fresh"):
        experiment.run(_config(), workdir, log=lambda *_: None)
    c = _config()
    c.train.resume = "fresh"
    lines = []
    assert experiment.run(c, workdir, log=lines.append)["version"] == STEPS
    assert any("starting afresh" in x for x in lines) and os.path.isdir(ckdir + ".old")
    assert [r["step"] for r in _steps(workdir)] == [1, 2, 3, 4]


def test_consecutive_non_finite_steps_stop_the_run(tmp_path):
    @objectives.register("nan_loss_for_test")
    def nan_loss(policy, batch, cfg):
        loss = jnp.nan * policy.logp.sum()
        return loss, {"loss": loss}

    try:
        c = _config()
        c.objective.name = "nan_loss_for_test"
        c.learner.max_bad_steps = 3
        c.train.steps = 50
        with pytest.raises(experiment.BadStepsError,
                           match=r"3 consecutive steps up to step 3 .*last good checkpoint: version 2"):
            experiment.run(c, str(tmp_path), log=lambda *_: None)
    finally:
        objectives.unregister("nan_loss_for_test")


def test_sigterm_saves_the_step_in_flight_and_resumes_bit_identically(tmp_path):
    from tests.test_distributed import ENV, ROOT, TINY

    base = [sys.executable, "-m", "jaxrl_llm.main", *TINY, "--config.runtime.mode=sync",
            "--config.task.reward=digits", "--config.train.save_every=1000", "--config.train.eval_every=1000"]
    run = str(tmp_path / "run")
    p = subprocess.Popen([*base, f"--workdir={run}", "--config.train.steps=1000"], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    path, deadline = os.path.join(run, "metrics.jsonl"), time.monotonic() + 240
    while time.monotonic() < deadline and (not os.path.exists(path) or open(path).read().count('"loss"') < 3):
        time.sleep(0.1)
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and time.monotonic() - t < 30, err[-2000:]
    stopped = len(_steps(run))
    assert stopped >= 3 and checkpoint.Checkpointer(os.path.join(run, "checkpoints")).latest_version() == stopped
    end = stopped + 2
    r = subprocess.run([*base, f"--workdir={run}", f"--config.train.steps={end}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = str(tmp_path / "ref")
    r = subprocess.run([*base, f"--workdir={ref}", f"--config.train.steps={end}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got, want = _steps(run), _steps(ref)
    assert [x["step"] for x in got] == list(range(1, end + 1))
    for g, w in zip(got, want):
        for k in ("loss", "param_norm", "reward/mean"):
            assert g[k] == w[k], (g["step"], k)  # bit-identical in sync mode


def test_a_failed_checkpoint_write_stops_clearly_and_the_previous_one_resumes(tmp_path, monkeypatch):
    import errno

    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.save

    def disk_full(self, step, *a, **kw):
        if step == STEPS:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, *a, **kw)

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"version {STEPS} in .*No space left on device.*version 2 is intact and resumes"):
        experiment.run(_config(), str(tmp_path), log=lambda *_: None)
    monkeypatch.setattr(ocp.CheckpointManager, "save", real)
    lines = []
    assert experiment.run(_config(), str(tmp_path), log=lines.append)["version"] == STEPS
    assert any("resumed" in x and "version 2" in x for x in lines)
    assert [r["step"] for r in _steps(str(tmp_path))] == [1, 2, 3, 4]


def test_an_async_run_resumed_from_its_checkpoint_trains_no_prompt_twice(tmp_path, monkeypatch):
    """Async mode keeps its data position in the checkpoint (`<version>.runtime/`): the resumed
    process continues each sampler's prompt stream instead of starting it over, and groups that
    were queued at the save are generated again, not lost. Counted over both processes' runs."""
    from jaxrl_llm.runtime.position import DataPosition

    delivered = []
    real = DataPosition.deliver
    monkeypatch.setattr(DataPosition, "deliver",
                        lambda self, w, d, g=None: (delivered.append((w, d)), real(self, w, d, g))[1])
    c = _config()
    c.runtime.update(dict(mode="async", queue_size=2, max_staleness=-1))
    c.train.keep = 2  # the runtime state of a checkpoint orbax deleted goes too
    workdir = str(tmp_path)
    experiment.run(c, workdir, log=lambda *_: None)
    ckdir = os.path.join(workdir, "checkpoints")
    saved = json.load(open(os.path.join(ckdir, f"{STEPS}.runtime", "process_0.json")))
    assert saved["position"]["workers"]["0"]["next"] == STEPS  # one draw per step, in order
    c.train.steps = STEPS + 2
    lines = []
    experiment.run(c, workdir, log=lines.append)
    assert not any("no runtime state" in x for x in lines)
    assert delivered == [(0, d) for d in range(STEPS + 2)]
    assert [r["step"] for r in _steps(workdir)] == list(range(1, STEPS + 3))
    kept = checkpoint.Checkpointer(ckdir).manager.all_steps()
    assert sorted(kept) == [STEPS, STEPS + 2]
    assert sorted(n for n in os.listdir(ckdir) if n.endswith(".runtime")) == sorted(f"{v}.runtime" for v in kept)


def killed_mid_run(base: list, run: str) -> int:
    """Start `base` (a `python -m jaxrl_llm.main` command saving every 2 steps) in `run`, kill -9 it
    once its checkpoint 4 is written and 5 steps are logged; returns the version it left."""
    from tests.test_distributed import ENV, ROOT

    ckdir = os.path.join(run, "checkpoints")
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "stderr.log"), "w") as err:
        p = subprocess.Popen([*base, f"--workdir={run}", "--config.train.steps=1000"], cwd=ROOT, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=err)
    path, deadline = os.path.join(run, "metrics.jsonl"), time.monotonic() + 240
    # orbax renames a checkpoint to its version once written, so a "4" directory is complete
    while time.monotonic() < deadline and not (os.path.isdir(os.path.join(ckdir, "4"))
                                               and open(path).read().count('"loss"') >= 5):
        assert p.poll() is None, open(os.path.join(run, "stderr.log")).read()[-2000:]  # it ended on its own
        time.sleep(0.05)
    p.kill()
    p.wait(timeout=60)
    restored = checkpoint.Checkpointer(ckdir).latest_version()
    assert restored >= 4
    return restored


def resumes_like_uninterrupted(base: list, tmp_path, keys) -> list:
    """`base` (as for `killed_mid_run`) killed with SIGKILL mid-run, resumed for two more steps,
    and run uninterrupted as long in another workdir: every step's `keys` equal, to the bit.
    Returns the uninterrupted run's step records."""
    from tests.test_distributed import ENV, ROOT

    run, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    end = killed_mid_run(base, run) + 2
    for workdir in (run, ref):
        r = subprocess.run([*base, f"--workdir={workdir}", f"--config.train.steps={end}"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    got, want = ([json.loads(x) for x in open(os.path.join(w, "metrics.jsonl")) if '"loss"' in x] for w in (run, ref))
    assert [x["step"] for x in got] == [x["step"] for x in want] == list(range(1, end + 1))
    for g, w in zip(got, want):
        for k in keys:
            assert g[k] == w[k], (g["step"], k)
    return want


def test_async_run_killed_with_sigkill_resumes_its_prompt_stream_where_the_checkpoint_left_it(tmp_path):
    """kill -9 mid-run in async mode: the restored version's runtime state says every draw up
    to it was trained once (one draw per step here) and the resumed process goes on from there;
    a stream started over would deliver draw 0 twice, which `DataPosition` refuses."""
    from tests.test_distributed import ENV, ROOT, TINY

    base = [sys.executable, "-m", "jaxrl_llm.main", *TINY, "--config.runtime.mode=async",
            "--config.runtime.max_staleness=-1", "--config.train.save_every=2", "--config.train.eval_every=1000",
            "--config.train.keep=100"]
    run = str(tmp_path / "run")
    ckdir = os.path.join(run, "checkpoints")
    restored = killed_mid_run(base, run)

    def position(version):
        return json.load(open(os.path.join(ckdir, f"{version}.runtime", "process_0.json")))["position"]["workers"]["0"]

    assert position(restored) == {"next": restored, "partial": {}}
    end = restored + 3
    r = subprocess.run([*base, f"--workdir={run}", f"--config.train.steps={end}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert position(end) == {"next": end, "partial": {}}
    assert [x["step"] for x in _steps(run)] == list(range(1, end + 1))
