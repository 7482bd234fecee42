"""`experiments/gpu_check.py --dry`: every stage of the GPU check runs at tiny shapes on CPU
and writes its figures, so the one command a lent GPU gets is known to run."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_every_stage_runs_dry_and_writes_its_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_check.py"), "--dry", "--repeats", "1",
                           "--out", str(out)], cwd=ROOT, timeout=600, capture_output=True, text=True)
    r = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    assert proc.returncode == 0 and not errors, (errors, proc.stdout[-2000:], proc.stderr[-2000:])
    assert r["dry"] and r["backend"]["platform"] == "cpu" and (tmp_path / "gpu_check.md").exists()
    assert r["vocab"]["top_k50_top_p09_ms"] > 0 and r["attention"]["auto"] == "chunked"
    assert r["attention"]["xla_max_abs_diff"] < 0.05 and r["attention"]["chunked_max_abs_diff"] < 0.05  # bf16
    assert r["logp_gap"]["float32_max_abs"] < 1e-4 and r["learner"]["two_steps_bitwise_equal"]
    assert r["determinism"]["two_steps_bitwise_equal"] and "deterministic_ops=true" in r["determinism"]["xla_flags"]
    assert r["init"]["compile_s"] > 0 and r["init"]["run_ms"] > 0
    assert r["prox_pass"]["prox_pass_temp_vs_plan"] <= 1.3
    assert [r["end_to_end"][b]["steps"] for b in ("static", "continuous")] == [2, 2]
    assert "mfu" not in r["learner"] and "fraction_of_roofline" not in r["decode"]  # no peak figures on a CPU
    assert r["moe"]["auto"] == "blocked" and r["moe"]["blocked"]["logp_max_abs_diff_from_grouped"] < 1e-5
    speeds = ("learner_tokens_per_s", "decode_tokens_per_s")
    assert all(r["moe"][d][k] > 0 for d in ("grouped", "blocked") for k in speeds)
