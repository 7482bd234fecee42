"""Orbax checkpoints of the whole TrainState: an identical continuation after restore.

Saved: params, optimizer state, step, version, rng, skipped count, reference params and the
objective's auxiliary model (params, optimizer state) when present. Checkpoints are keyed by the policy
version; saving is asynchronous (the next step overlaps the write) and keeps the newest K.

Beside version V's orbax directory, `V.runtime/process_<i>.json` holds each process's host-side
runtime state (`Orchestrator.runtime_state`: the async data position, delay streams, run-long
counters), written at the same save; orbax does not list it as a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxrl_llm import validation
from jaxrl_llm.parallel import distributed
from jaxrl_llm.learner.learner import TrainState


class CheckpointError(validation.Refused):
    """Checkpoints exist but none can be restored."""


def _move_aside(path: str) -> str:
    aside, n = path + ".damaged", 1
    while os.path.exists(aside):
        aside, n = f"{path}.damaged{n}", n + 1
    os.rename(path, aside)
    return aside


def move_all_aside(directory: str) -> Optional[str]:
    """`--config.train.resume=fresh`: the whole checkpoint directory is renamed, not deleted."""
    if not os.path.isdir(directory) or not os.listdir(directory):
        return None
    aside, n = directory + ".old", 1
    while os.path.exists(aside):
        aside, n = f"{directory}.old{n}", n + 1
    os.rename(directory, aside)
    return aside


class Checkpointer:
    def __init__(self, directory: str, save_every: int = 1, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                               enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: TrainState, force: bool = False, runtime: Optional[dict] = None) -> bool:
        """Save if the version is on the save interval, or nothing is saved yet, or `force`,
        with this process's `runtime` state (JSON-able) beside it. Returns whether it saved."""
        version = int(state.version)
        try:
            saved = self.manager.save(version, args=ocp.args.StandardSave(state), force=force)
            if saved and runtime is not None:
                self._write_runtime(version, runtime)
            return saved
        except OSError as e:  # disk full, no permission, ...: stop clearly; the previous one stays
            raise self._write_error(version, e) from e

    def _runtime_path(self, version: int) -> str:
        return os.path.join(self.directory, f"{version}.runtime", f"process_{distributed.index()}.json")

    def _write_runtime(self, version: int, runtime: dict) -> None:
        path = self._runtime_path(version)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(runtime, f)
        os.replace(path + ".tmp", path)  # never half a file under the final name
        if distributed.is_main():  # runtime states of checkpoints orbax no longer keeps
            kept = self.manager.all_steps()
            for name in os.listdir(self.directory):
                v = name[:-len(".runtime")]
                if name.endswith(".runtime") and v.isdigit() and kept and int(v) < min(kept):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def runtime(self, version: int) -> Optional[dict]:
        """This process's runtime state saved with `version`, or None (none was saved, e.g. a
        checkpoint written by `save` without one, or by a run with fewer processes)."""
        try:
            with open(self._runtime_path(version)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def latest_version(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore(self, template: TrainState, version: Optional[int] = None) -> TrainState:
        """Restore into the structure, dtypes and shardings of `template`: a state or, without
        allocating one, `learner.abstract_state()`."""
        version = self.latest_version() if version is None else version
        if version is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory!r}")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(version, args=ocp.args.StandardRestore(abstract))


    def restore_newest_readable(self, template, log=print) -> Optional[TrainState]:
        """The newest checkpoint that restores, or None when there is none at all. `template`
        is a TrainState or a function making one, called only when there is a checkpoint (a
        fresh run does not build a state to throw away). A damaged
        newer one (truncated, overwritten, a file missing) is reported by version and path and
        moved aside to `<version>.damaged` (kept for inspection, out of the manager's view);
        with checkpoints present but none readable, CheckpointError names the directory."""
        tried = []
        for version in sorted(self.manager.all_steps(), reverse=True):
            if callable(template):
                template = template()
            try:
                return self.restore(template, version)
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                path = os.path.join(self.directory, str(version))
                aside = _move_aside(path) if distributed.is_main() else path + ".damaged"
                msg = str(e).splitlines()[0][:200] if str(e) else ""
                log(f"checkpoint at version {version} ({path}) is unreadable ({type(e).__name__}: {msg}); "
                    f"moved to {aside}, trying the previous one")
                tried.append(version)
                self.manager.reload()
        if tried:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (damaged versions {tried}, moved aside as "
                "<version>.damaged); --config.train.resume=fresh starts afresh and keeps them")
        return None

    def _write_error(self, version: int, e: OSError) -> "CheckpointError":
        previous = [v for v in self.manager.all_steps() if v < version]
        kept = f"version {max(previous)} is intact and resumes" if previous else "no earlier checkpoint exists"
        return CheckpointError(f"saving the checkpoint of version {version} in {self.directory} failed "
                               f"({type(e).__name__}: {e}); {kept}. Free space or fix permissions, then run again")

    def saved_tree(self, version: Optional[int] = None) -> dict:
        """A checkpoint as saved (nested dicts of arrays), with no template: for tools that read
        one part, e.g. `export` the params. None: the newest. Every array lands on this
        process's first device, whatever mesh saved it (a run on 8 accelerators is exported or
        evaluated on a one-CPU machine)."""
        version = self.latest_version() if version is None else version
        if version is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory!r}")
        if version not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint of version {version} in {self.directory!r}; saved versions: "
                                    f"{sorted(self.manager.all_steps())}")
        saved = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(version) / "default")
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), saved)
        return self.manager.restore(version, args=ocp.args.StandardRestore(target))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.manager.wait_until_finished()  # an asynchronous write's error surfaces here
        except OSError as e:
            raise self._write_error(-1 if self.latest_version() is None else self.latest_version() + 1, e) from e
        finally:
            self.manager.close()
