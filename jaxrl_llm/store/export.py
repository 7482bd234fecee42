"""Export a run: `python -m jaxrl_llm.export --workdir=runs/x --out=DIR [--version=N] [--overwrite]`.

A full-weight run: `--out` gets a Hugging Face checkpoint of the policy (config.json +
model.safetensors in `--dtype`, the tokenizer files of the run's tokenizer directory and a
generation config), which `transformers.AutoModelForCausalLM.from_pretrained(out)` loads, from
the model the run recorded at its start (`<workdir>/policy.json`).

A LoRA run: `--out` gets a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`) of the newest checkpoint (or `--version`), whose
`base_model_name_or_path` is the run's frozen base (its `model.hf_path`, or the workdir's copy of
a warm-started random base): `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
base), out)` loads it. `--merged` also writes the base with the adapters merged in
(W + alpha/r B A) as an HF checkpoint, with the base's tokenizer files when it has them.

An existing non-empty output directory is refused unless `--overwrite`.
"""

from __future__ import annotations

import json
import os
import shutil

from absl import flags

from jaxrl_llm import models, validation
from jaxrl_llm.store import frozen_base, policy
from jaxrl_llm.models import adapters
from jaxrl_llm.models.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def _fresh(path: str, overwrite: bool) -> None:
    if path and os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ValueError(f"{path} exists and is not empty; choose another directory or pass --overwrite")


def _tokenizer_files(src: str, out: str) -> None:
    for name in TOKENIZER_FILES:
        if src and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)


def export(workdir: str, out: str, merged: str = "", version=None, dtype: str = "", overwrite: bool = False) -> int:
    """Export `version` (None: the newest) of the run in `workdir` to `out` (module docstring).
    Returns the version exported."""
    for path in (out, merged):
        _fresh(path, overwrite)
    if frozen_base.read(workdir) is None:
        if merged:
            raise ValueError(f"--merged is for LoRA runs; {workdir} trained full weights: --out is the model")
        return _export_full(workdir, out, version, dtype)
    rec, cfg = policy.lora_model(workdir)
    params, version = policy.checkpoint_params(workdir, version)
    adapters.save(out, params, cfg, base_model=rec["path"])
    if merged:
        models.save_params(merged, policy.merged_lora(workdir, params, cfg), _dtype(cfg.without_lora(), dtype))
        _tokenizer_files(rec["path"], merged)
    return version


def _dtype(cfg: ModelConfig, dtype: str) -> ModelConfig:
    return cfg.replace(param_dtype=dtype) if dtype else cfg


def generation_config(src: str) -> dict:
    """The generation config beside the run's tokenizer (`src`; {} without one), read before
    anything is written: a file users point at, so one that is not a JSON object is refused
    naming it."""
    path = os.path.join(src, "generation_config.json") if src else ""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            gen = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path}: a generation config is a JSON object, this file holds {type(gen).__name__}")
    return gen


def _export_full(workdir: str, out: str, version, dtype: str) -> int:
    rec = policy.record(workdir)
    cfg = _dtype(ModelConfig.from_dict(rec["model"]), dtype)
    gen = generation_config(rec["tokenizer"])
    params, version = policy.checkpoint_params(workdir, version)
    models.save_params(out, params, cfg)
    _tokenizer_files(rec["tokenizer"], out)
    if gen.get("eos_token_id") is None:  # the end the run sampled to, for generate() and servers
        gen["eos_token_id"] = cfg.eos_token_id
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    return version


WORKDIR = flags.DEFINE_string("workdir", None, "a run's workdir")
OUT = flags.DEFINE_string("out", None, "the HF checkpoint (full weights) or PEFT adapter (LoRA) directory to write")
MERGED = flags.DEFINE_string("merged", "", "LoRA: also write the merged model (an HF checkpoint) here")
VERSION = flags.DEFINE_integer("version", None, "the checkpoint version (default: the newest)")
DTYPE = flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16"],
                          "the exported weights' dtype (default: the model's)")
OVERWRITE = flags.DEFINE_bool("overwrite", False, "write into a non-empty output directory")
VERBOSE = flags.DEFINE_bool("verbose", False, "print a refusal with its traceback")


def main(argv):
    del argv

    def body() -> int:
        v = export(WORKDIR.value, OUT.value, MERGED.value, VERSION.value, DTYPE.value, OVERWRITE.value)
        also = f" and {MERGED.value}" if MERGED.value else ""
        print(f"exported version {v} of {WORKDIR.value} to {OUT.value}{also}")
        return 0

    return validation.cli(body, VERBOSE.value, "jaxrl_llm.export")
