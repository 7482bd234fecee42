"""`tasks/warmstart.py`: supervised warm start to a target accuracy, and its cache."""
import dataclasses

import chex
import jax
import numpy as np

from jaxrl_llm import models
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.tasks import arithmetic as A
from jaxrl_llm.tasks import warmstart


def test_warm_start_learns_and_accuracy_is_measured():
    task = A.Arithmetic(digits=1, ops="+", eval_size=32)
    cfg = ModelConfig(vocab_size=A.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    params = models.init_params(cfg, jax.random.key(0))
    greedy = Sampler(cfg, SamplerConfig(max_new_tokens=task.max_answer_len, temperature=0.0, eos_token_id=A.EOS,
                                        pad_token_id=A.PAD, prompt_buckets=(task.max_prompt_len,), num_samples=1, capture_topk=0))
    before = warmstart.accuracy(params, greedy, task, task.eval_prompts())
    params, losses = warmstart.warm_start(params, cfg, task, steps=300, batch_size=64, lr=3e-3)
    after = warmstart.accuracy(params, greedy, task, task.eval_prompts())
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:5])
    assert after > before + 0.3, (before, after)


def test_warm_start_stops_at_its_target_accuracy():
    """The warm start ends at the first check whose validation accuracy reaches the target (so
    the RL start does not depend on where the seed's supervised curve happens to be)."""
    import ml_collections

    task = A.Arithmetic(digits=1, ops="+", eval_size=32)
    cfg = ModelConfig(vocab_size=A.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    greedy = Sampler(cfg, SamplerConfig(max_new_tokens=task.max_answer_len, temperature=0.0, eos_token_id=A.EOS,
                                        pad_token_id=A.PAD, prompt_buckets=(task.max_prompt_len,), num_samples=1, capture_topk=0))
    w = ml_collections.ConfigDict(dict(steps=300, batch_size=64, lr=3e-3, target=0.3, check_every=20, check_size=64))
    params, note = warmstart.to_target(models.init_params(cfg, jax.random.key(0)), cfg, task, greedy, w)
    steps = int(note.split(" steps")[0].split()[-1])
    val = task.prompts(np.random.default_rng(warmstart.VALIDATION_SEED), 64)
    assert steps % 20 == 0 and steps < 300, note
    assert warmstart.accuracy(params, greedy, task, val) >= 0.3, note
    # one check earlier it had not reached the target: rerun to that step
    earlier, _ = warmstart.warm_start(models.init_params(cfg, jax.random.key(0)), cfg, task, steps - 20, 64, 3e-3)
    assert warmstart.accuracy(earlier, greedy, task, val) < 0.3
    w.target, w.steps = 1.0, 40
    _, note = warmstart.to_target(params, cfg, task, greedy, w)
    assert "not reached in 40 steps" in note and "warm_start.steps" in note


def test_warm_start_cache_restores_the_same_weights_and_keys_on_what_it_depends(tmp_path):
    import ml_collections

    task = A.Arithmetic(digits=1, ops="+", eval_size=8)
    cfg = ModelConfig(vocab_size=A.VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    w = ml_collections.ConfigDict(dict(steps=3, batch_size=8, lr=1e-3, target=0.0, check_every=1, check_size=8,
                                       cache_dir=str(tmp_path)))
    task_cfg = ml_collections.ConfigDict(dict(name="arithmetic", digits=1))
    calls = []

    def compute(p):
        calls.append(1)
        return warmstart.to_target(p, cfg, task, None, w, seed=0)

    init = models.init_params(cfg, jax.random.key(0))
    key = warmstart.cache_key(cfg, task_cfg, w, 0, "policy")
    first, note = warmstart.cached(compute, init, w, key)
    again, note2 = warmstart.cached(compute, init, w, key)
    assert len(calls) == 1 and note2 == note + " (cached)" and note == "warm start: 3 steps"
    chex.assert_trees_all_equal(first, again)
    assert not np.allclose(np.asarray(jax.tree.leaves(first)[0]), np.asarray(jax.tree.leaves(init)[0]))
    # a different seed, model role, model shape or warm-start setting is a different entry;
    # the cache directory itself is not part of the key
    other = [warmstart.cache_key(cfg, task_cfg, w, 1, "policy"), warmstart.cache_key(cfg, task_cfg, w, 0, "actor"),
             warmstart.cache_key(dataclasses.replace(cfg, hidden_size=32), task_cfg, w, 0, "policy")]
    w2 = w.copy_and_resolve_references()
    w2.lr = 2e-3
    other.append(warmstart.cache_key(cfg, task_cfg, w2, 0, "policy"))
    assert len({key, *other}) == 5
    w2.lr, w2.cache_dir = 1e-3, "/elsewhere"
    assert warmstart.cache_key(cfg, task_cfg, w2, 0, "policy") == key
    w.cache_dir = ""  # off: computed every time
    warmstart.cached(compute, init, w, key)
    assert len(calls) == 2
