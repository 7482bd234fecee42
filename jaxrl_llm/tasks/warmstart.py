"""Supervised warm start: teacher-forced cross-entropy on task answers, so a tiny random
model begins RL with partial accuracy (room to improve, signal to learn from).

Supervised accuracy rises steeply and at a step that depends on the seed and the CPU's numerics
(2-digit addition: 0.2 is crossed between steps ~450 and ~700), so a fixed step count gives
starts anywhere from 0.2 to 0.85. The default stops at a *target* instead: greedy accuracy on
a validation draw of the training distribution (its own seed, not the held-out eval set) is
checked every `check_every` steps, and the warm start ends at the first check that reaches it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import validation as V
from jaxrl_llm.models import heads
from jaxrl_llm.tasks import multiturn, score


VALIDATION_SEED = 54321  # the warm start's validation draw; the held-out eval set has its own


# Supervised warm start of a randomly initialised policy (embedded task), up to `steps` steps,
# ending once greedy validation accuracy reaches `target` (0: run every step). cache_dir: warm
# starts are kept there by everything they depend on, so runs that share a seed (the arms of a
# sweep) warm-start once; empty: no cache.
SECTION = V.Section(steps=(2000, V.integer(0)), batch_size=(64, V.integer(1)), lr=(1e-3, V.positive()),
                    target=(0.2, V.unit()), check_every=(5, V.integer(1)), check_size=(256, V.integer(1)),
                    cache_dir=("", V.text()))
default_config = SECTION.config
RULES = SECTION.rules


def pack(pairs, length: int, pad: int = 0):
    """(prompt, answer[, answer loss mask]) id lists -> tokens, loss mask on answer tokens (those
    the mask keeps: a multi-turn trace's observations carry none), input mask [N, length]."""
    tokens = np.full((len(pairs), length), pad, np.int32)
    loss = np.zeros((len(pairs), length), np.float32)
    real = np.zeros((len(pairs), length), np.float32)
    for i, (p, a, *keep) in enumerate(pairs):
        seq = (list(p) + list(a))[:length]
        tokens[i, : len(seq)] = seq
        real[i, : len(seq)] = 1.0
        loss[i, len(p): len(seq)] = (keep[0] if keep else np.ones(len(a)))[:len(seq) - len(p)]
    return jnp.asarray(tokens), jnp.asarray(loss), jnp.asarray(real)


def warm_start(params, cfg, task, steps: int, batch_size: int = 64, lr: float = 3e-3, seed: int = 0,
               check=None, check_every: int = 0):
    """Adam on -mean log p(answer | prompt) for at most `steps` steps; every `check_every` steps
    `check(params)` may end it early (returns True). Returns (params, per-step losses)."""
    length = task.max_prompt_len + task.max_answer_len
    opt = optax.adam(lr)

    def loss_fn(p, tokens, loss_mask, input_mask):
        logp = heads.sequence_logprobs(p, cfg, tokens, input_mask, entropy=False)["logp"]
        return -(logp * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1.0)

    @jax.jit
    def step(p, o, tokens, loss_mask, input_mask):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens, loss_mask, input_mask)
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    rng = np.random.default_rng(seed)
    state, losses = opt.init(params), []
    for i in range(steps):
        params, state, loss = step(params, state, *pack(task.supervised(rng, batch_size), length))
        losses.append(float(loss))
        if check is not None and check_every and (i + 1) % check_every == 0 and check(params):
            break
    return params, losses


def accuracy(params, sampler, task, prompts, key=None, scorer=None) -> float:
    """Mean task reward of the sampler's completions (use a greedy SamplerConfig for eval);
    `scorer`: the task's scoring stage (default: `task.reward` in this thread). A multi-turn
    task's episodes are played out with its environment."""
    key = key if key is not None else jax.random.key(0)
    if multiturn.is_multi_turn(task):
        batch, _ = multiturn.generate(sampler, task, params, prompts, key)
        return float(np.mean(batch.rewards))
    batch = sampler.generate(params, prompts, key)
    args = (prompts, np.asarray(batch.tokens), np.asarray(batch.loss_mask) > 0, sampler.cfg.num_samples)
    rewards, _ = scorer.score(*args) if scorer is not None else score(task, *args)
    return float(rewards.mean())


def to_target(params, cfg, task, greedy, w, seed: int = 0):
    """The configured warm start (`w`: its config section): stops at `w.target` validation
    accuracy (greedy sampler `greedy`) or after `w.steps`. Returns (params, note)."""
    if not w.target:
        params, losses = warm_start(params, cfg, task, w.steps, w.batch_size, w.lr, seed)
        return params, f"warm start: {len(losses)} steps"
    val = task.prompts(np.random.default_rng(VALIDATION_SEED), w.check_size)
    seen = []

    def reached(p) -> bool:
        seen.append(accuracy(p, greedy, task, val))
        return seen[-1] >= w.target

    params, losses = warm_start(params, cfg, task, w.steps, w.batch_size, w.lr, seed, reached, w.check_every)
    got = f"validation accuracy {seen[-1]:.3f}" if seen else "no check"
    if not seen or seen[-1] < w.target:
        return params, (f"warm start: target {w.target} not reached in {len(losses)} steps ({got}); "
                        "raise warm_start.steps or lower warm_start.target")
    return params, f"warm start: {len(losses)} steps to {got} (target {w.target})"


def cache_key(cfg, task_config, w, seed: int, role: str) -> str:
    """Everything a warm start depends on: the model's shapes, the task, the warm start's own
    settings, the seed, which model (`role`: policy or rollout actor), JAX's version and the
    CPU numerics flags (an AVX2-emulated run does not reuse a native one's weights)."""
    what = dict(model=dataclasses.asdict(cfg), task=task_config.to_dict(),
                warm_start={k: v for k, v in w.items() if k != "cache_dir"}, seed=seed, role=role,
                jax=jax.__version__, backend=jax.default_backend(), xla_flags=os.environ.get("XLA_FLAGS", ""))
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached(compute, params, w, key: str):
    """`compute(params)` -> (params, note), through `w.cache_dir` when set: a hit restores the
    stored weights (into `params`' structure) and its note; a miss computes and stores both
    (written to a temporary name and renamed, so a killed run leaves no half file)."""
    if not w.cache_dir:
        return compute(params)
    path = os.path.join(w.cache_dir, f"warm_start_{key}")
    if os.path.exists(path + ".msgpack") and os.path.exists(path + ".json"):
        with open(path + ".msgpack", "rb") as f:
            restored = flax.serialization.from_bytes(jax.device_get(params), f.read())
        with open(path + ".json") as f:
            return jax.tree.map(jnp.asarray, restored), json.load(f)["note"] + " (cached)"
    params, note = compute(params)
    os.makedirs(w.cache_dir, exist_ok=True)
    for ext, data in ((".msgpack", flax.serialization.to_bytes(jax.device_get(params))),
                      (".json", json.dumps({"note": note}).encode())):
        with open(path + ext + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ext + ".tmp", path + ext)
    return params, note
