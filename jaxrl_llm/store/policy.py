"""A run's policy read back from its workdir: the model it recorded at its start
(`policy.json`), the weights of one of its checkpoints, and for a LoRA run its adapters merged
into the frozen base. What export and evaluation read; nothing here writes."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.store import checkpoint, frozen_base
from jaxrl_llm.store import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Policy:
    params: Any  # the full model's weights (a LoRA run's merged into its base)
    cfg: ModelConfig  # without LoRA; eos_token_id: the end the run sampled to
    version: int
    tokenizer: str  # the run's tokenizer directory ('' for the embedded tasks)


def record(workdir: str) -> dict:
    """`<workdir>/policy.json`: the model config and tokenizer directory the run recorded."""
    path = os.path.join(workdir, workdir_lib.POLICY)
    if not os.path.isfile(path):
        raise ValueError(f"{workdir} has no {workdir_lib.POLICY} (a run started before full-weight export "
                         "existed, or not a run's workdir); resume it once to record its model, then export")
    with open(path) as f:
        return json.load(f)


def lora_model(workdir: str) -> tuple[dict, ModelConfig]:
    """A LoRA run's base record and its LoRA model config (`frozen_base.record`)."""
    rec = frozen_base.read(workdir)
    if rec is None:
        raise ValueError(f"{workdir} has no {frozen_base.RECORD}: not a LoRA run (model.lora.rank > 0), or not "
                         "started yet")
    lo = rec["lora"]
    cfg = ModelConfig.from_dict(rec["model"]).replace(lora_rank=lo["rank"], lora_alpha=float(lo["alpha"]),
                                                      lora_targets=tuple(lo["targets"]))
    return rec, cfg


def checkpoint_params(workdir: str, version: Optional[int] = None):
    """(`TrainState.params` of checkpoint `version` (None: the newest), its version)."""
    ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        version = ck.latest_version() if version is None else version
        if version is None:
            raise ValueError(f"{workdir} holds no checkpoint")
        return ck.saved_tree(version)["params"], version
    finally:
        ck.close()


def merged_lora(workdir: str, adapters, cfg: ModelConfig):
    """A LoRA run's frozen base with `adapters` merged in (W + alpha/r B A)."""
    rec = frozen_base.read(workdir)
    loaded = models.load_params(rec["hf_path"], cfg.without_lora())[0] if rec["hf_path"] else None
    return lora.merge(frozen_base.restore(workdir, rec["hf_path"], loaded, cfg), adapters, cfg.lora_scale)


def load(workdir: str, version: Optional[int] = None) -> Policy:
    """The policy of checkpoint `version` (None: the newest) of the run in `workdir`."""
    rec = record(workdir)
    cfg = ModelConfig.from_dict(rec["model"])
    params, version = checkpoint_params(workdir, version)
    if frozen_base.read(workdir) is not None:
        params = merged_lora(workdir, params, lora_model(workdir)[1])
    return Policy(params=params, cfg=cfg.without_lora(), version=int(version), tokenizer=rec.get("tokenizer", ""))
