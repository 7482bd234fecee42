"""metrics.jsonl + TensorBoard events from a tiny run, and the report rendered from them."""

import json
import os
import struct

import numpy as np
import pytest

from jaxrl_llm.run import experiment
from jaxrl_llm.research import report
from tests.test_experiment import _tiny


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    c = _tiny("gepo", mode="offpolicy")
    c.runtime.refresh_every = 2
    c.train.update(dict(steps=4, eval_every=2))
    experiment.run(c, str(workdir), log=lambda *_: None)
    return workdir


def _tb_scalars(workdir):
    """Decode the TFRecord event files by hand (length, crc, Event proto, crc); a tag can be
    logged twice at one step (the train and eval records both carry time_s)."""
    from tensorboardX.proto import event_pb2

    scalars, histos = {}, {}
    for path in sorted((workdir / "tb").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos: pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12: pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("histo"):
                    histos[(v.tag, event.step)] = list(v.histo.bucket)
                else:
                    scalars.setdefault((v.tag, event.step), []).append(v.simple_value)
    return scalars, histos


def test_tensorboard_events_mirror_metrics_jsonl(tiny_run):
    records = [json.loads(line) for line in open(tiny_run / "metrics.jsonl")]
    scalars, histos = _tb_scalars(tiny_run)
    checked = 0
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, float) and np.isfinite(v):
                assert any(x == pytest.approx(v, rel=1e-6, abs=1e-6) for x in scalars[(k, r["step"])]), k
                checked += 1
        if "staleness/hist" in r:
            assert histos[("staleness/hist", r["step"])] == pytest.approx(r["staleness/hist"])
    assert checked > 40
    # Fresh tokens (every other step) are scored by the learner as the sampler scored them.
    fresh = [r for r in records if r.get("mismatch/fresh_tokens", 0) > 0]
    assert len(fresh) == 2 and all(r["mismatch/abs_logp_max"] < 1e-4 for r in fresh)
    # offpolicy v=2: staleness cycles 0, 1
    assert [r["staleness/mean"] for r in records if "loss" in r] == [0.0, 1.0, 0.0, 1.0]


