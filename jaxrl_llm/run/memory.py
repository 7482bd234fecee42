"""The memory plan: what a learner step and a sampler call hold, from the shapes alone.

Written out so that a run can print it at start-up and refuse, before anything is built, a
configuration that cannot fit; `experiments/bench_scale.py` checks it against the compiled
executables' memory analysis and the process's peak RSS on a Qwen2.5-0.5B-shaped model.

Learner (one step, `num_minibatches` updates over `rows` sequences of `seq_len` tokens):
  params (float32 master) + grads + AdamW's two moments + one update tree (optax forms the
  updates before applying them) = 5 * 4 bytes per parameter, plus the activations of one
  minibatch: per layer and token the residual stream and norms (float32), q/k/v before and
  after RoPE, the attention output and four MLP intermediates (compute dtype), plus the
  attention scores (float32) and probabilities per query (of one `attention_chunk` block on
  long sequences) and key. `remat=full` keeps only
  each layer's input and recomputes one layer at a time; `dots` keeps the projections' outputs.
  The log-prob head works in `logprob_chunk`-token chunks: never a [B, L, V] array.
  With LoRA (`models/lora.py`) the float32 master, gradient, moments and update are the
  adapters' alone, the frozen base is held once in the compute dtype, and the activations add
  each adapted projection's low-rank intermediate (rows x tokens x rank).
Sampler (one call over `rows` rows): its weight copy in its compute dtype, the float32
  unembedding the decode loop forms once (a copy when tied or not float32), the KV cache
  (2 x layers x rows x kv heads x head_dim x positions) twice (a segment's window grows by
  copying), per-step logits, and the prefill's attention over the prompt; on CPU a float32
  copy of one layer's bfloat16 weights (XLA:CPU's bf16 matmuls run in float32; the decode
  step converts layer by layer, `rollout.decode._upcast_in_loop`).
"""

from __future__ import annotations

import os
from typing import Optional

from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig

GB = 2**30


def nbytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def layer_activations(cfg: ModelConfig, rows: int, length: int) -> int:
    """Bytes one decoder layer keeps for its backward pass without remat."""
    a = nbytes(cfg.dtype)
    d, f, h, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_token = 5 * d * 4 + a * (2 * (h + 2 * k) * hd + h * hd + 4 * f)
    c = cfg.attention_chunk
    queries = c if c and length > c and length % c == 0 else length  # decoder.attention's blocks
    return rows * length * per_token + rows * h * queries * length * (4 + a)


def activations(cfg: ModelConfig, rows: int, length: int) -> int:
    one = layer_activations(cfg, rows, length)
    a, d = nbytes(cfg.dtype), cfg.hidden_size
    if cfg.remat == "full":
        return cfg.num_layers * rows * length * d * 4 + one
    if cfg.remat == "dots":
        hd = cfg.head_dim
        dots = rows * length * a * ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd + 2 * d + 2 * cfg.intermediate_size)
        return cfg.num_layers * dots + one
    return cfg.num_layers * one


def learner(cfg: ModelConfig, rows: int, seq_len: int, minibatches: int = 1, chunk: int = 128) -> dict:
    """Bytes of one learner step, by part (`base`: LoRA's frozen weights, 0 without LoRA)."""
    n, base, low_rank = cfg.num_params, 0, 0
    mb = max(1, rows // minibatches)
    if cfg.lora_rank:
        n, base = lora.num_params(cfg), cfg.num_params * nbytes(cfg.dtype)
        low_rank = cfg.num_layers * len(cfg.lora_targets) * mb * seq_len * cfg.lora_rank * nbytes(cfg.dtype)
    return {"base": base, "params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "update": 4 * n,
            "activations": activations(cfg, mb, seq_len) + mb * seq_len * 4 + low_rank,  # + the causal mask
            "head": 3 * mb * min(chunk, seq_len) * cfg.vocab_size * 4,
            "stats": rows * seq_len * 8}  # every update's log-probs and entropy, for the metric pass


def sampler(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, cache_dtype: str = "float32",
            weights_dtype: Optional[str] = None, platform: Optional[str] = None) -> dict:
    """Bytes of one sampler call over `rows` rows, by part. On CPU, XLA computes bfloat16
    matmuls in float32 from float32 copies of the weights, one layer at a time."""
    import jax

    w = nbytes(weights_dtype or cfg.dtype)
    upcast = 4 * cfg.layer_params if w == 2 and (platform or jax.default_backend()) == "cpu" else 0
    unembed = cfg.hidden_size * cfg.vocab_size * 4
    copies_unembed = cfg.tie_word_embeddings or w != 4
    positions = prompt_len + new_tokens
    cache = 2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * positions * nbytes(cache_dtype)
    return {"weights": cfg.num_params * w, "cpu_f32_layer": upcast, "unembed_f32": unembed if copies_unembed else 0,
            "kv_cache": 2 * cache, "logits": 4 * rows * cfg.vocab_size * 4,
            "prefill": rows * cfg.num_heads * prompt_len * prompt_len * 8 + rows * prompt_len * cfg.hidden_size * 16}


def total(parts: dict) -> int:
    return int(sum(parts.values()))


def available() -> tuple[int, str]:
    """(bytes, what): device memory of the first local accelerator, else the host's available
    RAM (MemAvailable) plus what this process already holds."""
    import jax

    dev = jax.local_devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]), f"{dev.device_kind} memory"
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"] + peak_rss(), "host RAM (MemAvailable + this process)"
    except (OSError, KeyError, ValueError):
        return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host RAM"


