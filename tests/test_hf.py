"""`models/hf.py`: the decoder against Hugging Face transformers (PyTorch CPU), the safetensors round
trip, and every refusal named."""

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
    arch, _, _, params, cfg = hf_pair
    assert cfg.model_type == {"qwen2_tied": "qwen2", "qwen2_yarn": "qwen2", "qwen3": "qwen3", "llama3": "llama"}[arch]
    assert cfg.qkv_bias  # Qwen2 always; Qwen3 and Llama here with attention_bias=True
    assert cfg.o_bias == (arch in ("qwen3", "llama3")) and cfg.mlp_bias == (arch == "llama3")
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == (arch == "qwen2_tied")
    assert cfg.rope_type == {"qwen2_tied": "default", "qwen2_yarn": "yarn", "qwen3": "linear", "llama3": "llama3"}[arch]
    assert cfg.head_dim == 12  # qwen3: explicit head_dim; others: hidden 48 / 4 heads
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params


def test_logits_match_transformers(hf_pair):
    _, model, _, params, cfg = hf_pair
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 40))
    ours = np.asarray(models.full_logits(params, cfg, jnp.asarray(tokens)))
    ref = F.hf_logits(model, tokens)
    assert np.abs(ref).max() > 1.0  # a non-trivial model
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["einsum", "xla", "splash"])
def test_left_padded_logits_match_transformers(hf_pair, attention):
    _, model, _, params, cfg = hf_pair
    cfg = cfg.replace(attention=attention)  # the fused, einsum and splash kernels
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


def test_a_qwen2_model_without_qkv_bias_exports_zero_biases(tmp_path):
    """The embedded default's model (qwen2, no q/k/v bias) reloads in transformers with every
    tensor present and in this loader as the same function."""
    cfg = models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=8)
    params = models.init_params(cfg, jax.random.key(0))
    models.save_params(str(tmp_path), params, cfg)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    params2, cfg2 = models.load_params(str(tmp_path))
    assert cfg2.qkv_bias and not np.any(np.asarray(params2["layers_0"]["attn"]["q"]["bias"]))
    tokens = np.random.default_rng(0).integers(0, 32, (2, 9))
    np.testing.assert_allclose(np.asarray(models.full_logits(params2, cfg2, jnp.asarray(tokens))),
                               F.hf_logits(reloaded.eval(), tokens), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(models.full_logits(params, cfg, jnp.asarray(tokens))),
                               F.hf_logits(reloaded.eval(), tokens), atol=1e-5, rtol=0)


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


def test_unused_tensor_is_named(tmp_path):
    """A Llama checkpoint with attention biases whose config.json lost `attention_bias`: loading
    it without the o/q/k/v biases would give logits off by O(1), so the loader refuses."""
    F.save(F.make_hf_model("llama3"), str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"8 tensor\(s\) this llama model does not use.*layers.0.self_attn.k_proj.bias"):
        models.load_params(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "unsupported rope_scaling type 'dynamic'.*yarn"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "unsupported rope_scaling type 'longrope'"),
    (dict(rope_scaling={**F.YARN_ROPE, "extrapolation": 2}), "'yarn': unsupported parameter.*extrapolation"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'llama3' needs high_freq_factor, low_freq_factor"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(rope_scaling={**F.YARN_ROPE, "partial_rotary_factor": 0.5}), "partial rotary"),
    (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=True"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types.*sliding_attention"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_options_are_refused_by_name(change, message):
    hf = {**F.make_hf_model("qwen2_tied").config.to_dict(), **change}
    hf.pop("rope_parameters", None) if "rope_scaling" in change else None
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf)


def test_config_json_fields_are_refused_by_name_unless_of_their_type_and_range(tmp_path):
    """A config.json is a file users point at: each field read is checked for its JSON type and
    range (a string "false" would be a true flag; a float width or a step of 0 would fail far from
    the file), a null takes the default, and `load_config` names the file."""
    import json
    import re

    hf = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=8).to_dict()
    good = ModelConfig.from_hf(hf)
    cases = [("vocab_size", 0), ("vocab_size", "64"), ("hidden_size", 16.0), ("num_hidden_layers", True),
             ("num_key_value_heads", 0), ("head_dim", -8), ("max_position_embeddings", -5), ("intermediate_size", [32]),
             ("rms_norm_eps", "1e-6"), ("rms_norm_eps", 0), ("tie_word_embeddings", "false"), ("attention_bias", 1),
             ("eos_token_id", "x"), ("eos_token_id", []), ("bos_token_id", -1), ("norm_topk_prob", "false"),
             ("decoder_sparse_step", 0), ("num_experts_per_tok", 2.5), ("moe_intermediate_size", 0),
             ("mlp_only_layers", 5), ("mlp_only_layers", ["a"]), ("router_aux_loss_coef", float("nan")),
             ("router_aux_loss_coef", -0.1)]
    for key, value in cases:
        with pytest.raises(ValueError, match="^" + re.escape(f"{key}={value!r}: expected ")):
            ModelConfig.from_hf({**hf, key: value})
    with pytest.raises(ValueError, match="^vocab_size is missing$"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "vocab_size"})
    nulls = ModelConfig.from_hf({**hf, "head_dim": None, "num_key_value_heads": None, "decoder_sparse_step": None,
                                 "mlp_only_layers": None, "eos_token_id": [5, 6]})
    assert (nulls.head_dim, nulls.num_kv_heads, nulls.decoder_sparse_step, nulls.mlp_only_layers) == (8, 2, 1, ())
    assert nulls.eos_token_id == 5 and good.norm_topk_prob is False and good.tie_word_embeddings is False
    (tmp_path / "config.json").write_text(json.dumps({**hf, "norm_topk_prob": "true"}))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/config.json: norm_topk_prob='true': expected True")):
        models.load_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/config.json: Expecting property name")):
        models.load_config(str(tmp_path))


