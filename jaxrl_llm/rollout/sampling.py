"""Sampling from one decode step's logits: the distribution actually sampled from
(temperature, then top-k / top-p truncation, renormalised), exact categorical draws from one
uniform per row, and top-K capture, all fast at large vocabularies on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm import validation as V
from jaxrl_llm.models import policy_dist
from jaxrl_llm.models.policy_dist import PolicyDist, top_k  # noqa: F401  (top_k: re-exported)


BATCHING = ("static", "continuous")
TURN_CACHE = ("keep", "recompute")


SECTION = V.Section(  # the experiment's `sampler` section (the plan turns it into a SamplerConfig)
    temperature=(1.0, V.non_negative()), top_k=(0, V.integer(0)), top_p=(1.0, V.unit(low_open=True)),
    num_samples=(8, V.integer(1)), capture_topk=(4, V.integer(0)),
    max_new_tokens=(0, V.integer(0)),  # 0: the task's maximum answer length
    batching=("static", V.one_of(*BATCHING)),  # continuous: decode slots refilled every decode_segment steps
    slots=(0, V.integer(0)),  # continuous: decode slots per sampler (0: one per row of a batch)
    decode_segment=(32, V.integer(0)),  # decode steps between weight refreshes / slot refills
    cache_dtype=("auto", V.one_of("auto", "float32", "bfloat16")),  # auto: the model's compute dtype
    # multi-turn, continuous: a row waiting on its environment keeps its KV cache parked (keep), or
    # drops it and has it rebuilt from its tokens when it resumes (recompute: less memory, one
    # forward per resume, its behaviour log-prob mismatch logged)
    turn_cache=("keep", V.one_of(*TURN_CACHE)),
    backend=("jax", V.text()),  # the rollout backend (`rollout/backend.py`): "jax", or a registered one
    # a mixture of experts on several sampler devices: each holds E / devices of every layer's
    # experts and the tokens move to them (expert parallelism); off, or where the devices do not
    # divide E: every device holds every expert
    expert_parallel=(True, V.boolean()),
    # tensor parallelism: each group of this many sampler devices splits every layer's heads, KV
    # cache, MLP width and vocabulary (`devices.py`); the rows split over the groups
    tensor=(1, V.integer(1)),
)
default_config = SECTION.config
RULES = SECTION.rules
_DEFAULT = {k: f[0] for k, f in SECTION.fields.items()}


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """The resolved sampler: the `sampler` section's fields with the section's defaults, plus what
    the task and the model decide (`plan.sampler_cfg` fills them in from the run's config: the
    section's `max_new_tokens=0` and `cache_dtype="auto"` become the task's and the model's)."""

    max_new_tokens: int = 96
    temperature: float = _DEFAULT["temperature"]  # 0 -> greedy (recorded log-prob 0: a point mass)
    top_k: int = _DEFAULT["top_k"]  # 0: no top-k truncation
    top_p: float = _DEFAULT["top_p"]  # 1: no nucleus truncation
    capture_topk: int = _DEFAULT["capture_topk"]  # K of the recorded behaviour top-K (0 allowed)
    num_samples: int = _DEFAULT["num_samples"]  # G completions per prompt
    prompt_buckets: tuple = (16, 32, 64, 128, 256, 512, 1024, 2048)
    eos_token_id: Optional[int] = None
    pad_token_id: int = 0
    cache_dtype: str = "float32"
    decode_segment: int = _DEFAULT["decode_segment"]  # decode steps per attention-window growth / slot refill
    batching: str = _DEFAULT["batching"]  # static: a batch decodes until its longest row ends | continuous: slots
    slots: int = _DEFAULT["slots"]  # continuous: decode slots (0: one per row of the batch)
    turn_stop_ids: tuple = ()  # multi-turn: drawn tokens that end a turn (the environment answers)
    backend: str = _DEFAULT["backend"]  # which rollout backend samples (`rollout.backend.make`)
    turn_cache: str = _DEFAULT["turn_cache"]  # multi-turn, continuous: keep | recompute a waiting row's cache
    record_routing: bool = False  # a mixture of experts: record each position's experts (R3)
    expert_parallel: bool = _DEFAULT["expert_parallel"]  # a mixture of experts: split them over the devices
    tensor: int = _DEFAULT["tensor"]  # devices per tensor-parallel group (`devices.py`)

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.capture_topk < 0:
            raise ValueError(f"invalid sampling options: {self}")
        if self.max_new_tokens < 1 or self.num_samples < 1:
            raise ValueError("max_new_tokens and num_samples must be >= 1")
        if self.batching not in BATCHING or self.slots < 0:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)} and slots >= 0; got {self.batching!r}, "
                             f"{self.slots}")
        if self.turn_cache not in TURN_CACHE:
            raise ValueError(f"unknown turn_cache {self.turn_cache!r}; valid: {', '.join(TURN_CACHE)}")

    @property
    def dist(self) -> PolicyDist:
        return PolicyDist(self.temperature, self.top_k, self.top_p)




