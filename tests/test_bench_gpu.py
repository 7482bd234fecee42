"""`experiments/bench_gpu.py` stays runnable off an accelerator: its dry mode checks attention
parity, one learner step, one decode call and the 0.5B memory plan on CPU."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import bench_gpu  # noqa: E402


def test_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_gpu.py"), "--dry", "--tiny",
                    "--repeats", "1", "--json", str(out)], check=True, cwd=ROOT, timeout=600)
    r = json.loads(out.read_text())
    assert r["dry"] and r["model"] == "tiny" and "learner_mfu" not in r and "cudnn_max_abs_diff" not in r
    assert r["attention_valid_queries"] > 0
    assert r["einsum_vs_float32_reference"] < 0.05 and r["default_kernel_max_abs_diff"] < 0.05  # bf16 inputs
    assert r["learner_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    from jaxrl_llm.learner import learner
    from jaxrl_llm.run import memory
    from jaxrl_llm.models.config import ModelConfig

    big = ModelConfig(**bench_gpu.QWEN25_05B, dtype="bfloat16")
    plan = memory.total(memory.learner(big, 16, 1024, 1, learner.default_config().logprob_chunk))
    assert r["plan_learner_gb"] == pytest.approx(plan / 2**30)
    assert (out.with_suffix(".md")).exists()  # the results page


def test_roofline_and_parity_reference():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.models.config import ModelConfig

    cfg = ModelConfig(**bench_gpu.TINY)
    step_bytes = 2 * cfg.num_params + 8 * (2 * 2 * 2 * 2 * 16) * (10 + 4 / 2)
    assert bench_gpu.roofline(cfg, 8, 10, 4, 1e12) == pytest.approx(8 * 1e12 / step_bytes)
    q, k, v = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(1, 3, 4, 8), (1, 2, 8, 3),
                                                                               (1, 2, 3, 8)]))
    mask = jnp.tril(jnp.ones((3, 3), bool))[None]
    got = np.asarray(bench_gpu._reference(q, k, v, mask))
    qn, kn, vn = np.asarray(q), np.asarray(k), np.asarray(v)
    for h in range(4):  # heads 0, 1 read KV head 0; heads 2, 3 KV head 1
        s = qn[0, :, h] @ kn[0, h // 2] / np.sqrt(8) + np.where(np.tril(np.ones((3, 3))) > 0, 0, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(got[0, :, h], (p / p.sum(-1, keepdims=True)) @ vn[0, h // 2], rtol=1e-5, atol=1e-5)
