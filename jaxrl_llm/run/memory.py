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
  A mixture of experts' layer holds, per token, its k experts' four intermediates, the router's
  float32 logits and probabilities, and the dispatched rows in and out; with `expert` = X > 1
  each device runs the tokens of its X-device group (`experts.on_devices`), in buffers sized for
  the case where all of them pick its experts (dropless, static shapes): X times those; an
  all-to-all exchange (`exchange.py`) adds its rows out and back, min(k, X) per token each.
  With LoRA (`models/lora.py`) the float32 master, gradient, moments and update are the
  adapters' alone (replicated; stacked experts' split as the experts' dims), the frozen base is
  held once in the compute dtype, and the activations add each adapted projection's low-rank
  intermediate (rows x tokens x rank, k times on a mixture of experts' experts).
Sampler (one call over `rows` rows): its weight copy in its compute dtype, the float32
  unembedding the decode loop forms once (a copy when tied or not float32), the KV cache
  (2 x layers x rows x kv heads x head_dim x positions) twice (continuous batching copies a
  segment's window out and back), per-step logits, and the prefill's attention over the
  prompt; on CPU a float32 copy of one layer's bfloat16 weights (XLA:CPU's bf16 matmuls run
  in float32; the decode step converts layer by layer, `rollout.decode._upcast_in_loop`).

Every figure is per device (`Layout`): the learner's parameters, gradients and moments divide
over fsdp x tensor (stacked experts also over expert), its rows over data x fsdp x expert, its
heads / MLP / vocabulary over tensor; each
sampler device holds a whole weight copy (a mixture's experts split over the sampler devices:
`sampler.expert_parallel`) and its share of the rows. An accelerator compares
the busiest device with the smallest `bytes_limit` (which XLA_PYTHON_CLIENT_MEM_FRACTION
sets); a CPU host holds every device's share in one RAM (replicated sampler weights once,
`sharding.put`). The extra passes (prox, ref) run minibatch by minibatch in their own program
before the step (`forward.batch_stats`), each below the step's own forward: they add nothing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from jaxrl_llm.models import attention as attn, experts, lora
from jaxrl_llm.models.config import ModelConfig

GB = 2**30


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run's parts live: the learner's mesh sizes, the devices its samplers split rows
    over, whether those are the learner's own (`runtime.sampler_devices=0`) and the platform."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    samplers: int = 1
    sampler_tensor: int = 1  # sampler.tensor: devices per tensor-parallel sampler group
    shared: bool = True
    local: int = 1  # the learner's devices in this process (a CPU host's RAM holds their shares)
    platform: Optional[str] = None  # None: JAX's default backend

    @property
    def learner_devices(self) -> int:
        return self.data * self.fsdp * self.expert * self.tensor

    @property
    def rows(self) -> int:
        """How many ways the learner's rows split (the batch axes)."""
        return self.data * self.fsdp * self.expert

    @property
    def on_cpu(self) -> bool:
        import jax

        return (self.platform or jax.default_backend()) == "cpu"

    @classmethod
    def of(cls, mesh, sampler_devices, shared: bool, sampler_tensor: int = 1) -> "Layout":
        """From the learner's mesh (`sharding.make_mesh`) and the samplers' devices."""
        import jax

        local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        sizes = {a: mesh.shape.get(a, 1) for a in ("data", "fsdp", "expert", "tensor")}
        return cls(**sizes, samplers=max(1, len(sampler_devices)), sampler_tensor=sampler_tensor, shared=shared,
                   local=max(1, local),
                   platform=mesh.devices.flat[0].platform)


def nbytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _mlp_width(cfg: ModelConfig, layer: int, tensor: int, expert: int) -> int:
    """Per token on one device, the width of layer `layer`'s MLP intermediates (a mixture of
    experts: its k experts' for each of the `expert` devices whose tokens it runs, and the
    shared expert's)."""
    if not cfg.sparse(layer):
        return -(-cfg.intermediate_size // tensor)
    return (expert * cfg.num_experts_per_tok * -(-cfg.moe_intermediate_size // tensor)
            + -(-cfg.shared_expert_intermediate_size // tensor))


def layer_activations(cfg: ModelConfig, rows: int, length: int, tensor: int = 1, layer: int = 0,
                      expert: int = 1) -> int:
    """Bytes decoder layer `layer` keeps for its backward pass without remat (heads and the MLP
    split over `tensor` devices; the residual stream is whole on each)."""
    a = nbytes(cfg.dtype)
    d, hd = cfg.hidden_size, cfg.head_dim
    h, k = (-(-x // tensor) for x in (cfg.num_heads, cfg.num_kv_heads))
    per_token = 5 * d * 4 + a * (2 * (h + 2 * k) * hd + h * hd + 4 * _mlp_width(cfg, layer, tensor, expert))
    if cfg.sparse(layer):  # router logits and probabilities; each chosen pair's rows in and out
        per_token += 8 * cfg.num_experts + 2 * a * d * expert * cfg.num_experts_per_tok
        if expert > 1 and cfg.moe_exchange == "all_to_all":
            per_token += 2 * a * d * min(cfg.num_experts_per_tok, expert)
    c, kernel = cfg.attention_chunk, attn.kernel(cfg)
    # models.attention's [queries, keys] scores: one block when chunked, none held by the flash
    # kernels (cuDNN's, splash)
    queries = 0 if kernel in ("cudnn", "splash") else c if kernel == "chunked" and c and length > c else length
    return rows * length * per_token + rows * h * queries * length * (4 + a)


def activations(cfg: ModelConfig, rows: int, length: int, tensor: int = 1, expert: int = 1) -> int:
    each = [layer_activations(cfg, rows, length, tensor, i, expert) for i in range(cfg.num_layers)]
    a, d = nbytes(cfg.dtype), cfg.hidden_size
    if cfg.remat == "full":
        return cfg.num_layers * rows * length * d * 4 + max(each)
    if cfg.remat == "dots":
        attn_dots = -(-(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tensor) + 2 * d
        dots = sum(rows * length * a * (attn_dots + 2 * _mlp_width(cfg, i, tensor, expert))
                   for i in range(cfg.num_layers))
        return dots + max(each)
    return sum(each)


def held_adapters(cfg: ModelConfig, layout: Layout) -> int:
    """How many LoRA adapter parameters one learner device holds (`learner._resolve`): the
    replicated ones, and those on stacked experts split as the experts' dims they follow
    (`lora.expert_side`: over expert, and fsdp on D or tensor on the MLP width)."""
    r, e, d, f = cfg.lora_rank, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    sparse = sum(cfg.sparse(i) for i in range(cfg.num_layers))
    gate, down = "gate" in cfg.lora_targets, "down" in cfg.lora_targets
    embed, mlp = sparse * e * r * d * (gate + down), sparse * e * r * f * (2 * gate + down)
    return lora.num_params(cfg) - lora.expert_params(cfg) + -(-embed // (layout.expert * layout.fsdp)) + \
        -(-mlp // (layout.expert * layout.tensor))


def _low_rank(cfg: ModelConfig, tokens: int) -> int:
    """Elements of the adapted projections' low-rank intermediates over `tokens` tokens."""
    def per(i, t):  # a mixture of experts adapts its experts' MLPs only, k per token
        return 1 if t not in lora.EXPERT_MLP or not cfg.num_experts else cfg.num_experts_per_tok * cfg.sparse(i)
    return sum(per(i, t) for i in range(cfg.num_layers) for t in cfg.lora_targets) * tokens * cfg.lora_rank


def held_params(cfg: ModelConfig, layout: Layout) -> int:
    """How many of the model's parameters one learner device holds: all of them split over
    fsdp x tensor, a mixture of experts' stacked experts also over expert."""
    shards, stacked = layout.fsdp * layout.tensor, cfg.expert_params
    return -(-(cfg.num_params - stacked) // shards) + -(-stacked // (shards * layout.expert))


def learner(cfg: ModelConfig, rows: int, seq_len: int, minibatches: int = 1, chunk: int = 128,
            layout: Layout = Layout()) -> dict:
    """Bytes of one learner step on one of its devices, by part (`base`: LoRA's frozen weights,
    0 without LoRA)."""
    batch = layout.rows
    mb = -(-max(1, rows // minibatches) // batch)  # one minibatch's rows on this device
    n, base, low_rank = held_params(cfg, layout), 0, 0
    if cfg.lora_rank:
        n, base = held_adapters(cfg, layout), n * nbytes(cfg.dtype)
        low_rank = _low_rank(cfg, mb * seq_len) * nbytes(cfg.dtype)
    return {"base": base, "params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "update": 4 * n,
            "activations": activations(cfg, mb, seq_len, layout.tensor, layout.expert)
            + mb * seq_len * 4 + low_rank,  # + the mask
            "head": 3 * mb * min(chunk, seq_len) * -(-cfg.vocab_size // layout.tensor) * 4,
            "stats": -(-rows // batch) * seq_len * 8}  # every update's log-probs and entropy, for the metric pass


def sampler(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, cache_dtype: str = "float32",
            weights_dtype: Optional[str] = None, platform: Optional[str] = None, split_experts: int = 1,
            tensor: int = 1) -> dict:
    """Bytes of one sampler device over its `rows` rows, by part. On CPU, XLA computes bfloat16
    matmuls in float32 from float32 copies of the weights, one layer at a time. `split_experts`
    > 1: a mixture's stacked experts split over that many sampler devices (`Sampler.splits_experts`),
    their share as `experts` beside the other `weights`. `tensor` > 1 (`sampler.tensor`,
    `rollout/devices.py`): the weights (stacked experts along their width), the KV cache, the
    logits and the attention scores split that many ways (norms too, which are whole: a few kB)."""
    import jax

    w = nbytes(weights_dtype or cfg.dtype)
    upcast = 4 * cfg.layer_params if w == 2 and (platform or jax.default_backend()) == "cpu" else 0
    unembed = cfg.hidden_size * cfg.vocab_size * 4
    copies_unembed = cfg.tie_word_embeddings or w != 4
    positions = prompt_len + new_tokens
    kv = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
    cache = 2 * cfg.num_layers * rows * kv * cfg.head_dim * positions * nbytes(cache_dtype)
    split = cfg.expert_params if split_experts > 1 else 0
    width = tensor if cfg.moe_intermediate_size % tensor == 0 else 1  # stacked experts' width over tensor
    per = lambda x: -(-x // tensor)  # noqa: E731
    parts = {"weights": (per(cfg.num_params - cfg.expert_params) + (cfg.expert_params - split) // width) * w,
             "cpu_f32_layer": per(upcast),
             "unembed_f32": per(unembed) if copies_unembed else 0, "kv_cache": 2 * cache,
             "logits": per(4 * rows * cfg.vocab_size * 4),
             "prefill": rows * per(cfg.num_heads) * prompt_len * prompt_len * 8
             + rows * prompt_len * cfg.hidden_size * 16}
    return {**parts, "experts": -(-split // (split_experts * width)) * w} if split else parts


def total(parts: dict) -> int:
    return int(sum(parts.values()))


def need(plan: dict, layout: Layout) -> int:
    """What `plan` (bytes per device, by part) asks of the memory `available` measures: on an
    accelerator its busiest device (learner and sampler parts together when they share
    devices), on a CPU host every device's share, replicated sampler weights counted once."""
    sampler = sum(v for k, v in plan.items() if k.startswith("sampler_"))
    learner = total(plan) - sampler
    if not layout.on_cpu:
        return learner + sampler if layout.shared else max(learner, sampler)
    weights = plan.get("sampler_weights", 0)  # one device's share: `sampler_tensor` shares make the whole
    return learner * layout.local + weights * layout.sampler_tensor + (sampler - weights) * layout.samplers


def available() -> tuple[int, str]:
    """(bytes, what): one accelerator's memory (the smallest `bytes_limit` of this process's
    devices: the budget of each), else the host's available RAM (MemAvailable) plus what this
    process already holds."""
    import jax

    devs = [d for d in jax.local_devices() if d.platform != "cpu"]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devs]
    if devs and all(limits):
        return int(min(limits)), f"each {devs[0].device_kind}'s memory"
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
def estimate(config, task, mcfg, acfg=None, obj=None, layout: Layout = Layout()) -> dict:
    """An experiment config's plan (`experiment.build` logs it and checks it with `check_run`).
    Bytes each device will hold (`layout`), by part: the learner's step (and the
    auxiliary model's, and a reference copy for a KL penalty), the weight store's sampler
    copies in the sampler's dtype, and each sampler's KV cache and decode buffers. `obj`: the
    resolved objective config (resolved here from `config.objective` when not given)."""
    from jaxrl_llm import objectives

    r, s = config.runtime, config.sampler
    g, new = s.num_samples, s.max_new_tokens or task.max_answer_len
    prompt = getattr(task, "max_prompt_len", task.prompt_buckets[-1])
    rows = r.prompts_per_batch * g
    mb, chunk = config.learner.num_minibatches, config.learner.logprob_chunk
    plan = {f"learner_{k}": v for k, v in learner(mcfg, rows, prompt + new, mb, chunk, layout).items()}
    if acfg is not None:
        plan.update({f"aux_{k}": v for k, v in learner(acfg, rows, prompt + new, mb, chunk, layout).items()})
    obj = obj if obj is not None else objectives.make_config(config.objective)
    if "ref_logp" in objectives.required_passes(obj):  # LoRA: the adapters, disabled
        plan["reference"] = 4 * (held_adapters(mcfg, layout) if mcfg.lora_rank else held_params(mcfg, layout))
    aux = objectives.get(obj.name).aux
    rollout = acfg if acfg is not None and aux is not None and aux.samples else mcfg.without_lora()
    # Sampler weight copies: simulated keeps a window of versions; async samples from one while
    # the learner publishes the next; the others hand over between steps.
    keep = r.max_staleness + 1 if r.mode == "simulated" else 2 if r.mode == "async" else 1
    # Continuous: the slots, plus the rows outside them (prefilled and waiting, or parked on a
    # multi-turn environment with their whole cache: at most `rows` of either, each planned whole).
    sampler_rows = (s.slots or rows) + rows if s.batching == "continuous" else rows
    samplers = r.num_samplers if r.mode == "async" else 1
    cache = s.cache_dtype if s.cache_dtype != "auto" else mcfg.dtype  # the resolved compute dtype
    t = s.get("tensor", 1)
    groups = max(1, layout.samplers // t)  # the devices the rows split over
    split = groups if experts.splits(rollout.num_experts, groups, s.expert_parallel) else 1
    one = sampler(rollout, -(-sampler_rows // groups), prompt, new, cache, rollout.dtype, layout.platform, split, t)
    plan["sampler_weights"] = keep * one.pop("weights")
    if "experts" in one:  # each device's share of the experts (its own, counted per device on a CPU host too)
        plan["sampler_experts"] = keep * one.pop("experts")
    plan.update({f"sampler_{k}": samplers * v for k, v in one.items()})
    return plan


def check_run(config, task, mcfg, acfg, plan, layout: Layout = Layout()) -> None:
    """Refuse, before anything is built, a plan beyond the memory available, naming the
    settings that would make it fit (each tried alone)."""
    import ml_collections

    from jaxrl_llm import objectives

    need_, (have, what) = need(plan, layout), available()
    if need_ <= have or not config.train.check_memory:
        return
    tries = [("model.remat", "full"), ("model.dtype", "bfloat16"), ("sampler.cache_dtype", "bfloat16"),
             ("learner.num_minibatches", config.learner.num_minibatches * 2),
             ("runtime.prompts_per_batch", max(1, config.runtime.prompts_per_batch // 2))]
    if layout.learner_devices > 1 and layout.fsdp * layout.tensor * layout.expert == 1:  # ZeRO-3 over every device
        tries.append(("mesh.fsdp", layout.learner_devices))
    fits = []
    for key, value in tries:
        section, field = key.split(".")
        if config[section][field] == value:
            continue
        c = ml_collections.ConfigDict(config.to_dict())
        c[section][field] = value
        if key == "mesh.fsdp":
            c.mesh.data = 1
        lay = dataclasses.replace(layout, data=c.mesh.data, fsdp=c.mesh.fsdp) if key == "mesh.fsdp" else layout
        m = mcfg.replace(remat=c.model.remat, dtype=c.model.dtype)
        a = acfg and acfg.replace(dtype=c.model.dtype)
        other = need(estimate(c, task, m, a, objectives.make_config(c.objective), lay), lay)
        shown = f"--config.mesh.data=1 --config.{key}={value}" if key == "mesh.fsdp" else f"--config.{key}={value}"
        fits.append(f"{shown} ({other / GB:.1f} GiB{'' if other <= have else ', still too much'})")
    per = "" if layout.on_cpu else " per device"
    raise MemoryError(f"the memory plan needs {need_ / GB:.1f} GiB{per} but {what} offers {have / GB:.1f} GiB: "
                      f"{describe(plan)}{per}. Try: {'; '.join(fits) or 'a smaller model or batch'} "
                      "(or --config.train.check_memory=False to run anyway)")
