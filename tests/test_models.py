"""Decoder vs Hugging Face transformers (PyTorch CPU), and the safetensors round trip."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxrl_llm import models
from jaxrl_llm.models.config import ModelConfig
from tests import hf_fixtures as F


@pytest.fixture(scope="module", params=sorted(F.ARCHS))
def hf_pair(request, tmp_path_factory):
    model = F.make_hf_model(request.param)
    path = F.save(model, str(tmp_path_factory.mktemp(request.param)))
    params, cfg = models.load_params(path)
    return request.param, model, path, params, cfg


def test_config_parsed_from_hf(hf_pair):
    arch, _, _, _, cfg = hf_pair
    assert cfg.model_type == {"qwen2_tied": "qwen2", "qwen3": "qwen3", "llama3": "llama"}[arch]
    assert cfg.qkv_bias == (arch == "qwen2_tied")
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == (arch == "qwen2_tied")
    assert (cfg.rope_llama3 is not None) == (arch == "llama3")
    assert cfg.head_dim == 12  # qwen3: explicit head_dim; others: hidden 48 / 4 heads


def test_logits_match_transformers(hf_pair):
    _, model, _, params, cfg = hf_pair
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 40))
    ours = np.asarray(models.full_logits(params, cfg, jnp.asarray(tokens)))
    ref = F.hf_logits(model, tokens)
    assert np.abs(ref).max() > 1.0  # a non-trivial model
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["einsum", "dot_product_attention"])
def test_left_padded_logits_match_transformers(hf_pair, attention):
    _, model, _, params, cfg = hf_pair
    cfg = cfg.replace(attention=attention)  # both kernels of decoder.attention
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 24))
    mask = np.ones_like(tokens)
    mask[0, :7], mask[2, :15] = 0, 0
    ours = np.asarray(models.full_logits(params, cfg, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = F.hf_logits(model, tokens, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


def test_export_round_trip_loads_in_transformers(hf_pair, tmp_path):
    _, model, _, params, cfg = hf_pair
    models.save_params(str(tmp_path), params, cfg)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 30))
    np.testing.assert_allclose(F.hf_logits(reloaded, tokens), F.hf_logits(model, tokens), atol=1e-5, rtol=0)
    params2, cfg2 = models.load_params(str(tmp_path))
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def test_sharded_checkpoint_and_bf16(tmp_path):
    model = F.make_hf_model("qwen3")
    F.save(model, str(tmp_path), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    params, cfg = models.load_params(str(tmp_path))
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 16))
    np.testing.assert_allclose(np.asarray(models.full_logits(params, cfg, jnp.asarray(tokens))),
                               F.hf_logits(model, tokens), atol=1e-4, rtol=0)
    bf = cfg.replace(param_dtype="bfloat16", dtype="bfloat16")
    params_bf, _ = models.load_params(str(tmp_path), bf)
    assert params_bf["embed"].dtype == jnp.bfloat16
    logits_bf = np.asarray(models.full_logits(params_bf, bf, jnp.asarray(tokens)))
    assert np.abs(logits_bf - F.hf_logits(model, tokens)).max() < 0.25  # bf16 is close, not exact


def test_logical_axes_cover_every_parameter():
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=4, qkv_bias=True, qk_norm=True)
    params = models.init_params(cfg, jax.random.key(0))
    axes = models.logical_axes(cfg)
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_a = dict(jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    for path, leaf in flat_p:
        spec = flat_a[path]
        assert len(spec) == leaf.ndim and set(spec) <= {"embed", "heads", "kv", "mlp", "vocab"}, (path, spec)
    assert axes["embed"] == jax.sharding.PartitionSpec("vocab", "embed")
    assert axes["lm_head"] == jax.sharding.PartitionSpec("embed", "vocab")
    assert axes["layers_0"]["mlp"]["down"]["kernel"] == jax.sharding.PartitionSpec("mlp", "embed")


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load_params(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'.*supported: qwen2, qwen3, llama"):
        models.load_params(str(tmp_path))
    cfg = F.make_hf_model("qwen2_tied").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        models.load_params(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        models.load_params(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    F.save(F.make_hf_model("llama3"), str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        models.load_params(str(tmp_path))


def test_tokenizer_loads_from_the_model_directory(tmp_path):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "1", "2", "+", "="])}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(str(tmp_path))
    loaded = models.load_tokenizer(str(tmp_path))
    assert loaded("1 + 2 =")["input_ids"] == [2, 4, 3, 5]
