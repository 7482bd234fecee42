"""Decoder configuration shared by Qwen2, Qwen3, Llama and the Qwen2-MoE / Qwen3-MoE mixtures of
experts (frozen: usable as a jit static)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from jaxrl_llm import validation as V

SUPPORTED = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe")
MOE = ("qwen2_moe", "qwen3_moe")
DISPATCH = ("auto", "dense", "grouped", "blocked")  # `moe.py`
EXCHANGES = ("gather", "all_to_all")  # `exchange.py`
DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "xla", "cudnn", "splash", "chunked", "einsum", "dot_product_attention")  # the last: xla's old name
# Rematerialisation of decoder layers under grad (`decoder.Decoder`): none keeps every
# activation; full keeps each layer's input only and recomputes the layer in the backward pass;
# dots keeps the matmul outputs without batch dims (the projections), recomputing the rest.
REMAT = ("none", "full", "dots")
# XLA's precision for float32 matmuls (jax_default_matmul_precision): default is TF32 on an H100
# and one bf16 pass on a TPU, highest full float32 everywhere; CPUs compute float32 in any case.
PRECISIONS = ("default", "high", "highest")
# RoPE scaling types and the parameters each reads (transformers' modeling_rope_utils names).
ROPE_TYPES = {
    "default": {},
    "linear": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None,
               "original_max_position_embeddings": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "attention_factor": None, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None, "truncate": True},
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "qwen2"
    rope_theta: float = 10000.0
    # RoPE frequency scaling (`decoder.rope_inv_freq`): one of ROPE_TYPES, with its parameters
    # as sorted (name, value) pairs (hashable: the config is a jit static).
    rope_type: str = "default"
    rope_params: tuple = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama / Qwen3 with attention_bias=True)
    o_bias: bool = False  # Llama / Qwen3 attention_bias=True: the output projection too
    mlp_bias: bool = False  # Llama mlp_bias=True: gate, up and down projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls; log-prob heads are always float32
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # Attention kernel (`attention.kernel`): xla | cudnn (jax.nn.dot_product_attention with that
    # implementation), splash (Pallas' flash kernel for TPU), chunked (head-major einsums in blocks
    # of `attention_chunk` queries), einsum (one block), or auto: cudnn on GPU in 16-bit compute,
    # else xla there; splash on TPU; chunked on CPU.
    attention: str = "auto"
    remat: str = "none"
    matmul_precision: str = "default"  # PRECISIONS; the run applies it process-wide (sampler and learner alike)
    attention_chunk: int = 512  # chunked: queries per attention block (0: one block)
    # LoRA (`lora.py`): rank > 0 adds a low-rank side path, scaled by alpha / rank, to each
    # projection named in `lora_targets` (q, k, v, o, gate, up, down; on a mixture of experts
    # gate, up and down adapt its stacked experts only).
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple = ()
    # Mixture of experts (`moe.py`; 0 experts: dense). Layer i is sparse unless listed in
    # `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0, as transformers builds them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (sigmoid-gated)
    router_aux_loss_coef: float = 0.0  # the checkpoint's (exported as read)
    moe_aux_loss_coef: float = 0.0  # what the learner adds: coef x the load-balancing loss (0: off)
    moe_dispatch: str = "auto"
    moe_exchange: str = "gather"  # how expert parallelism moves tokens (`exchange.py`)
    # recompute: the learner's routers choose experts; replay: the experts the sampler recorded
    # (`TrajectoryBatch.routing`), gate weights from the learner's router (R3, arXiv:2510.11370)
    moe_routing: str = "recompute"
    router_dtype: str = "float32"  # the routers' matmul; the samplers' is `sampler_router_dtype` (`for_sampling`)
    sampler_router_dtype: str = "float32"

    def __post_init__(self):
        if self.model_type not in SUPPORTED:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED)}")
        for f in ("param_dtype", "dtype", "router_dtype", "sampler_router_dtype"):
            if getattr(self, f) not in DTYPES:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}; valid: {', '.join(DTYPES)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"ModelConfig.attention={self.attention!r}; valid: {', '.join(ATTENTION)}")
        if self.matmul_precision not in PRECISIONS:
            raise ValueError(f"ModelConfig.matmul_precision={self.matmul_precision!r}; valid: {', '.join(PRECISIONS)}")
        if self.remat not in REMAT:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; valid: {', '.join(REMAT)}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                             f"{self.num_experts}")
        if self.moe_routing not in ("recompute", "replay"):
            raise ValueError(f"ModelConfig.moe_routing={self.moe_routing!r}; valid: recompute, replay")
        if self.moe_dispatch not in DISPATCH:
            raise ValueError(f"ModelConfig.moe_dispatch={self.moe_dispatch!r}; valid: {', '.join(DISPATCH)}")
        if self.moe_exchange not in EXCHANGES:
            raise ValueError(f"ModelConfig.moe_exchange={self.moe_exchange!r}; valid: {', '.join(EXCHANGES)}")
        if self.num_experts and self.lora_rank and ("gate" in self.lora_targets) != ("up" in self.lora_targets):
            raise ValueError("model.lora.targets: a mixture of experts' gate and up projections are one weight "
                             "(transformers' experts.gate_up_proj, one PEFT adapter): target both or neither")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def adapts(self, target: str) -> bool:
        return self.lora_rank > 0 and target in self.lora_targets

    def without_lora(self) -> "ModelConfig":
        """The base model (what the samplers run on merged weights, what HF checkpoints hold)."""
        return dataclasses.replace(self, lora_rank=0, lora_alpha=0.0, lora_targets=())

    def for_sampling(self) -> "ModelConfig":
        """What the samplers run: the base model, its routers' matmul in `sampler_router_dtype`
        (a research knob: perturbed sampler numerics, as a bf16 inference engine's)."""
        return dataclasses.replace(self.without_lora(), router_dtype=self.sampler_router_dtype)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """`dataclasses.asdict(cfg)` after a JSON round trip: its lists (e.g. `rope_params`'
        pairs) back to the tuples a hashable config needs."""
        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, list) else v

        return cls(**{k: tup(v) for k, v in d.items()})

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def rope(self) -> dict:
        return dict(self.rope_params)

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def _mlp_params(self, layer: int, active: bool = False) -> int:
        d = self.hidden_size
        if not self.sparse(layer):
            f = self.intermediate_size
            return 3 * d * f + self.mlp_bias * (2 * f + d)
        s = self.shared_expert_intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return d * self.num_experts + experts * 3 * d * self.moe_intermediate_size + (3 * d * s + d if s else 0)

    def _attn_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += self.qkv_bias * hd * (self.num_heads + 2 * self.num_kv_heads) + self.o_bias * d
        return attn + 2 * d + self.qk_norm * 2 * hd

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (a dense model's layers are all alike)."""
        return self._attn_params() + max(self._mlp_params(i) for i in range(max(self.num_layers, 1)))

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return sum(self._attn_params() + self._mlp_params(i) for i in range(self.num_layers)) + embed + self.hidden_size

    @property
    def expert_params(self) -> int:
        """The stacked experts' parameters (what the `expert` mesh axis splits)."""
        sparse = sum(self.sparse(i) for i in range(self.num_layers))
        return sparse * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def active_params(self) -> int:
        """Parameters a token passes through (a mixture of experts': its k experts per layer)."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return (sum(self._attn_params() + self._mlp_params(i, active=True) for i in range(self.num_layers))
                + embed + self.hidden_size)

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "ModelConfig":
        """From a transformers config.json dict (v4 `rope_theta/rope_scaling` or v5 `rope_parameters`)."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED:
            archs = hf.get("architectures")
            raise ValueError(
                f"unsupported architecture model_type={arch!r} ({archs}); supported: {', '.join(SUPPORTED)}"
            )
        rope_type, rope_params, theta = _rope_from_hf(hf)
        _refuse_unsupported(hf)
        f = functools.partial(_read, {**hf, "rope_theta": theta})  # (theta from whichever rope section holds it)
        heads, size = f("num_attention_heads", V.integer(1)), f("hidden_size", V.integer(1))
        kw = dict(
            vocab_size=f("vocab_size", V.integer(1)),
            hidden_size=size,
            intermediate_size=f("intermediate_size", V.integer(1)),
            num_layers=f("num_hidden_layers", V.integer(1)),
            num_heads=heads,
            num_kv_heads=f("num_key_value_heads", V.integer(1), heads),
            head_dim=f("head_dim", V.integer(1), size // heads),
            model_type=arch,
            rope_theta=float(f("rope_theta", V.positive(), 10000.0)),
            rope_type=rope_type,
            rope_params=rope_params,
            rms_norm_eps=float(f("rms_norm_eps", V.positive(), 1e-6)),
            tie_word_embeddings=f("tie_word_embeddings", V.boolean(), False),
            qkv_bias=(True if arch == "qwen2" else f("qkv_bias", V.boolean(), True) if arch == "qwen2_moe"
                      else f("attention_bias", V.boolean(), False)),
            o_bias=arch not in ("qwen2", "qwen2_moe") and f("attention_bias", V.boolean(), False),
            mlp_bias=arch == "llama" and f("mlp_bias", V.boolean(), False),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position_embeddings=f("max_position_embeddings", V.integer(1), 32768),
            bos_token_id=_first(f("bos_token_id", _TOKENS, None)),
            eos_token_id=_first(f("eos_token_id", _TOKENS, None)),
        )
        if arch in MOE:
            kw.update(num_experts=f("num_experts", V.integer(1), 0) or f("num_local_experts", V.integer(1)),  # v5
                      num_experts_per_tok=f("num_experts_per_tok", V.integer(1)),
                      moe_intermediate_size=f("moe_intermediate_size", V.integer(1)),
                      norm_topk_prob=f("norm_topk_prob", V.boolean(), False),
                      decoder_sparse_step=f("decoder_sparse_step", V.integer(1), 1),
                      mlp_only_layers=tuple(f("mlp_only_layers", _LAYERS, ())),
                      shared_expert_intermediate_size=f("shared_expert_intermediate_size", V.integer(0), 0)
                      if arch == "qwen2_moe" else 0,
                      router_aux_loss_coef=float(f("router_aux_loss_coef", V.non_negative(), 0.0)))
        kw.update(overrides)
        return cls(**kw)

    def to_hf(self) -> dict:
        """A config.json dict that transformers loads (v4-style rope keys, read by v4 and v5)."""
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
        out = dict(
            architectures=[arch[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            torch_dtype=self.param_dtype,
            rope_theta=self.rope_theta,
        )
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **self.rope}
        if self.rope_type != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_parameters"] = rope
        if self.model_type == "qwen2_moe":
            out["qkv_bias"] = self.qkv_bias
        elif self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.model_type in MOE:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=self.router_aux_loss_coef)
            if self.model_type == "qwen2_moe":
                out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out


# A checkpoint's config.json is a file users point at: each field `from_hf` reads is checked for
# its JSON type and range (a string "false" is a true flag to Python, a float width reaches the
# shapes, a sparse step of 0 divides by zero later), by the rules config sections use.
_REQUIRED = object()
_LAYERS = V.Rule("a list of integers >= 0", lambda x: isinstance(x, list) and all(map(V.integer(0).ok, x)))
_TOKENS = V.Rule("a token id >= 0 or a non-empty list of them",
                 lambda x: V.integer(0).ok(x) or (isinstance(x, list) and x and all(map(V.integer(0).ok, x))))


def _read(hf: dict, key: str, rule: V.Rule, default=_REQUIRED):
    """`hf[key]` if `rule` allows it (else refused naming the key); missing or null: `default`."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{key} is missing")
        return default
    problem = rule.problem(key, value)
    if problem:
        raise ValueError(problem)
    return value


def _first(ids):
    """A token id, or the first of a list of them (`eos_token_id` may list several)."""
    return ids[0] if isinstance(ids, list) else ids


def _rope_from_hf(hf: dict):
    """(rope_type, sorted parameter pairs, theta) from v4 `rope_theta`/`rope_scaling` or v5
    `rope_parameters`; an unsupported type or an unknown parameter of a supported one is refused."""
    rope = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    rope.update({k: v for k, v in scaling.items() if k not in rope})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if float(rope.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    known = ROPE_TYPES[rope_type]
    unknown = sorted(set(rope) - set(known))
    if unknown:
        raise ValueError(f"rope_scaling type {rope_type!r}: unsupported parameter(s) {', '.join(unknown)}; "
                         f"supported: {', '.join(known) or 'none'}")
    if rope_type == "yarn" and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = hf.get("max_position_embeddings")  # as transformers does
    params = {k: v for k, v in {**known, **{k: v for k, v in rope.items() if v is not None}}.items()
              if v is not None}
    missing = sorted(set(k for k, v in known.items() if v is None and k not in ("attention_factor", "mscale",
                                                                                "mscale_all_dim")) - set(params))
    if missing:
        raise ValueError(f"rope_scaling type {rope_type!r} needs {', '.join(missing)}")
    return rope_type, tuple(sorted(params.items())), theta


# Config keys that change the math, with the value under which they do not: anything else is
# refused at load, by name, rather than loaded with wrong logits.
_NEUTRAL = {
    "hidden_act": ("silu",),
    "use_sliding_window": (False, None),
    "attention_dropout": (0, 0.0, None),
    "mlp_dropout": (0, 0.0, None),
    "partial_rotary_factor": (1, 1.0, None),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
}


def _refuse_unsupported(hf: dict) -> None:
    bad = [f"{k}={hf[k]!r} (supported: {', '.join(map(repr, ok))})" for k, ok in _NEUTRAL.items()
           if k in hf and hf[k] not in ok]
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if sliding:
        bad.append(f"layer_types with {sorted(set(sliding))} (only full_attention is supported)")
    if bad:
        raise ValueError("unsupported checkpoint option(s): " + "; ".join(bad))
