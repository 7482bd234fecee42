"""Tiny random Hugging Face models built and saved locally (no downloads)."""

from __future__ import annotations

import torch
import transformers

from jaxrl_llm.testing import make_tokenizer  # noqa: F401  (shared with experiments/bench_scale.py)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # Qwen2.5's long context

ARCHS = {
    # Qwen2: q/k/v bias, tied embeddings, GQA 4:2
    "qwen2_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    # Qwen2.5 with YaRN (positions past 16 are interpolated; sin/cos scaled), untied
    "qwen2_yarn": (transformers.Qwen2Config, dict(rope_scaling=YARN_ROPE, tie_word_embeddings=False)),
    # Qwen3: q/k RMSNorm, explicit head_dim != hidden/heads, attention biases (q, k, v and o),
    # linear RoPE scaling, untied, GQA 8:2
    "qwen3": (transformers.Qwen3Config, dict(head_dim=12, num_attention_heads=8, tie_word_embeddings=False,
                                             attention_bias=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Llama-3 rope scaling (positions past 16 exercise every band), attention and MLP biases,
    # untied, GQA 4:1
    "llama3": (transformers.LlamaConfig, dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, num_key_value_heads=1,
                                              tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
}


def make_hf_model(arch: str, vocab: int = 101, seed: int = 0, **overrides):
    """A random model whose every parameter (biases and norm scales included) is non-trivial."""
    cls, kw = ARCHS[arch]
    base = dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    base.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**base)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def save(model, path: str, **kw) -> str:
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def hf_logits(model, tokens, attention_mask=None):
    with torch.no_grad():
        t = torch.as_tensor(tokens, dtype=torch.long)
        kw = {}
        if attention_mask is not None:
            m = torch.as_tensor(attention_mask, dtype=torch.long)
            kw = dict(attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0))
        return model(t, **kw).logits.float().numpy()

