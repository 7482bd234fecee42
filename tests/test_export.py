"""`python -m jaxrl_llm.export` on a full-weight run (`store/export.py`): the policy of a run on a
local HF checkpoint becomes an HF checkpoint that `transformers` loads with the run's weights
and logits, with its tokenizer; outputs are never overwritten silently. (LoRA runs:
tests/test_frozen_base.py.)"""

import json
import os

import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.run import experiment
from jaxrl_llm.store import checkpoint, export
from tests import hf_fixtures as F
from tests.test_math_dataset import _hf_config, tokenizer_dir  # noqa: F401  (a fixture)


def test_a_full_weight_run_exports_an_hf_checkpoint_with_its_weights_logits_and_tokenizer(
        tokenizer_dir, tmp_path):  # noqa: F811
    import transformers

    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    experiment.run(_hf_config(tokenizer_dir, tmp_path), run, log=lambda *_: None)
    assert export.export(run, out) == 2
    trained = checkpoint.Checkpointer(os.path.join(run, "checkpoints"), async_save=False).saved_tree(2)["params"]
    params, cfg = models.load_params(out)
    jax_equal = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # noqa: E731
    __import__("jax").tree_util.tree_map(jax_equal, params, trained)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).float().eval()
    np.testing.assert_allclose(F.hf_logits(hf, tokens), np.asarray(models.full_logits(trained, cfg, tokens)),
                               atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.eos_token_id == cfg.eos_token_id
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == cfg.eos_token_id
    with pytest.raises(ValueError, match=rf"^{out} exists and is not empty; choose another directory or pass "
                                         "--overwrite"):
        export.export(run, out)
    assert export.export(run, out, version=1, dtype="bfloat16", overwrite=True) == 1
    from safetensors.torch import load_file

    weights = load_file(os.path.join(out, "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"torch.bfloat16"}
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="--merged is for LoRA runs"):
        export.export(run, str(tmp_path / "a"), merged=str(tmp_path / "b"))
    os.remove(os.path.join(run, "policy.json"))
    with pytest.raises(ValueError, match=rf"{run} has no policy.json"):
        export.export(run, str(tmp_path / "c"))


def test_a_generation_config_that_is_no_json_object_is_refused_naming_it(tmp_path):
    """The tokenizer directory's generation_config.json is read before anything is exported."""
    assert export.generation_config(str(tmp_path)) == {} and export.generation_config("") == {}
    path = tmp_path / "generation_config.json"
    for text, message in (("[1, 2]", "a generation config is a JSON object, this file holds list"),
                          ("{", "not JSON (Expecting property name")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"^{path}: " + message.replace("(", "\\(")):
            export.generation_config(str(tmp_path))
    path.write_text('{"eos_token_id": 3, "top_p": 0.9}')
    assert export.generation_config(str(tmp_path)) == {"eos_token_id": 3, "top_p": 0.9}
