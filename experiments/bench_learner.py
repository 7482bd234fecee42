"""Learner throughput vs a PyTorch eager GRPO step on the same HF model (not a test).

    python experiments/bench_learner.py [--json out.json] [--repeats 3]

Same random-init Qwen2-architecture model as bench_sampler (vocab 512, ~3.4M params), a batch
of B = 32 sequences x L = 128 tokens (96 trained), 4 minibatch updates per step with the
GRPO clipped loss and AdamW + global-norm clipping on both sides (PyTorch on every core).
Also: A-3PO vs decoupled PPO (recompute), prox computation time and whole-step time. The peer
comparison runs both sides on padded rows (`learner.packing=off`): the same work.

Heavy tail: B = 32 sequences of a 32-token prompt and log-normal completion lengths (median 64,
sigma 1, clipped to [1, 512]: L = 544), trained packed (`learner.packing=auto`) and padded;
`packed_vs_padded_heavy_tail` is trained (non-padding) tokens per second packed over padded,
steps interleaved, median and range over the repeats.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np

from jaxrl_llm.learner import learner as L
from jaxrl_llm import models, testing
from jaxrl_llm.objectives import ppo

from common import across_isas, cpu_kind, flops_per_token, hf_model, matmul_peak_flops, parse_args, report  # noqa: E402

B, LEN, PROMPT, MINIBATCHES = 32, 128, 32, 4


def _learner(cfg, name, packing="off", mesh=None):
    c = L.default_config()
    c.lr, c.num_minibatches, c.packing = 1e-5, MINIBATCHES, packing
    return L.Learner(cfg, {"name": name}, c, mesh=mesh)


def heavy_tail_batch(params, cfg, seed=0, new_max=512, prompt=PROMPT):
    """Model-consistent batch whose completion lengths are log-normal (median 64, sigma 1)."""
    rng = np.random.default_rng(seed)
    length = prompt + new_max
    batch = testing.model_batch(params, cfg, seed=seed, num_prompts=B // 8, group_size=8, length=length,
                                prompt=prompt, topk=0, version=4, max_staleness=4)
    gen = np.clip(np.round(rng.lognormal(np.log(64), 1.0, B)), 1, new_max).astype(int)
    cols = np.arange(length)[None, :]
    loss = ((cols >= prompt) & (cols < prompt + gen[:, None])).astype(np.float32)
    inp = np.maximum(loss, (cols < prompt).astype(np.float32))
    m = jax.numpy.asarray(loss)
    return batch.replace(input_mask=jax.numpy.asarray(inp), loss_mask=m, behav_logp=batch.behav_logp * m,
                         advantages=batch.advantages * m), gen


def time_heavy_tail(cfg, params, repeats):
    """Trained tokens/s of packed over padded steps on the heavy-tailed batch, interleaved."""
    batch, gen = heavy_tail_batch(params, cfg)
    trained = float(gen.sum())
    runs = {}
    for mode in ("auto", "off"):
        lrn = _learner(cfg, "ppo", mode)
        state, _ = lrn.train_step(lrn.init(jax.random.key(0), params=params), batch)  # compile
        runs[mode] = [lrn, state, []]
    for _ in range(repeats):
        for mode in ("auto", "off"):
            lrn, state, times = runs[mode]
            t = time.perf_counter()
            state, _ = lrn.train_step(state, batch)
            jax.block_until_ready(state.params)
            times.append(time.perf_counter() - t)
            runs[mode][1] = state
    ratios = np.array(runs["off"][2]) / np.array(runs["auto"][2])
    from jaxrl_llm.learner import packing as packing_lib
    plan = packing_lib.layout(batch.input_mask, MINIBATCHES)
    rows = plan.rows * MINIBATCHES if plan is not None else B
    return {
        "heavy_tail_trained_tokens": trained,
        "heavy_tail_mean_completion": float(gen.mean()),
        "heavy_tail_packed_rows": rows,
        "heavy_tail_padded_rows": B,
        "packed_tokens_per_s": trained / float(np.median(runs["auto"][2])),
        "padded_tokens_per_s": trained / float(np.median(runs["off"][2])),
        "packed_vs_padded_heavy_tail": float(np.median(ratios)),
        "packed_vs_padded_heavy_tail_min": float(ratios.min()),
        "packed_vs_padded_heavy_tail_max": float(ratios.max()),
    }


def time_ours(cfg, params, batch, names, repeats):
    """Best step time (and prox pass time) per objective; the objectives' steps alternate so
    drift in machine speed hits them equally."""
    runs = {}
    for name in names:
        lrn = _learner(cfg, name)
        state = lrn.init(jax.random.key(0), params=params)
        state, _ = lrn.train_step(state, batch)  # compile
        runs[name] = [lrn, state, float("inf"), float("inf")]
    for _ in range(repeats):
        for name in names:
            lrn, state, best, prox = runs[name]
            t = time.perf_counter()
            state, m = lrn.train_step(state, batch)
            jax.block_until_ready(state.params)
            runs[name] = [lrn, state, min(best, time.perf_counter() - t), min(prox, m["prox_time_s"])]
    return runs


def time_a3po_prox(lrn, state, batch, repeats=50):
    """The A-3PO proximal computation itself: the elementwise interpolation of Eq. 3-5 (best of
    `repeats`)."""
    from jaxrl_llm.batch import PolicyOutput

    return min(ppo.time_a3po_prox(PolicyOutput(logp=batch.behav_logp, version=state.version), batch, repeats))


def time_torch(model, batch, repeats):
    import torch

    torch.set_num_threads(os.cpu_count())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tokens = torch.as_tensor(np.asarray(batch.tokens), dtype=torch.long)
    mask = torch.as_tensor(np.asarray(batch.loss_mask))[:, 1:]
    old = torch.as_tensor(np.asarray(batch.behav_logp))[:, 1:]
    adv = torch.as_tensor(np.asarray(batch.advantages))[:, 1:]

    def step():
        for idx in torch.arange(B).chunk(MINIBATCHES):
            logits = model(tokens[idx]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, tokens[idx, 1:, None])[..., 0]
            ratio = torch.exp(torch.clamp(logp - old[idx], -20, 20))
            a = adv[idx]
            loss_tok = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
            loss = (loss_tok * mask[idx]).sum() / mask[idx].sum().clamp(min=1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    args = parse_args(__doc__)
    if across_isas(args):  # each ISA in its own processes
        return
    peak = matmul_peak_flops()
    with tempfile.TemporaryDirectory() as d:
        hf = hf_model(512, d)
        params, cfg = models.load_params(d)
    batch = testing.model_batch(params, cfg, seed=0, num_prompts=B // 8, group_size=8, length=LEN, prompt=PROMPT,
                                topk=0, version=4, max_staleness=4)
    tokens = B * LEN
    train_flops = 3 * tokens * flops_per_token(cfg, LEN / 2)
    t_ppo = time_ours(cfg, params, batch, ["ppo"], args.repeats)["ppo"][2]
    t_torch = time_torch(hf, batch, args.repeats)
    runs = time_ours(cfg, params, batch, ["decoupled_ppo", "a3po"], args.repeats)
    _, _, t_dec, prox_dec = runs["decoupled_ppo"]
    lrn, state, t_a3po, _ = runs["a3po"]
    prox_a3po = time_a3po_prox(lrn, state, batch)
    res = {
        "device": jax.devices()[0].device_kind,
        "matmul_peak_gflops": peak / 1e9,
        "ours_tokens_per_s": tokens / t_ppo,
        "torch_tokens_per_s": tokens / t_torch,
        "ratio_vs_torch": t_torch / t_ppo,
        "peak_fraction": train_flops / t_ppo / peak,
        "torch_peak_fraction": train_flops / t_torch / peak,
        "decoupled_step_s": t_dec,
        "a3po_step_s": t_a3po,
        "prox_recompute_s": prox_dec,
        "a3po_prox_s": prox_a3po,
        "a3po_prox_speedup": prox_dec / prox_a3po,
        "a3po_step_speedup": t_dec / t_a3po,
        **cpu_kind(),
    }
    res.update(time_heavy_tail(cfg, params, max(args.repeats, 5)))
    report(res, args.json)


if __name__ == "__main__":
    main()
