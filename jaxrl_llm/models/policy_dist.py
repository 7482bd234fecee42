"""The policy's sampling distribution, one definition for the sampler and the learner.

Tokens are drawn from softmax(logits / T) truncated to the top-k and then to the smallest
nucleus of mass >= top_p, renormalised (`truncate`). The behaviour log-prob the sampler records
is that distribution's, so the learner must evaluate pi_theta the same way, or every ratio
pi_theta / pi_behav on perfectly on-policy data carries log(kept mass) (about -0.1 at top_p=0.9)
and every objective clips and reweights fresh tokens. vLLM calls the sampler's side
"processed logprobs"; peers that recompute training log-probs from the full softmax show this
mismatch (vllm-project/vllm#42259 tracks it across verl, SkyRL and TRL).

The learner's side (`restrict`) follows DeepSeek-V3.2's "Keep Sampling Mask" (arXiv:2512.02556,
Sec. 3.1): pi_theta is truncated to the support the sampler drew from, so pi_behav and pi_theta
share one action space. We keep that support as its size n (one int per token, `behav_kept`),
not as a V-wide mask: the learner keeps its own n most likely tokens. At unchanged params this
is the sampler's set exactly, and unlike re-running the top-p rule it is robust to the last-ulp
differences between the decode path and the teacher-forced forward (a mass threshold flips a
boundary token worth ~p_boundary of log-prob; a rank only flips between near-equal logits,
which changes the normaliser by their difference). After an update the drawn token can fall out
of pi_theta's own top n; it is then kept as well (the set is top-n plus the target), so its
log-prob is finite and small rather than -inf: DeepSeek's mask has the same property, since
the drawn token always lies in the sampler's support.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PolicyDist:
    """Temperature and truncation of the distribution tokens are drawn from (hashable: static
    under jit). `temperature` 0 means greedy in the sampler; the learner never sees it."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0  # 1: no nucleus truncation

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def scale(self, logits):
        return logits.astype(jnp.float32) / (self.temperature if self.temperature > 0 else 1.0)


def vocab_block(v: int):
    """Block size for top-k screening (and two-level sampling) at large vocabularies: a power of
    two dividing V (so no padded entries exist), or None (small or awkward V: one-level top-k)."""
    if v < 4096:
        return None
    return next((c for c in (256, 128, 64) if v % c == 0), None)


def top_k(x_NxV, k: int):
    """`lax.top_k` over the last axis (values, ids). At large V it first keeps the k blocks with
    the largest maxima (every top-k entry lies in one of them) and ranks only their entries:
    XLA:CPU's TopK scans the whole row serially, a fused block max is far cheaper."""
    b, v = x_NxV.shape
    c = vocab_block(v)
    if c is None or k > c or k * c >= v:
        return jax.lax.top_k(x_NxV, k)
    blocks = x_NxV.reshape(b, v // c, c)
    # Ascending block order: ties among candidates then go to the lower vocabulary id.
    chosen = jnp.sort(jax.lax.top_k(blocks.max(-1), k)[1], -1)  # [N, k]
    cand = jnp.take_along_axis(blocks, chosen[:, :, None], 1).reshape(b, k * c)
    vals, j = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(chosen, j // c, 1) * c + j % c


def truncate(scaled_NxV, dist: PolicyDist):
    """The sampler's rule: -inf outside the top-k, then outside the smallest nucleus whose mass
    reaches top_p (a token is kept while the mass strictly before it is < top_p; ties at the
    cutoff are kept)."""
    if dist.top_k:
        kth = top_k(scaled_NxV, dist.top_k)[0][..., -1:]
        scaled_NxV = jnp.where(scaled_NxV >= kth, scaled_NxV, -jnp.inf)
    if dist.top_p < 1.0:
        sorted_desc = -jnp.sort(-scaled_NxV, axis=-1)
        probs = jax.nn.softmax(sorted_desc, -1)
        mass_before = jnp.cumsum(probs, -1) - probs
        cutoff = jnp.min(jnp.where(mass_before < dist.top_p, sorted_desc, jnp.inf), -1, keepdims=True)
        scaled_NxV = jnp.where(scaled_NxV >= cutoff, scaled_NxV, -jnp.inf)
    return scaled_NxV


def kept_count(truncated_NxV):
    """Size of the support of a truncated row (the `behav_kept` the sampler records)."""
    return jnp.isfinite(truncated_NxV).sum(-1).astype(jnp.int32)


def restrict(scaled_NxV, n_N, target_N, dist: PolicyDist):
    """The learner's rule: keep the n_N largest entries of each row plus its target token
    (module docstring); n <= 0 (prompt and pad positions, or no record) keeps the whole row.
    Uses top-k when the sampler had one (n <= top_k), else a full sort."""
    v = scaled_NxV.shape[-1]
    rank_by = jax.lax.stop_gradient(scaled_NxV)  # the kept set is a choice, not differentiated
    ranked = top_k(rank_by, dist.top_k)[0] if dist.top_k else -jnp.sort(-rank_by, axis=-1)
    idx = jnp.clip(n_N - 1, 0, ranked.shape[-1] - 1)
    nth = jnp.take_along_axis(ranked, idx[:, None], -1)
    keep = (scaled_NxV >= nth) | (jnp.arange(v)[None, :] == target_N[:, None]) | (n_N[:, None] <= 0)
    return jnp.where(keep, scaled_NxV, -jnp.inf)
