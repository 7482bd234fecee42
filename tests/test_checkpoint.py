import subprocess
import sys

import jax
import numpy as np

from jaxrl_llm import testing
from jaxrl_llm.store import checkpoint
from jaxrl_llm.learner import learner as L
from jaxrl_llm.models.config import ModelConfig
from tests import processes

ROOT = processes.ROOT


def _run(*args):
    subprocess.run([sys.executable, "-m", "tests.resume_worker", *args], cwd=ROOT, env=processes.env(), check=True,
                   timeout=600)  # one device per worker


def test_six_steps_equal_three_plus_restore_in_fresh_process_plus_three(tmp_path):
    _run("straight", str(tmp_path / "unused"), str(tmp_path / "straight.npz"))
    _run("first", str(tmp_path / "ckpt"), "-")
    _run("second", str(tmp_path / "ckpt"), str(tmp_path / "resumed.npz"))
    a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert set(a.files) == set(b.files) and any(".aux.params" in k for k in a.files)
    assert any("ref_params" in k for k in a.files)
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, rtol=0, err_msg=k)
    assert int(a[".version"]) == 6


def test_keeps_the_newest_k_and_saves_on_interval(tmp_path):
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    c = L.default_config()
    c.num_minibatches = 1
    lrn = L.Learner(cfg, {"name": "ppo"}, c)
    st = lrn.init(jax.random.key(0))
    ck = checkpoint.Checkpointer(str(tmp_path), save_every=2, keep=2)
    batch = testing.model_batch(st.params, cfg)
    saved = []
    for _ in range(6):
        st, _ = lrn.train_step(st, batch)
        saved.append(ck.save(st))
    ck.wait()
    assert saved == [True, True, False, True, False, True]  # first save always, then every 2nd version
    assert sorted(ck.manager.all_steps()) == [4, 6] and ck.latest_version() == 6
    ck.close()
