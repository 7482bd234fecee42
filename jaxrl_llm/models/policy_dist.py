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
    cutoff are kept). Nothing sorts the vocabulary: with top-k the nucleus is taken among the k
    candidates (`_nucleus_in`), without it the cutoff is found by bisection (`_nucleus_cutoff`)."""
    if dist.top_k:
        ranked = top_k(scaled_NxV, dist.top_k)[0]  # [N, k], descending
        kth = ranked[..., -1:]
        scaled_NxV = jnp.where(scaled_NxV >= kth, scaled_NxV, -jnp.inf)
        if dist.top_p < 1.0:
            # Entries tied with the k-th beyond the k ranked ones are in the support too: they
            # count in the normaliser, and sit after every ranked entry in a descending order.
            ties = jnp.sum(scaled_NxV >= kth, -1) - dist.top_k
            cutoff = _nucleus_in(ranked, ties, dist.top_p)
            scaled_NxV = jnp.where(scaled_NxV >= cutoff, scaled_NxV, -jnp.inf)
    elif dist.top_p < 1.0:
        scaled_NxV = jnp.where(scaled_NxV >= _nucleus_cutoff(scaled_NxV, dist.top_p), scaled_NxV, -jnp.inf)
    return scaled_NxV


def _nucleus_in(ranked_NxK, extra_N, top_p: float):
    """The nucleus cutoff of a row whose support is `ranked_NxK` (descending) plus `extra_N`
    more entries equal to its last: the smallest value whose mass strictly before it is < top_p.
    A tied entry past the k-th never lowers the cutoff (the k-th has the same value and less mass
    before it), so only the normaliser needs them."""
    e = jnp.exp(ranked_NxK - ranked_NxK[..., :1])
    probs = e / (e.sum(-1, keepdims=True) + extra_N[:, None] * e[..., -1:])
    mass_before = jnp.cumsum(probs, -1) - probs
    return jnp.min(jnp.where(mass_before < top_p, ranked_NxK, jnp.inf), -1, keepdims=True)


def order_key(x):
    """uint32 keys ordered as the float32 values are (-0 < +0), for bisection over values."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _bisect(keys_NxV, inside):
    """Per row, the largest uint32 key k with inside(k) (a condition true at 0 and monotone:
    true up to some key, false after): 32 halvings, each one pass over the row."""
    lo = jnp.zeros(keys_NxV.shape[:-1] + (1,), jnp.uint32)
    hi = jnp.full_like(lo, 0xFFFFFFFF)
    for _ in range(32):  # unrolled: fused passes, no data-dependent loop in the decode step
        gap = hi - lo  # halved rounding up, without overflowing uint32
        mid = lo + gap // 2 + gap % 2
        ok = inside(mid)
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    return lo


def _nucleus_cutoff(scaled_NxV, top_p: float):
    """The sampler's nucleus cutoff without a sort: the smallest row value x whose mass above,
    M(x) = sum p[y > x], is < top_p (the first of a tie group in descending order has exactly
    that mass before it). M only grows as x falls, so the keys where M >= top_p form a prefix."""
    probs = jax.nn.softmax(scaled_NxV, -1)
    keys = order_key(scaled_NxV)
    below = _bisect(keys, lambda k: jnp.sum(jnp.where(keys > k, probs, 0.0), -1, keepdims=True) >= top_p)
    # `below` is the largest key still short of the cutoff (M >= top_p there), or 0 when none is.
    short = jnp.sum(jnp.where(keys > below, probs, 0.0), -1, keepdims=True) >= top_p
    above = jnp.where(short, keys > below, keys >= below)
    return jnp.min(jnp.where(above, scaled_NxV, jnp.inf), -1, keepdims=True)


def nth_largest(x_NxV, n_N):
    """Each row's n-th largest value (n >= 1) without a sort: the largest key with at least n
    entries at or above it is the n-th largest entry's own."""
    keys = order_key(x_NxV)
    k = _bisect(keys, lambda k: jnp.sum(keys >= k, -1, keepdims=True) >= n_N[:, None])
    return jnp.max(jnp.where(keys <= k, x_NxV, -jnp.inf), -1, keepdims=True)


def kept_count(truncated_NxV):
    """Size of the support of a truncated row (the `behav_kept` the sampler records)."""
    return jnp.isfinite(truncated_NxV).sum(-1).astype(jnp.int32)


def restrict(scaled_NxV, n_N, target_N, dist: PolicyDist):
    """The learner's rule: keep the n_N largest entries of each row plus its target token
    (module docstring); n <= 0 (prompt and pad positions, or no record) keeps the whole row.
    Uses top-k when the sampler had one (n <= top_k), else a bisection (`nth_largest`)."""
    v = scaled_NxV.shape[-1]
    rank_by = jax.lax.stop_gradient(scaled_NxV)  # the kept set is a choice, not differentiated
    if dist.top_k:
        ranked = top_k(rank_by, dist.top_k)[0]
        nth = jnp.take_along_axis(ranked, jnp.clip(n_N - 1, 0, dist.top_k - 1)[:, None], -1)
    else:
        nth = nth_largest(rank_by, jnp.clip(n_N, 1, v))
    keep = (scaled_NxV >= nth) | (jnp.arange(v)[None, :] == target_N[:, None]) | (n_N[:, None] <= 0)
    return jnp.where(keep, scaled_NxV, -jnp.inf)