def peak_rss() -> int:
    """This process's peak resident set size in bytes (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def describe(parts: dict) -> str:
    return ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items() if v) + f" (total {total(parts) / GB:.2f} GiB)"


# ------------------------------------------------------------------ a run's plan
def estimate(config, task, mcfg, acfg=None, obj=None) -> dict:
    """An experiment config's plan (`experiment.build` logs it and checks it with `check_run`).
    Bytes this process will hold, by part: the learner's step (and the
    auxiliary model's, and a reference copy for a KL penalty), the weight store's sampler
    copies in the sampler's dtype, and each sampler's KV cache and decode buffers. `obj`: the
    resolved objective config (resolved here from `config.objective` when not given)."""
    from jaxrl_llm import objectives

    r, s = config.runtime, config.sampler
    g, new = s.num_samples, s.max_new_tokens or task.max_answer_len
    prompt = getattr(task, "max_prompt_len", task.prompt_buckets[-1])
    rows = r.prompts_per_batch * g
    mb, chunk = config.learner.num_minibatches, config.learner.logprob_chunk
    plan = {f"learner_{k}": v for k, v in learner(mcfg, rows, prompt + new, mb, chunk).items()}
    if acfg is not None:
        plan.update({f"aux_{k}": v for k, v in learner(acfg, rows, prompt + new, mb, chunk).items()})
    obj = obj if obj is not None else objectives.make_config(config.objective)
    if "ref_logp" in objectives.required_passes(obj):  # LoRA: the adapters, disabled
        plan["reference"] = 4 * (lora.num_params(mcfg) if mcfg.lora_rank else mcfg.num_params)
    aux = objectives.get(obj.name).aux
    rollout = acfg if acfg is not None and aux is not None and aux.samples else mcfg.without_lora()
    # Sampler weight copies: simulated keeps a window of versions; async samples from one while
    # the learner publishes the next; the others hand over between steps.
    keep = r.max_staleness + 1 if r.mode == "simulated" else 2 if r.mode == "async" else 1
    sampler_rows = (s.slots or rows) + rows if s.batching == "continuous" else rows  # slots + prefilled pool
    samplers = r.num_samplers if r.mode == "async" else 1
    cache = s.cache_dtype if s.cache_dtype != "auto" else config.model.dtype
    one = sampler(rollout, sampler_rows, prompt, new, cache, rollout.dtype)
    plan["sampler_weights"] = keep * one.pop("weights")
    plan.update({f"sampler_{k}": samplers * v for k, v in one.items()})
    return plan


def check_run(config, task, mcfg, acfg, plan) -> None:
    """Refuse, before anything is built, a plan beyond the memory available, naming the
    settings that would make it fit (each tried alone)."""
    import ml_collections

    from jaxrl_llm import objectives

    need, (have, what) = total(plan), available()
    if need <= have or not config.train.check_memory:
        return
    tries = [("model.remat", "full"), ("model.dtype", "bfloat16"), ("sampler.cache_dtype", "bfloat16"),
             ("learner.num_minibatches", config.learner.num_minibatches * 2),
             ("runtime.prompts_per_batch", max(1, config.runtime.prompts_per_batch // 2))]
    fits = []
    for key, value in tries:
        section, field = key.split(".")
        if config[section][field] == value:
            continue
        c = ml_collections.ConfigDict(config.to_dict())
        c[section][field] = value
        m = mcfg.replace(remat=c.model.remat, dtype=c.model.dtype)
        a = acfg and acfg.replace(dtype=c.model.dtype)
        other = total(estimate(c, task, m, a, objectives.make_config(c.objective)))
        fits.append(f"--config.{key}={value} ({other / GB:.1f} GiB{'' if other <= have else ', still too much'})")
    raise MemoryError(f"the memory plan needs {need / GB:.1f} GiB but {what} offers {have / GB:.1f} GiB: "
                      f"{describe(plan)}. Try: {'; '.join(fits) or 'a smaller model or batch'} "
                      "(or --config.train.check_memory=False to run anyway)")
