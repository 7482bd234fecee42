"""A-3PO's cost claim at the size it speaks of.

A-3PO replaces decoupled PPO's proximal recompute pass (one forward of the policy over the
step's batch) with an interpolation of log-probs the learner already has (arXiv:2512.06547,
Sec. 4). On the embedded task's 2-layer model a forward is almost free, so the ratio measured
there says nothing about a language model; this measures both on a Qwen2.5-0.5B-shaped decoder
(random weights, nothing is downloaded) and a learner batch of 4 x 1024 tokens, on this
machine's CPU. One learner is built and compiled once; each seed then draws its own batch and
times one recompute pass and the median of `repeats` interpolation calls on it.
"""

from __future__ import annotations

import time

import numpy as np

# Qwen2.5-0.5B: 24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864, tied embeddings.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                  num_kv_heads=2, head_dim=64, tie_word_embeddings=True, rope_theta=1000000.0)


def prox_costs(seeds, rows: int = 4, seq_len: int = 1024, shapes: dict = QWEN25_05B, repeats: int = 50,
               log=print) -> dict:
    """{"shape", "prox_pass_s": [per seed], "a3po_prox_s": [per seed]}: seconds of decoupled
    PPO's recompute pass and of A-3PO's interpolation on the same batch."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.learner import learner as L
    from jaxrl_llm import testing
    from jaxrl_llm.parallel import sharding
    from jaxrl_llm.models.config import ModelConfig
    from jaxrl_llm.objectives.ppo import time_a3po_prox

    cfg = ModelConfig(**shapes, remat="full")
    c = L.default_config()
    c.num_minibatches, c.packing = 2, "off"
    lrn = L.Learner(cfg, {"name": "decoupled_ppo"}, c, mesh=sharding.make_mesh(None, jax.devices()[:1]))
    state = lrn.init(jax.random.key(0))

    def batch_of(seed):
        s = testing.random_batch(seed, num_prompts=1, group_size=rows, length=seq_len, vocab=8, topk=0)
        ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, seq_len), dtype=np.int32)
        return s, s.batch.replace(tokens=jnp.asarray(ids))

    t = time.perf_counter()
    lrn.prepare(state, batch_of(10_000)[1])  # compiles the recompute pass
    log(f"a3po cost: {cfg.num_params / 1e6:.0f}M-parameter model, recompute pass compiled in "
        f"{time.perf_counter() - t:.0f} s")
    prox, interp = [], []
    for seed in seeds:
        s, batch = batch_of(seed)
        prox.append(float(lrn.prepare(state, batch)[2]["prox_time_s"]))
        interp.append(float(np.median(time_a3po_prox(s.policy, s.batch, repeats))))
        log(f"a3po cost, seed {seed}: recompute pass {prox[-1]:.2f} s, interpolation {interp[-1] * 1e6:.0f} us")
    name = "Qwen2.5-0.5B-shaped" if shapes == QWEN25_05B else "small"
    shape = (f"{name} ({cfg.num_params / 1e6:.1f}M parameters, float32), {rows} x {seq_len} tokens, "
             f"{jax.devices()[0].platform.upper()}, one device")
    return {"shape": shape, "prox_pass_s": prox, "a3po_prox_s": interp}
