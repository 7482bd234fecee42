"""Experiment tracking (`run/tracking.py`): an offline wandb run and an MLflow file store hold every
number of `metrics.jsonl` at its step, a resumed run continues the same wandb and MLflow runs, and
a tracking service that fails never stops a run."""

import glob
import json
import os

import pytest

from jaxrl_llm.run import config as config_lib
from jaxrl_llm.run import experiment, tracking
from tests.test_experiment import _tiny

BLOCK = 32768


def _wandb_records(path):
    """The protobuf records of a `.wandb` file: a 7-byte header, then LevelDB-log framing
    ([crc u32][length u16][type u8][data] in 32 KiB blocks; types 1 full, 2 first, 3 middle, 4 last)."""
    data, pos, out, buf = open(path, "rb").read(), 7, [], b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(buf)
            buf = b""
    return out


def _wandb_history(workdir):
    """{run id: {step: {key: value}}} over the offline runs in `workdir/wandb`."""
    from wandb.proto import wandb_internal_pb2

    runs = {}
    for path in glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")):
        run_id, rows = None, {}
        for raw in _wandb_records(path):
            pb = wandb_internal_pb2.Record()
            pb.ParseFromString(raw)
            kind = pb.WhichOneof("record_type")
            if kind == "run":
                run_id = pb.run.run_id
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in pb.history.item}
                rows[int(row.pop("_step"))] = row
        for step, row in rows.items():
            runs.setdefault(run_id, {}).setdefault(step, {}).update(row)
    return runs


def _expected(workdir):
    """metrics.jsonl's numbers by step (a later record of a step overrides an earlier one's key)."""
    out = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        r = json.loads(line)
        out.setdefault(int(r["step"]), {}).update(tracking.scalars(r))
    return out


def test_wandb_offline_and_mlflow_hold_every_metric_and_a_resume_continues_them(tmp_path):
    from mlflow.tracking import MlflowClient

    c = _tiny()
    c.logging.backends = "tensorboard,wandb,mlflow,jsonl"
    c.logging.wandb.update(mode="offline", tags="a,b", group="g")
    c.train.update(steps=2, eval_every=1, save_every=1)
    workdir = str(tmp_path)
    experiment.run(c, workdir, log=lambda *_: None)
    ids = json.load(open(os.path.join(workdir, tracking.IDS)))
    c.train.steps = 3
    experiment.run(c, workdir, log=lambda *_: None)  # resumed at 2
    assert json.load(open(os.path.join(workdir, tracking.IDS))) == ids
    want = _expected(workdir)
    assert sorted(want) == [0, 1, 2, 3]
    runs = _wandb_history(workdir)
    assert list(runs) == [ids["wandb"]]  # both processes' runs: one run id
    got = runs[ids["wandb"]]
    for step, row in want.items():
        for key, value in row.items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    client = MlflowClient(tracking_uri="file:" + os.path.join(workdir, "mlruns"))
    run = client.get_run(ids["mlflow"])
    assert run.data.params["runtime.mode"] == '"sync"' and run.info.status == "FINISHED"
    for key in ("loss", "reward/mean", "eval/reward", "staleness/mean"):
        history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}
        assert history == pytest.approx({s: r[key] for s, r in want.items() if key in r}), key
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert os.path.isdir(os.path.join(workdir, "tb"))


def test_a_failing_tracking_service_never_stops_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    c = _tiny()
    c.logging.backends = "mlflow,wandb"
    c.logging.mlflow.tracking_uri = "http://127.0.0.1:9"  # nothing listens there
    c.logging.wandb.mode = "offline"
    c.train.update(steps=2, eval_every=1, save_every=1)
    calls = []

    def broken(self, record):
        calls.append(record["step"])
        raise OSError("disk full")

    monkeypatch.setattr(tracking.Wandb, "log", broken)
    lines = []
    summary = experiment.run(c, str(tmp_path), log=lines.append)
    assert summary["version"] == 2
    said = [x for x in lines if x.startswith("warning: logging to")]
    assert len(said) == 2 and "logging to mlflow failed" in said[0] and "the run goes on without it" in said[0]
    assert "logging to wandb failed (OSError: disk full)" in said[1] and calls == [0]  # dropped after one failure
    assert not os.path.exists(tmp_path / "tb")  # not named in logging.backends
    steps = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert [r["step"] for r in steps] == [1, 2]


def test_backends_are_checked_by_name():
    c = _tiny()
    c.logging.backends = "tensorboard,comet"
    with pytest.raises(Exception, match=r"logging.backends='tensorboard,comet': expected a comma-separated list"):
        config_lib.validate(c)
