"""Flax decoder (Qwen2 / Qwen3 / Llama and their mixtures of experts), HF safetensors in/out,
float32 log-prob heads.

It imports only `validation` and `parallel` (the mesh's axis names) from this package: every layer
above builds on it."""

from jaxrl_llm.models import lora, moe  # noqa: F401
from jaxrl_llm.models.config import ModelConfig  # noqa: F401
from jaxrl_llm.models.decoder import init_params, logical_axes, unembed_matrix  # noqa: F401
from jaxrl_llm.models.heads import full_logits, logprob_stats, sequence_logprobs  # noqa: F401
from jaxrl_llm.models.hf import check_weights, load_config, load_params, load_tokenizer, save_params  # noqa: F401