def test_a_malformed_safetensors_header_is_refused_naming_the_file_and_tensor(tmp_path):
    """The header is read before any weight (`check_weights`): each entry must be a dtype, a shape
    of integers >= 0 and the byte offsets that hold it, else the file and tensor are named (they
    raised TypeError or AttributeError, or asked numpy for a 10^24-element view)."""
    import json
    import re
    import struct

    cfg = ModelConfig.from_hf(transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1).to_dict())
    name = "model.embed_tokens.weight"
    entries = [{"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]}, {"dtype": "F32", "shape": [-1, 16]},
               {"dtype": "F32", "shape": [1], "data_offsets": ["a", 4]}, "nope", [0, 4],
               {"dtype": "F32", "shape": [10**12, 10**12], "data_offsets": [0, 4]},
               {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
               {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]},
               {"dtype": "F8_E4M3", "shape": [10**12, 10**12], "data_offsets": [0, 4]}]
    file = tmp_path / "model.safetensors"
    for entry in entries:
        head = json.dumps({name: entry}).encode()
        file.write_bytes(struct.pack("<Q", len(head)) + head + bytes(4))
        with pytest.raises(ValueError, match=re.escape(f"{file}: tensor '{name}' has a malformed header entry")):
            models.check_weights(str(tmp_path), cfg)
    head = b"[]"
    file.write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(ValueError, match=re.escape(f"{file} is not a safetensors file (its header is not a JSON")):
        models.check_weights(str(tmp_path), cfg)
    head = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    file.write_bytes(struct.pack("<Q", len(head)) + head + bytes(4))  # well formed: the model's counts are next
    for layers in (1, 10**9):  # (10^9: refused before the model's shapes are traced)
        with pytest.raises(ValueError, match=re.escape(f"it gives num_hidden_layers={layers}, they hold 0 (none)")):
            models.check_weights(str(tmp_path), cfg.replace(num_layers=layers))


def test_tokenizer_loads_from_the_model_directory(tmp_path):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "1", "2", "+", "="])}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(str(tmp_path))
    loaded = models.load_tokenizer(str(tmp_path))
    assert loaded("1 + 2 =")["input_ids"] == [2, 4, 3, 5]


def test_config_survives_a_json_round_trip():
    """What sampler nodes and `export` read back: nested tuples (RoPE parameters) restored, hashable."""
    import dataclasses
    import json

    from jaxrl_llm.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, rope_type="linear", rope_params=(("factor", 2.0),), lora_targets=("q", "v"))
    back = ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg and hash(back) == hash(cfg)
