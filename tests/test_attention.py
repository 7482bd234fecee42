"""`models/attention.py`: each kernel against a NumPy restatement, the choice per platform, and
Pallas' splash kernel (run by its interpreter on CPU) in the model, its gradients and on a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import attention as attn, decoder
from jaxrl_llm.models.config import ModelConfig


def test_attention_in_query_chunks_is_exact():
    """Long sequences attend in blocks of `attention_chunk` queries (recomputed in backward), the
    last block padded when the length is not a multiple: the same logits and gradients as one
    block, with left padding."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, attention="chunked", attention_chunk=0)
    params = models.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 60), 0, 64)
    mask = jnp.ones_like(tokens).at[0, :9].set(0).at[2, :40].set(0)

    def run(chunk):
        c = cfg.replace(attention_chunk=chunk)
        loss = lambda p: jnp.sum(jnp.square(decoder.forward(p, c, tokens, mask)) * mask[..., None])
        return models.full_logits(params, c, tokens, mask), jax.grad(loss)(params)

    (ref_logits, ref_grads), (logits, grads) = run(0), run(16)  # 60 = 3 x 16 + 12
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), grads, ref_grads)  # f32 sums


def _attention_reference(q, k, v, mask):
    """NumPy, float64: softmax(q k^T / sqrt(hd)) v per head, KV heads shared by groups."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, hd = q.shape
    g = n // k.shape[1]
    out = np.zeros((b, t, n, hd))
    for h in range(n):
        s = np.einsum("btd,bds->bts", q[:, :, h], k[:, h // g]) / np.sqrt(hd)
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, h] = np.einsum("bts,bsd->btd", p / p.sum(-1, keepdims=True), v[:, h // g])
    return out


@pytest.mark.parametrize("kernel", ["xla", "einsum", "chunked", "splash"])
def test_every_cpu_kernel_matches_numpy_with_padding_segments_and_a_cache(kernel):
    """Each attention kernel that runs on CPU against a NumPy restatement, on the three masks the
    code builds: causal with left padding, two packed segments (both also as `Segments`, the form
    splash takes; Pallas' interpreter runs it here), and one decode query over a partly filled
    cache (splash hands that to XLA's). cuDNN runs on GPU only: experiments/gpu_check.py."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, attention=kernel, attention_chunk=8)
    rng = np.random.default_rng(0)
    b, t, s = 2, 20, 20
    causal = np.tril(np.ones((t, s), bool))[None]
    padded = causal & (np.arange(s) >= np.array([[3], [0]]))[:, None, :]
    seg = (np.arange(t) < 11)
    packed = causal & (seg[:, None] == seg[None, :])[None]
    cache = np.zeros((b, 1, 32), bool)
    cache[0, 0, :17], cache[1, 0, 4:9] = True, True
    ids = np.stack([np.arange(t) >= 3, np.ones(t, bool)]).astype(np.int32), np.tile(2 - seg, (b, 1))
    masks = [(padded, attn.Segments(jnp.asarray(ids[0]))), (np.broadcast_to(packed, (b, t, s)), attn.Segments(
        jnp.asarray(ids[1]))), (cache, None)]
    for mask, given in [(m, jnp.asarray(m)) for m, _ in masks] + [(m, g) for m, g in masks if g is not None]:
        tq, ts = mask.shape[1:]
        q = rng.normal(size=(b, tq, 4, 8)).astype(np.float32)
        k, v = rng.normal(size=(b, 2, 8, ts)).astype(np.float32), rng.normal(size=(b, 2, ts, 8)).astype(np.float32)
        got = attn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), given, cfg)
        real = mask.any(-1)  # a query with no allowed key has an unused output
        np.testing.assert_allclose(np.asarray(got)[real], _attention_reference(q, k, v, mask)[real], atol=2e-5)


def test_auto_picks_the_platforms_kernel():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    assert attn.kernel(cfg, "cpu") == "chunked" and attn.kernel(cfg, "tpu") == "splash"
    assert attn.kernel(cfg, "gpu") == "xla" and attn.kernel(cfg.replace(dtype="bfloat16"), "gpu") == "cudnn"
    assert attn.kernel(cfg.replace(attention="dot_product_attention"), "gpu") == "xla"  # the old name
    assert attn.kernel(cfg.replace(attention="einsum"), "gpu") == "einsum"




def _tiny(**kw):
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, attention="splash", **kw)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_splash_forward_and_gradients_equal_chunked_padded_and_packed(remat):
    """The whole decoder on splash (lengths padded to its 128-lane blocks) against the chunked
    einsums: hidden states at real positions and parameter gradients, left-padded and packed."""
    cfg = _tiny(remat=remat)
    params = models.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 60), 0, 64)
    mask = jnp.ones_like(tokens).at[0, :9].set(0)
    segment = jnp.asarray(np.repeat([[1, 2, 3, 0]], [25, 20, 10, 5], axis=1).repeat(2, 0))
    position = jnp.asarray(np.concatenate([np.arange(25), np.arange(20), np.arange(10), np.zeros(5, int)]))[None]
    position = position.repeat(2, 0)
    for run, real in ((lambda p, c: decoder.forward(p, c, tokens, mask), mask),
                      (lambda p, c: decoder.forward_packed(p, c, tokens, segment, position), segment > 0)):
        def both(c):
            loss = lambda p: jnp.sum(jnp.square(run(p, c)) * real[..., None])  # noqa: E731
            return run(params, c), jax.grad(loss)(params)

        (want, want_g), (got, got_g) = both(cfg.replace(attention="chunked", attention_chunk=16)), both(cfg)
        np.testing.assert_allclose(np.asarray(got)[np.asarray(real) > 0], np.asarray(want)[np.asarray(real) > 0],
                                   atol=2e-5)
        # float32 sums in another order: the einsum kernel differs from chunked as much (2e-5 of a leaf's max)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max()), got_g, want_g)


def test_splash_runs_per_shard_on_the_learners_mesh():
    """Under the learner's mesh (`on_mesh`) splash is a `shard_map` over the batch axes, heads over
    `tensor` (XLA cannot partition a Pallas call); per shard it computes what it does unsharded.
    Other kernels take no context."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    cfg = _tiny()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(4, 20, 4, 8)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(4, 2, 8, 20)), jnp.float32), jnp.asarray(rng.normal(size=(4, 2, 20, 8)), jnp.float32)
    ids = jnp.asarray((np.arange(20) >= np.array([[0], [5], [2], [0]])).astype(np.int32))

    def sharded(q, k, v, ids):
        with attn.on_mesh(cfg, mesh):
            return attn.attention(q, k, v, attn.Segments(ids), cfg)

    assert "shard_map" in str(jax.make_jaxpr(sharded)(q, k, v, ids))
    assert "shard_map" not in str(jax.make_jaxpr(lambda *a: attn.attention(*a[:3], attn.Segments(a[3]), cfg))(
        q, k, v, ids))
    assert isinstance(attn.on_mesh(cfg.replace(attention="chunked"), mesh), type(attn.on_mesh(cfg, None)))
    real = np.asarray(ids) > 0
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    on_mesh = [jax.device_put(x, rows) for x in (q, k, v, ids)]  # as the learner's batch
    np.testing.assert_allclose(np.asarray(jax.jit(sharded)(*on_mesh))[real],
                               np.asarray(attn.attention(q, k, v, attn.Segments(ids), cfg))[real], atol=1e-6)