def sampling_logprobs(logits_BxV, cfg: SamplerConfig):
    """(log-probs of the distribution actually sampled from, its support size per row):
    softmax(logits / T) restricted to the top-k and then to the smallest nucleus with mass
    >= top_p, renormalised (`policy_dist.truncate`, the rule the learner mirrors)."""
    truncated = policy_dist.truncate(cfg.dist.scale(logits_BxV), cfg.dist)
    v = logits_BxV.shape[-1]
    kept = policy_dist.kept_count(truncated) if cfg.dist.truncated else jnp.full(logits_BxV.shape[:-1], v, jnp.int32)
    return jax.nn.log_softmax(truncated, -1), kept


def cdf_block(v: int):
    """Block size of the two-level inverse CDF. Even at small V a cumsum over V lowers to a
    chain of reduce-windows on CPU, several times slower than two levels of blocks."""
    return policy_dist.vocab_block(v) or next((c for c in (32, 16) if v % c == 0 and v >= 4 * c), None)


def inverse_cdf(logp_BxV, u_B):
    """Exact categorical draw from one uniform per row (the Gumbel trick needs V of them, which
    dominates decode time at large vocabularies on CPU). Where V splits into blocks, the inverse
    CDF is taken in two levels, blocks then tokens within the chosen block: a cumsum over V
    lowers to a slow log-depth scan on CPU, while block sums are one fused reduction."""
    p = jnp.exp(logp_BxV)
    b, v = p.shape
    c = cdf_block(v)
    if c is None:
        cdf = jnp.cumsum(p, -1)
        # u strictly below the total mass, so the first index with cdf > u exists and has p > 0.
        u = u_B[:, None] * cdf[:, -1:] * (1.0 - 1e-6)
        return jnp.sum(cdf <= u, -1).astype(jnp.int32)
    p_BxNxC = p.reshape(b, v // c, c)
    cdf_blocks = jnp.cumsum(p_BxNxC.sum(-1), -1)
    u = u_B * cdf_blocks[:, -1] * (1.0 - 1e-6)
    blk = jnp.sum(cdf_blocks <= u[:, None], -1)  # first block whose cdf exceeds u: mass > 0
    before = jnp.where(blk > 0, jnp.take_along_axis(cdf_blocks, jnp.maximum(blk - 1, 0)[:, None], 1)[:, 0], 0.0)
    within = jnp.take_along_axis(p_BxNxC, blk[:, None, None], 1)[:, 0]  # [B, C]
    idx = jnp.sum(before[:, None] + jnp.cumsum(within, -1) <= u[:, None], -1)
    # Rounding between the block sum and the in-block cumsum may leave idx one past the end:
    # fall back to the block's last token of positive probability.
    last = c - 1 - jnp.argmax((within > 0)[:, ::-1], -1)
    return (blk * c + jnp.minimum(idx, last)).astype(jnp.int32)


def sample(logits_BxV, u_B, cfg: SamplerConfig):
    """One token per row -> (token, its log-prob, support size, top-K ids, top-K log-probs) of
    the sampled distribution (greedy when temperature is 0: a point mass, log-prob 0)."""
    if cfg.temperature == 0:
        tok = jnp.argmax(logits_BxV, -1).astype(jnp.int32)
        logp_all = jnp.where(jnp.arange(logits_BxV.shape[-1])[None, :] == tok[:, None], 0.0, -jnp.inf)
        kept = jnp.ones(tok.shape, jnp.int32)
    else:
        logp_all, kept = sampling_logprobs(logits_BxV, cfg)
        tok = inverse_cdf(logp_all, u_B)
    logp = jnp.take_along_axis(logp_all, tok[:, None], -1)[:, 0]
    if cfg.capture_topk:
        top_logp, top_ids = top_k(logp_all, cfg.capture_topk)
    else:
        b = logits_BxV.shape[0]
        top_logp, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    return tok, logp, kept, top_ids.astype(jnp.int32), top_logp
