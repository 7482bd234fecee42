"""`experiments/accelerator_audit.py` (#51's bar, rerun here on fake devices): one decode
program whatever N, no vocabulary sort on either side, Qwen2.5-7B with fsdp=8 within an H100,
the prox pass within the plan, a start-up message for tensor=8 over 4 KV heads."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import accelerator_audit  # noqa: E402


def test_the_sort_counter_sees_a_vocabulary_sort():
    x = jax.ShapeDtypeStruct((4, accelerator_audit.V), jnp.float32)
    text = jax.jit(lambda x: jnp.sort(x, -1)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert accelerator_audit.vocab_sorts(text) >= 1
    assert accelerator_audit.vocab_sorts(text, v=1000) == 0


def test_the_audit_reaches_the_issues_bar(tmp_path):
    out = tmp_path / "audit.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "accelerator_audit.py"), "--out", str(out)],
                   check=True, cwd=ROOT, timeout=600, env=env)
    r = json.loads(out.read_text())
    assert r["decode_while_ops_256"] == r["decode_while_ops_1024"] <= 3
    assert r["decode_hlo_lines_256"] == r["decode_hlo_lines_1024"]
    assert r["vocab_sorts_in_sample_topk50_topp09"] == 0 and r["vocab_sorts_in_learner_topk50_topp09"] == 0
    assert r["plan_qwen7b_fsdp8_gib_per_device"] <= 59 < r["plan_qwen7b_data8_gib_per_device"]
    assert r["prox_pass_temp_vs_plan"] <= 1.3 < r["prox_pass_temp_whole_batch_vs_plan"]
    assert r["tensor8_kvheads4"].startswith("mesh.tensor=8 does not divide the model's heads [28]")  # KV: replicated
    assert r["attention_auto"] == {"cpu_float32": "chunked", "cpu_bfloat16": "chunked", "gpu_float32": "xla",
                                   "gpu_bfloat16": "cudnn", "tpu_float32": "splash", "tpu_bfloat16": "splash"}
