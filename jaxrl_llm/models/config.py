"""Decoder configuration shared by Qwen2, Qwen3 and Llama (frozen: usable as a jit static)."""

from __future__ import annotations

import dataclasses
from typing import Optional

SUPPORTED = ("qwen2", "qwen3", "llama")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "dot_product_attention", "einsum")


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
    # Llama-3 frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    rope_llama3: Optional[tuple] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias=True)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls; log-prob heads are always float32
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # Attention kernel (decoder.attention): jax.nn.dot_product_attention (cuDNN flash attention
    # where the platform offers it), our head-major einsums (fastest on CPU), or auto: the
    # einsums on CPU, dot_product_attention elsewhere.
    attention: str = "auto"

    def __post_init__(self):
        if self.model_type not in SUPPORTED:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED)}")
        for f in ("param_dtype", "dtype"):
            if getattr(self, f) not in DTYPES:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}; valid: {', '.join(DTYPES)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"ModelConfig.attention={self.attention!r}; valid: {', '.join(ATTENTION)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def num_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + d

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "ModelConfig":
        """From a transformers config.json dict (v4 `rope_theta/rope_scaling` or v5 `rope_parameters`)."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED:
            archs = hf.get("architectures")
            raise ValueError(
                f"unsupported architecture model_type={arch!r} ({archs}); supported: {', '.join(SUPPORTED)}"
            )
        rope = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        rope.update({k: v for k, v in scaling.items() if k not in rope})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3 = None
        if rope_type == "llama3":
            llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            model_type=arch,
            rope_theta=float(theta),
            rope_llama3=llama3,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; supported: silu")
        kw.update(overrides)
        return cls(**kw)

    def to_hf(self) -> dict:
        """A config.json dict that transformers loads (v4-style rope keys, read by v4 and v5)."""
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
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
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3:
            f, lo, hi, orig = self.rope_llama3
            rope.update(rope_type="llama3", factor=f, low_freq_factor=lo, high_freq_factor=hi,
                        original_max_position_embeddings=orig)
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_parameters"] = rope
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out
