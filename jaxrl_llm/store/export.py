"""Export a LoRA run: `python -m jaxrl_llm.export --workdir=runs/x --out=runs/x/adapter [--merged=DIR]`.

`--out` gets a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) of the
newest checkpoint (or `--version`), whose `base_model_name_or_path` is the run's frozen base (its
`model.hf_path`, or the workdir's copy of a warm-started random base): `peft.PeftModel.
from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)` loads it. `--merged` also
writes the base with the adapters merged in (W + alpha/r B A) as an HF checkpoint, with the
base's tokenizer files when it has them.
"""

from __future__ import annotations

import os
import shutil

from absl import flags

from jaxrl_llm import models, validation
from jaxrl_llm.store import checkpoint, frozen_base
from jaxrl_llm.models import adapters, lora
from jaxrl_llm.models.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def run_model(workdir: str) -> tuple[dict, ModelConfig]:
    """The run's base record and its LoRA model config (`frozen_base.record`)."""
    rec = frozen_base.read(workdir)
    if rec is None:
        raise ValueError(f"{workdir} has no {frozen_base.RECORD}: not a LoRA run (model.lora.rank > 0), or not "
                         "started yet")
    lo = rec["lora"]
    cfg = ModelConfig.from_dict(rec["model"]).replace(lora_rank=lo["rank"], lora_alpha=float(lo["alpha"]),
                                   lora_targets=tuple(lo["targets"]))
    return rec, cfg


def export(workdir: str, out: str, merged: str = "", version=None) -> int:
    """Write the adapters of `version` (None: the newest) to `out`, and the merged model to
    `merged` when given. Returns the version exported."""
    rec, cfg = run_model(workdir)
    ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        version = ck.latest_version() if version is None else version
        params = ck.saved_tree(version)["params"]
    finally:
        ck.close()
    adapters.save(out, params, cfg, base_model=rec["path"])
    if merged:
        loaded = models.load_params(rec["hf_path"], cfg.without_lora())[0] if rec["hf_path"] else None
        base = frozen_base.restore(workdir, rec["hf_path"], loaded, cfg)
        models.save_params(merged, lora.merge(base, params, cfg.lora_scale), cfg.without_lora())
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(rec["path"], name)):
                shutil.copy(os.path.join(rec["path"], name), merged)
    return version


WORKDIR = flags.DEFINE_string("workdir", None, "a LoRA run's workdir")
OUT = flags.DEFINE_string("out", None, "the PEFT adapter directory to write")
MERGED = flags.DEFINE_string("merged", "", "also write the merged model (an HF checkpoint) here")
VERSION = flags.DEFINE_integer("version", None, "the checkpoint version (default: the newest)")
VERBOSE = flags.DEFINE_bool("verbose", False, "print a refusal with its traceback")


def main(argv):
    del argv

    def body() -> int:
        v = export(WORKDIR.value, OUT.value, MERGED.value, VERSION.value)
        also = f" and {MERGED.value}" if MERGED.value else ""
        print(f"exported version {v} of {WORKDIR.value} to {OUT.value}{also}")
        return 0

    return validation.cli(body, VERBOSE.value, "jaxrl_llm.export")
