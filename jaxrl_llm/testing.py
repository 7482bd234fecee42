"""Synthetic, internally consistent batches for tests, examples and benchmarks.

Behaviour and policy are real distributions over a small vocabulary, tokens are sampled from
the behaviour, and every recorded log-prob / top-k is read off those distributions, so an
objective sees exactly what a sampler + learner would hand it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import advantages
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch


class Synthetic(NamedTuple):
    policy: PolicyOutput
    batch: TrajectoryBatch
    behav_logp_BxLxV: np.ndarray  # full behaviour log-softmax (for reference checks)
    policy_logp_BxLxV: np.ndarray  # full pi_theta log-softmax
    prox_logp_BxLxV: np.ndarray  # full pi_prox log-softmax


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def random_batch(
    seed: int = 0,
    num_prompts: int = 3,
    group_size: int = 4,
    length: int = 12,
    vocab: int = 16,
    topk: int = 4,
    learner_version: int = 5,
    max_staleness: int = 4,
    drift: float = 0.3,
    with_ref: bool = True,
) -> Synthetic:
    """Ragged prompts/responses, mixed per-token versions (partial rollouts), binary rewards
    (some groups all-equal, so zero-variance masking has work to do), GRPO advantages."""
    rng = np.random.default_rng(seed)
    b, l, v, k = num_prompts * group_size, length, vocab, topk
    behav_logits = rng.normal(size=(b, l, v)) * 1.5
    prox_logits = behav_logits + drift * rng.normal(size=(b, l, v))
    policy_logits = prox_logits + drift * rng.normal(size=(b, l, v))
    ref_logits = behav_logits + drift * rng.normal(size=(b, l, v))
    behav, prox, pol, ref = (_log_softmax(x) for x in (behav_logits, prox_logits, policy_logits, ref_logits))

    tokens = np.zeros((b, l), np.int32)
    for i in range(b):
        for t in range(l):
            tokens[i, t] = rng.choice(v, p=np.exp(behav[i, t]))
    mask = np.zeros((b, l), np.float32)
    versions = np.full((b, l), -1, np.int32)
    for i in range(b):
        p_len = rng.integers(1, l // 3 + 1)
        r_len = rng.integers(1, l - p_len + 1)
        mask[i, p_len : p_len + r_len] = 1.0
        # a completion may span versions (weights updated mid-generation): non-decreasing
        start = learner_version - rng.integers(0, max_staleness + 1)
        steps = np.cumsum(rng.random(r_len) < 0.2)
        versions[i, p_len : p_len + r_len] = np.minimum(start + steps, learner_version)

    def take(logp_BxLxV):
        return np.take_along_axis(logp_BxLxV, tokens[..., None], -1)[..., 0].astype(np.float32)

    topk_ids = np.argsort(-behav, -1)[..., :k].astype(np.int32)
    pol_topk_ids = np.argsort(-pol, -1)[..., :k].astype(np.int32)
    group_ids = np.repeat(np.arange(num_prompts), group_size).astype(np.int32)
    rewards = (rng.random(b) < 0.5).astype(np.float32)
    rewards[:group_size] = 1.0  # first group: zero reward variance
    adv = advantages.compute("grpo", jnp.asarray(rewards), jnp.asarray(group_ids), jnp.asarray(mask))

    batch = TrajectoryBatch(
        tokens=jnp.asarray(tokens),
        loss_mask=jnp.asarray(mask),
        behav_logp=jnp.asarray(take(behav)),
        versions=jnp.asarray(versions),
        topk_ids=jnp.asarray(topk_ids),
        topk_logp=jnp.asarray(np.take_along_axis(behav, topk_ids, -1), jnp.float32),
        rewards=jnp.asarray(rewards),
        group_ids=jnp.asarray(group_ids),
        advantages=adv,
        prox_logp=jnp.asarray(take(prox)),
        prox_topk_logp=jnp.asarray(np.take_along_axis(prox, topk_ids, -1), jnp.float32),
        ref_logp=jnp.asarray(take(ref)) if with_ref else None,
        truncated=jnp.asarray(mask[:, -1] > 0),
    )
    ent = -(np.exp(pol) * pol).sum(-1)
    policy = PolicyOutput(
        logp=jnp.asarray(take(pol)),
        version=jnp.asarray(learner_version, jnp.int32),
        entropy=jnp.asarray(ent, jnp.float32),
        logp_at_behav_topk=jnp.asarray(np.take_along_axis(pol, topk_ids, -1), jnp.float32),
        topk_ids=jnp.asarray(pol_topk_ids),
        topk_logp=jnp.asarray(np.take_along_axis(pol, pol_topk_ids, -1), jnp.float32),
        behav_logp_at_topk=jnp.asarray(np.take_along_axis(behav, pol_topk_ids, -1), jnp.float32),
        rng=jax.random.key(seed),
    )
    return Synthetic(policy, batch.validate(), behav, pol, prox)


def model_batch(params, cfg, seed: int = 0, num_prompts: int = 2, group_size: int = 4, length: int = 16,
                prompt: int = 5, topk: int = 4, version: int = 3, max_staleness: int = 2, drift: float = 0.1,
                temperature: float = 1.0) -> TrajectoryBatch:
    """A batch for `params`/`cfg`: random tokens, behaviour log-probs = the model's own plus
    drift (a stale policy), the model's top-k, mixed versions, GRPO advantages. For learner
    tests and benchmarks that need no sampler."""
    from jaxrl_llm.models import heads
    from jaxrl_llm.models.policy_dist import PolicyDist

    rng = np.random.default_rng(seed)
    b = num_prompts * group_size
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, length)), jnp.int32)
    stats = heads.sequence_logprobs(params, cfg, tokens, dist=PolicyDist(temperature), topk=topk, entropy=False)
    mask = np.zeros((b, length), np.float32)
    mask[:, prompt:] = 1.0
    for i in range(b):  # ragged completions: some end early (right padding)
        mask[i, length - rng.integers(0, length - prompt):] = 0.0
    noise = drift * rng.normal(size=(b, length))
    versions = np.where(mask > 0, version - rng.integers(0, max_staleness + 1, (b, 1)), -1).astype(np.int32)
    group_ids = np.repeat(np.arange(num_prompts), group_size).astype(np.int32)
    rewards = (rng.random(b) < 0.5).astype(np.float32)
    return TrajectoryBatch(
        tokens=tokens, loss_mask=jnp.asarray(mask),
        behav_logp=jnp.asarray(np.minimum(np.asarray(stats["logp"]) + noise, -1e-4) * mask, jnp.float32),
        versions=jnp.asarray(versions),
        topk_ids=stats["topk_ids"].astype(jnp.int32) if topk else jnp.zeros((b, length, 0), jnp.int32),
        topk_logp=(stats["topk_logp"] + jnp.asarray(drift * rng.normal(size=(b, length, 1)), jnp.float32)
                   if topk else jnp.zeros((b, length, 0), jnp.float32)),
        rewards=jnp.asarray(rewards), group_ids=jnp.asarray(group_ids),
        advantages=advantages.compute("grpo", jnp.asarray(rewards), jnp.asarray(group_ids), jnp.asarray(mask)),
        input_mask=jnp.asarray(np.maximum(mask, (np.arange(length) < prompt)[None].astype(np.float32))),
    ).validate()


# ------------------------------------------------------------------ local Hugging Face files
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(path: str, corpus=("What is 12 + 60? The answer is \\boxed{72}.",), vocab_size: int = 300,
                   special=()):
    """A byte-level BPE tokenizer with ChatML-style special tokens (and `special`, e.g. tool-call
    tags) and a chat template, trained on `corpus` and saved to `path` (what AutoTokenizer reads
    from a real checkpoint)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast
