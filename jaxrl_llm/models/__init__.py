"""Flax decoder (Qwen2 / Qwen3 / Llama), HF safetensors in/out, float32 log-prob heads.

It imports only `validation` from this package: every layer above builds on it."""

from jaxrl_llm.models import lora  # noqa: F401
from jaxrl_llm.models.config import ModelConfig  # noqa: F401
from jaxrl_llm.models.decoder import init_params, logical_axes, unembed_matrix  # noqa: F401
from jaxrl_llm.models.heads import full_logits, logprob_stats, sequence_logprobs  # noqa: F401
from jaxrl_llm.models.hf import check_weights, load_config, load_params, load_tokenizer, save_params  # noqa: F401
