"""The README's runnable examples run, and do what they say."""

import pathlib
import re

import jax
import numpy as np

from jaxrl_llm import objectives

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _example(tag):
    text = README.read_text()
    m = re.search(rf"<!-- example:{tag} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README example {tag!r} not found"
    return m.group(1)


def test_write_your_own_objective_example(capsys):
    namespace = {}
    try:
        exec(compile(_example("objective"), "README.md", "exec"), namespace)
        assert "loss=" in capsys.readouterr().out
        s, cfg = namespace["s"], namespace["cfg"]
        fn = objectives.get("truncated_pg")
        grad = jax.grad(lambda lp: fn(s.policy.replace(logp=lp), s.batch, cfg)[0])(s.policy.logp)
        # seq_mean_token_mean of -w A log pi: d/dx_it = -w_it A_it m_it / (n_i * #seqs).
        m = np.asarray(s.batch.loss_mask, np.float64)
        w = np.minimum(np.exp(np.asarray(s.policy.logp, np.float64) - np.asarray(s.batch.behav_logp)), 2.0)
        n_i = m.sum(-1, keepdims=True)
        want = -w * np.asarray(s.batch.advantages) * m / np.maximum(n_i, 1) / (n_i > 0).sum()
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-8)
    finally:
        objectives.unregister("truncated_pg")


def test_sampling_example(capsys):
    exec(compile(_example("sample"), "README.md", "exec"), {})
    assert "(4, 24) (4, 24, 4) [0 0 1 1]" in capsys.readouterr().out


def test_learner_example(capsys):
    exec(compile(_example("learner"), "README.md", "exec"), {})
    assert "1 ['staleness/max', 'staleness/mean']" in capsys.readouterr().out


def test_auxiliary_model_example(capsys):
    try:
        exec(compile(_example("aux"), "README.md", "exec"), {})
        first, last = (float(x) for x in capsys.readouterr().out.split()[1::2])
        assert last < 0.8 * first  # the head learns the rewards (0.46 -> 0.34 here)
        assert objectives.get("ppo").aux is None and objectives.get("ppo_value").aux.name == "value"
    finally:
        objectives.unregister("ppo_value")