def test_report_renders_plots_and_table(tiny_run, tmp_path):
    md = report.write_report([str(tiny_run)], str(tmp_path))
    import matplotlib.image

    for name in report.PLOTS:
        img = matplotlib.image.imread(tmp_path / f"{name}.png")
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.01, f"{name}.png is blank"
    text = open(md).read()
    evals = [json.loads(line)["eval/reward"] for line in open(tiny_run / "metrics.jsonl") if "eval/reward" in line]
    row = [line for line in text.splitlines() if line.startswith(f"| {tiny_run.name} |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["gepo", "offpolicy", "4", "4"]
    assert float(cells[5]) == pytest.approx(evals[0], abs=1e-3) and float(cells[6]) == pytest.approx(evals[-1], abs=1e-3)
    assert float(cells[8]) == pytest.approx(0.5, abs=1e-3)  # mean staleness of 0, 1, 0, 1


def test_summary_and_histogram_from_handwritten_records(tmp_path):
    recs = [
        {"step": 0, "eval/reward": 0.25, "time_s": 1.0},
        {"step": 1, "loss": 0.1, "staleness/mean": 1.0, "staleness/hist": [1, 3], "clip_frac": 0.2, "tokens_per_s": 100.0, "time_s": 2.0},
        {"step": 2, "loss": 0.2, "staleness/mean": 2.0, "staleness/hist": [0, 1, 5], "clip_frac": 0.4, "tokens_per_s": 300.0, "time_s": 3.0},
        {"step": 2, "eval/reward": 0.75, "time_s": 3.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    run = report.load_run(str(tmp_path))
    np.testing.assert_array_equal(report.staleness_counts(run["steps"]), [1, 4, 5])
    row = report.summary_row(run)
    assert (row["eval_start"], row["eval_final"], row["eval_best"]) == (0.25, 0.75, 0.75)
    assert row["staleness_mean"] == pytest.approx(1.5) and row["clip_frac"] == pytest.approx(0.3)
    assert row["tokens_per_s"] == pytest.approx(200.0) and row["time_s"] == 3.5 and row["steps"] == 2
    np.testing.assert_allclose(report.ema(np.array([1.0, 0.0]), 0.5), [1.0, 0.5])


def test_report_on_a_missing_run_says_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        report.load_run(str(tmp_path))


def test_resume_drops_records_written_after_the_checkpoint(tiny_run, tmp_path):
    """A run killed after its checkpoint at step 2 had logged steps 3-4; resuming at 2 keeps
    steps <= 2 in metrics.jsonl and rebuilds TensorBoard from them."""
    import shutil

    from jaxrl_llm.run.metrics import MetricsWriter

    shutil.copytree(tiny_run, tmp_path / "run")
    before = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    w = MetricsWriter(str(tmp_path / "run"), resume_at=2)
    w.write({"step": 3, "loss": 0.5})
    w.close()
    after = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert after == [r for r in before if r["step"] <= 2] + [{"step": 3, "loss": 0.5}]
    assert max(r["step"] for r in before) == 4
    scalars, _ = _tb_scalars(tmp_path / "run")
    assert scalars[("loss", 3)] == [0.5] and not any(step == 4 for _, step in scalars)
    assert all(len(v) <= 2 for v in scalars.values())  # no step logged twice (time_s: train + eval)


def test_prox_approximation_plot_when_a3po_logs_it(tmp_path):
    """Runs with `a3po.prox_metrics` get a prox_approx.png (one line per staleness bucket);
    runs without it get none."""
    steps = [{"step": i, "time_s": float(i), "a3po_prox/abs_err/d0": 0.0, "a3po_prox/tokens/d0": 10.0,
              "a3po_prox/abs_err/d1": 0.0, "a3po_prox/tokens/d1": 5.0,
              "a3po_prox/abs_err/d3-4": 0.01 * i, "a3po_prox/tokens/d3-4": 4.0} for i in range(1, 6)]
    paths = report.plot([{"name": "a3po", "steps": steps, "evals": []}], str(tmp_path))
    assert str(tmp_path / "prox_approx.png") in paths
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "prox_approx.png")[..., :3].std() > 0.01
    none = tmp_path / "none"
    none.mkdir()
    assert not any(os.path.basename(p) == "prox_approx.png" for p in report.plot([{"name": "x", "steps": steps[:0] + [{"step": 1, "time_s": 1.0}],
                                                              "evals": []}], str(none)))


def test_gateway_and_moe_plots_when_their_metrics_are_logged(tmp_path):
    """Agent runs get gateway.png (sessions by outcome, request latency), mixture-of-experts runs
    moe.png (routing mismatch, expert load); runs without those metrics get neither."""
    import matplotlib.image

    steps = [{"step": i, "time_s": float(i), "gateway/sessions_closed": 8.0 * i, "gateway/sessions_timed_out": 0.0,
              "gateway/sessions_dropped": float(i > 2), "gateway/sessions_branched": 0.0,
              "gateway/request_p50_ms": 40.0 + i, "gateway/request_p99_ms": 90.0 + 3 * i,
              "gateway/slot_occupancy": 0.5 + 0.05 * i,
              "moe/routing_differs_tokens": 0.1 * i, "moe/routing_differs_pairs": 0.04 * i,
              "moe/expert_load_max_over_mean": 1.2, "moe/expert_load_worst_layer": 1.5 + 0.1 * i} for i in range(1, 6)]
    paths = report.plot([{"name": "agent", "steps": steps, "evals": []}], str(tmp_path))
    for name in ("gateway", "moe"):
        assert str(tmp_path / f"{name}.png") in paths
        assert matplotlib.image.imread(tmp_path / f"{name}.png")[..., :3].std() > 0.01
    none = tmp_path / "none"
    none.mkdir()
    plain = report.plot([{"name": "x", "steps": [{"step": 1, "time_s": 1.0, "loss": 0.1}], "evals": []}], str(none))
    assert not any(p.endswith(("gateway.png", "moe.png")) for p in plain)
