"""Dynamic sampling (`runtime/dynamic.py`, DAPO Sec. 3.2): which groups carry signal, a batch refilled
to full size from further draws (or filled and flagged at the cap), the async threads' gate; runs
that never train an all-equal group, fill every batch, and resume exactly."""

import json
import os

import numpy as np
import pytest

from jaxrl_llm import testing
from jaxrl_llm.run import experiment
from jaxrl_llm.runtime import dynamic, orchestrator
from tests.test_experiment import _tiny

G = 4


def _batch(rewards):
    """A batch with these rewards (rows group-major, G per group); the rest from `random_batch`."""
    rewards = np.asarray(rewards, np.float32)
    b = testing.random_batch(num_prompts=len(rewards) // G, group_size=G).batch
    return b.replace(rewards=rewards, group_ids=np.repeat(np.arange(len(rewards) // G), G).astype(np.int32))


def test_which_groups_carry_signal():
    r = [1, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.3, 0.2, 0.2]
    assert dynamic.informative(r, G).tolist() == [False, True, False, True]
    # std >= min_std (population std, as verl's np.std): [0,1,0,0] has 0.433, [.2,.3,.2,.2] 0.0433
    assert dynamic.informative(r, G, min_std=0.1).tolist() == [False, True, False, False]
    assert np.std([0.2, 0.3, 0.2, 0.2]) == pytest.approx(0.0433, abs=1e-4)
    assert dynamic.informative([0.0, 1.0, 1.0], 1).tolist() == [True] * 3  # groups of one are kept


def test_refill_keeps_the_first_informative_groups_and_fills_at_the_cap():
    refill = dynamic.Refill(groups=3, group_size=G, min_std=0.0, max_draws=3)
    draws = [_batch([1] * 4 + [0, 1, 1, 1] + [0] * 4),  # groups: equal, signal, equal
             _batch([0, 0, 1, 0] + [1] * 4 + [0, 0, 0, 1])]  # signal, equal, signal
    for d in draws:
        refill.add(d)
    assert refill.full and refill.done
    got = refill.batch()
    want = np.concatenate([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_array_equal(np.asarray(got.rewards), want)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.concatenate(
        [np.asarray(draws[0].tokens)[4:8], np.asarray(draws[1].tokens)[0:4], np.asarray(draws[1].tokens)[8:12]]))
    assert sorted(set(np.asarray(got.group_ids).tolist())) == [0, 1, 2]
    assert refill.metrics() == {"dynamic/draws": 2.0, "dynamic/dropped_groups": 3.0, "dynamic/fill": 1.0,
                                "dynamic/capped": 0.0}
    capped = dynamic.Refill(groups=3, group_size=G, min_std=0.0, max_draws=2)
    for d in ([1] * 12, [0, 1, 0, 0] + [0] * 8):
        capped.add(_batch(d))
    assert capped.done and not capped.full
    got = capped.batch()  # the one informative group, then the last two dropped ones
    np.testing.assert_array_equal(np.asarray(got.rewards), [0, 1, 0, 0] + [0] * 8)
    assert got.shape[0] == 12 and capped.metrics()["dynamic/capped"] == 1.0
    assert capped.metrics()["dynamic/fill"] == pytest.approx(1 / 3)


def test_the_gate_lets_one_through_after_limit_drops_in_a_row():
    gate = dynamic.Gate(G, 0.0, limit=2)
    same, mixed = _batch([1] * 4), _batch([0, 1, 1, 1])
    assert [gate.passes(b) for b in (same, same, same, mixed, same)] == [False, False, True, True, False]
    assert (gate.seen, gate.dropped, gate.forced) == (5, 3, 1)
    m, totals = dynamic.gate_metrics([gate], None, groups=2)
    assert m == {"dynamic/dropped_groups": 3.0, "dynamic/draws": 2.5, "dynamic/forced": 1.0}
    assert dynamic.gate_metrics([gate], totals, groups=2)[0]["dynamic/draws"] == 0.0


def test_refused_where_it_cannot_run():
    c = orchestrator.default_config()
    c.update(dynamic_sampling=True, mode="async", staleness_policy="admit")
    with pytest.raises(ValueError, match="runtime.dynamic_sampling works in modes sync, .*remote and not with "
                                         "staleness_policy='admit'"):
        orchestrator.validate(c, "continuous")


def _config(mode):
    c = _tiny("ppo", mode=mode)
    c.task.reward = "digits"
    c.warm_start.update(steps=60, target=0.0)
    c.runtime.update(dynamic_sampling=True, dynamic_max_draws=6)
    c.learner.schedule = "constant"  # the same learning rate whatever train.steps says (resume test)
    c.train.update(steps=4, eval_every=2, save_every=2, tensorboard=False)
    return c


def _trained(monkeypatch):
    seen = []
    real = orchestrator.Orchestrator.train
    monkeypatch.setattr(orchestrator.Orchestrator, "train",
                        lambda self, state, batch: (seen.append(batch), real(self, state, batch))[1])
    return seen


def _steps(workdir):
    return [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl")) if '"loss"' in x]


def test_a_sync_run_trains_only_informative_groups_and_resumes_exactly(tmp_path, monkeypatch):
    seen = _trained(monkeypatch)
    experiment.run(_config("sync"), str(tmp_path / "straight"), log=lambda *_: None)
    straight = _steps(tmp_path / "straight")
    for batch, m in zip(seen, straight):
        keep = dynamic.informative(np.asarray(batch.rewards), 4)
        assert batch.shape[0] == 2 * 4 and (keep.all() or m["dynamic/capped"] == 1.0)
        assert m["dynamic/fill"] == keep.mean()
        tokens = np.asarray(batch.loss_mask).sum(1).reshape(-1, 4).sum(1)  # per group
        assert m["tokens/informative"] == pytest.approx(tokens[keep].sum())
    assert any(m["dynamic/dropped_groups"] > 0 for m in straight)  # there was something to drop
    c = _config("sync")
    c.train.steps = 2
    experiment.run(c, str(tmp_path / "resumed"), log=lambda *_: None)
    c.train.steps = 4
    experiment.run(c, str(tmp_path / "resumed"), log=lambda *_: None)
    for a, b in zip(_steps(tmp_path / "resumed"), straight):
        for k in ("loss", "reward/mean", "dynamic/draws", "dynamic/dropped_groups"):
            assert a[k] == b[k], (a["step"], k)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_an_async_run_gates_groups_before_the_queue_and_delivers_each_once(tmp_path, monkeypatch, batching):
    from jaxrl_llm.runtime.position import DataPosition

    delivered = []
    real = DataPosition.deliver
    monkeypatch.setattr(DataPosition, "deliver",
                        lambda self, w, d, g=None: (delivered.extend((w, d, k) for k in g), real(self, w, d, g))[1])
    seen = _trained(monkeypatch)
    c = _config("async")
    c.sampler.batching = batching
    c.runtime.max_staleness = -1
    experiment.run(c, str(tmp_path), log=lambda *_: None)
    c.train.steps = 6
    experiment.run(c, str(tmp_path), log=lambda *_: None)  # resumed: the stream goes on, nothing twice
    steps = _steps(tmp_path)
    assert [m["step"] for m in steps] == list(range(1, 7))
    for batch, m in zip(seen, steps):
        keep = dynamic.informative(np.asarray(batch.rewards), 4)
        assert batch.shape[0] == 8 and keep.sum() >= 2 - m["dynamic/forced"]
    assert len(delivered) == len(set(delivered))  # DataPosition also refuses a second delivery
    assert sum(m["dynamic/dropped_groups"] for m in steps) > 0


def test_a_sync_run_killed_mid_batch_resumes_bit_identically(tmp_path):
    """kill -9 while a batch is being refilled: the resumed run draws the same prompts for every
    step (a function of the version) and trains exactly what an uninterrupted run trains."""
    import sys

    from tests.test_distributed import TINY
    from tests.test_faults import resumes_like_uninterrupted

    base = [sys.executable, "-m", "jaxrl_llm.main", *TINY, "--config.runtime.mode=sync", "--config.task.reward=digits",
            "--config.runtime.dynamic_sampling=True", "--config.runtime.dynamic_max_draws=4",
            "--config.train.save_every=2", "--config.train.eval_every=1000", "--config.train.keep=100"]
    want = resumes_like_uninterrupted(base, tmp_path, ("loss", "param_norm", "reward/mean", "dynamic/draws",
                                                       "dynamic/dropped_groups"))
    assert any(x["dynamic/dropped_groups"] > 0 for x in want)
