"""Multi-turn tasks end to end (`tasks.multiturn`): observation spans are invisible to every
objective, the producer trains episodes in async mode, staleness is reported by turn, and
bad options fail at start-up."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tool_arithmetic import get_config
from jaxrl_llm import staleness, testing
from jaxrl_llm.run import experiment, plan
from jaxrl_llm import objectives as O
from tests.test_experiment import shrink


def _with_observations(s):
    """`random_batch` with a 2-token observation inside every row's completion: real input
    (input mask 1), no loss, version -1 and log-prob 0, as `rollout.turns` writes them; the
    advantages stay non-zero there, so only the mask can keep them out."""
    b = s.batch
    mask, versions = np.asarray(b.loss_mask).copy(), np.asarray(b.versions).copy()
    behav, obs = np.asarray(b.behav_logp).copy(), np.zeros(mask.shape, bool)
    for i in range(mask.shape[0]):
        cols = np.flatnonzero(mask[i])
        if len(cols) >= 4:
            obs[i, cols[1:3]] = True
    assert obs.any(1).sum() >= 4
    mask[obs], versions[obs], behav[obs] = 0.0, -1, 0.0
    adv = np.where(obs, 1.0, np.asarray(b.advantages))
    return b.replace(loss_mask=jnp.asarray(mask), versions=jnp.asarray(versions), behav_logp=jnp.asarray(behav),
                     advantages=jnp.asarray(adv)), obs


def _compact(tree, keep_BxL):
    """Each row with the observation columns removed (shifted left, padded with its last value):
    what a single-turn batch of the same generated tokens looks like."""
    def one(x):
        if getattr(x, "ndim", 0) < 2 or x.shape[:2] != keep_BxL.shape:
            return x
        x = np.asarray(x)
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            kept = x[i][keep_BxL[i]]
            out[i, :len(kept)] = kept
            out[i, len(kept):] = x[i, -1]
        return jnp.asarray(out)
    return jax.tree.map(one, tree)


@pytest.mark.parametrize("name", O.BUILTIN)
def test_observation_tokens_get_no_gradient_and_change_no_objective(name):
    s = testing.random_batch(9, length=16)
    batch, obs = _with_observations(s)
    cfg = O.make_config(name=name)
    f = O.get(name)
    loss, grad = jax.value_and_grad(lambda lp: f(s.policy.replace(logp=lp), batch, cfg)[0])(s.policy.logp)
    grad = np.asarray(grad)
    assert np.all(grad[obs] == 0.0) and np.abs(grad[~obs]).sum() > 0
    # the same generated tokens without the observation columns give the same loss: sequence-level
    # objectives (GSPO, GEPO) see the episode's generated tokens as the sequence. (Jackpot draws its
    # acceptance as uniform(rng, [B, L]) by position, so moving columns redraws it.)
    if name == "jackpot":
        return
    compact_policy, compact_batch = _compact((s.policy, batch), ~obs)
    tail = np.arange(obs.shape[1])[None, :] >= (~obs).sum(1, keepdims=True)  # the padding the removal left
    compact_batch = compact_batch.replace(loss_mask=jnp.where(tail, 0.0, compact_batch.loss_mask))
    np.testing.assert_allclose(float(f(compact_policy, compact_batch, cfg)[0]), float(loss), rtol=2e-5, atol=1e-7)


def test_staleness_by_turn_against_a_loop():
    rng = np.random.default_rng(0)
    mask = (rng.random((5, 30)) < 0.6).astype(np.float32)
    versions = rng.integers(0, 8, (5, 30)).astype(np.int32)
    got = staleness.by_turn(9, versions, mask, turns=3)
    want = np.zeros((2, 3))
    for i in range(5):
        turn, prev = -1, False
        for t in range(30):
            on = mask[i, t] > 0
            turn += on and not prev
            prev = on
            if on:
                want[:, min(turn, 2)] += [9 - versions[i, t], 1]
    np.testing.assert_array_equal(got, want)


def _tiny(mode="sync", batching="continuous", turn_cache="keep"):
    c = shrink(get_config(), steps=3, eval_every=3)
    c.runtime.mode, c.sampler.batching, c.sampler.slots, c.sampler.turn_cache = mode, batching, 3, turn_cache
    c.task.max_turns = 3
    return c


def test_a_run_trains_multi_turn_episodes_and_reports_them(tmp_path):
    """Sync mode (the producer's `generate`, as async static batching calls it), continuous slots
    parking waiting rows with their caches rebuilt on resume, LoRA (the sampler decodes with the
    merged adapters); async streams with multi-turn rows run in tests/test_distributed.py."""
    c = _tiny("sync", "continuous", "recompute")
    c.model.lora.rank = 4
    summary = experiment.run(c, str(tmp_path), log=lambda *_: None)
    assert summary["version"] == 3 and summary["reward_failures"] == 0
    steps = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    last = steps[-1]
    assert last["episode/count"] >= 3 * 8 and 1.0 <= last["episode/turns"] <= 3.0
    assert last["tools/calls"] == pytest.approx(last["tools/calls_per_episode"] * last["episode/count"])
    assert len(last["staleness/turn"]) == 3 and last["staleness/turn"][0] is not None
    assert all(np.isfinite(r["loss"]) for r in steps)
    # rows that waited while 3 slots decoded had their caches rebuilt: the gap is float32 noise
    assert last["sampler/reprefill_rows"] > 0 and last["sampler/reprefill_logp_gap_max"] < 1e-3


@pytest.mark.parametrize("over,match", [
    (dict(env="abacus"), "unknown task.env 'abacus'; valid: calculator, python"),
    (dict(turn_reward="mean"), "turn_reward"),
])
def test_bad_multi_turn_options_fail_at_start_up(over, match):
    c = _tiny()
    c.task.update(over)
    with pytest.raises(ValueError, match=match):
        plan.resolve(c)


def test_a_multi_turn_task_decodes_on_one_of_the_sampler_devices_and_says_so():
    p = plan.resolve(_tiny())  # the suite fakes 8 CPU devices, shared by the learner and the samplers
    assert len(jax.devices()) == 8 and p.sampler_devices == (jax.devices()[0],)
    assert any("decode on one device for now" in w and "1 of this process's 8" in w for w in p.warnings)
    c = _tiny()
    c.sampler.tensor = 2  # tensor-parallel samplers: refused by name, not silently on one device
    with pytest.raises(ValueError, match=r"sampler.tensor=2: task '\w+' is multi-turn"):
        plan.resolve(c)
