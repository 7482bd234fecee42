"""Orbax checkpoints of the whole TrainState: an identical continuation after restore.

Saved: params, optimizer state, step, version, rng, skipped count, reference params and the
objective's auxiliary model (params, optimizer state) when present. Checkpoints are keyed by the policy
version; saving is asynchronous (the next step overlaps the write) and keeps the newest K.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import orbax.checkpoint as ocp

from jaxrl_llm.learner import TrainState


class Checkpointer:
    def __init__(self, directory: str, save_every: int = 1, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                               enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: TrainState, force: bool = False) -> bool:
        """Save if the version is on the save interval, or nothing is saved yet, or `force`.
        Returns whether it saved."""
        return self.manager.save(int(state.version), args=ocp.args.StandardSave(state), force=force)

    def latest_version(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore(self, template: TrainState, version: Optional[int] = None) -> TrainState:
        """Restore into the structure, dtypes and shardings of `template` (e.g. `learner.init(...)`)."""
        version = self.latest_version() if version is None else version
        if version is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory!r}")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(version, args=ocp.args.StandardRestore(abstract))


    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
