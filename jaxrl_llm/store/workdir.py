"""A run's hold on its workdir, and what changed when it resumes.

**One run per workdir.** `Lock` takes a POSIX record lock (`fcntl.lockf`) on `<workdir>/run.lock`
and writes its holder (host, pid, start time, command) into the file. The operating system drops
the lock when the holder exits, however it exits, so a run killed with SIGKILL leaves a file but
no lock, and the next run starts without clean-up; record locks are also what NFS (lockd /
NFSv4) arbitrates between hosts. With many processes, process 0 holds it for the run.

**Resumes that changed.** Each start appends the config it ran (the user's, flattened) with the
version it started from to `<workdir>/config_history.jsonl`. A resume compares its config with
the newest entry: a different model (sizes, architecture, checkpoint) is refused; other changes
outside `FREE` (and `FREE_PREFIXES`) are refused unless `--config.train.allow_changes=True`, and then recorded.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from typing import Optional

from jaxrl_llm import validation

LOCK, HISTORY, EVAL_SET, POLICY = "run.lock", "config_history.jsonl", "eval_set.json", "policy.json"
# Settings a resume may change without saying so: how long, how often to evaluate, save and log.
FREE = ("train.steps", "train.eval_every", "train.save_every", "train.keep", "train.tensorboard", "train.progress",
        "train.resume", "train.preempt_grace_s", "train.allow_changes", "train.check_memory", "train.deterministic",
        "train.compile_cache",
        "learner.total_steps")  # total_steps follows train.steps in the shipped configs
# Where and on how many processes / devices it runs: a deployment, not the experiment.
FREE_PREFIXES = ("distributed.", "mesh.", "cpu_devices", "runtime.sampler_devices", "runtime.remote.host",
                 "runtime.remote.port", "runtime.remote.tls_", "runtime.remote.token")
# Secrets: never written to the workdir (config.json, the history, the lock) nor echoed.
SECRETS = ("runtime.remote.token", "gateway.token")
SECRET_FLAGS = ("--token",)  # sampler_node's own spelling of the token
REDACTED = "***"
# A different model cannot continue from the checkpoint at all, flag or not.
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm")


class WorkdirBusy(validation.Refused):
    """Another live run holds the workdir."""


class Lock:
    """Held from `acquire` to `release` (or the process's end)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK)
        self._fd: Optional[int] = None

    def acquire(self) -> "Lock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirBusy(f"{os.path.dirname(self.path)} is held by a live run ({holder}); wait for it to end "
                              "or stop it, or use another --workdir") from None
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(redact_argv(sys.argv))[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def redact_argv(argv) -> list:
    """A command line with the value of every secret flag (`--config.<secret>=V`, `--token V`)
    replaced by REDACTED."""
    flags = tuple(f"--config.{k}" for k in SECRETS) + SECRET_FLAGS
    out, hide = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        if hide:
            out.append(REDACTED)
        elif name in flags and "=" in a:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(a)
        hide = not hide and a in flags
    return out


def public(config) -> dict:
    """A config as nested JSON values with every set secret replaced by REDACTED."""
    d = json.loads(config.to_json_best_effort())
    for key in SECRETS:
        *path, last = key.split(".")
        node = d
        for p in path:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and node.get(last):
            node[last] = REDACTED
    return d


def flat(config) -> dict:
    """A config as {dotted key: JSON value}, secrets redacted."""
    return validation.flatten(public(config))


def last_run(workdir: str) -> Optional[dict]:
    try:
        with open(os.path.join(workdir, HISTORY)) as f:
            lines = [line for line in f if line.strip()]
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines else None


def changes(workdir: str, config, model: dict) -> tuple[list, list]:
    """(model differences, other differences) between this run and the workdir's last, each
    as "key: before -> now" lines; ([], []) for a workdir with no history."""
    last = last_run(workdir)
    if last is None:
        return [], []
    model_diff = [f"model {k}: {last['model'].get(k)!r} -> {model[k]!r}" for k in MODEL_KEYS
                  if k in last["model"] and last["model"][k] != model[k]]
    now = flat(config)
    # Only the last start's keys: one it did not have is a setting added by a newer version of
    # this code, not a change of the experiment (`introduced` records it on resume).
    keys = sorted(last["config"])
    other = [f"{k}: {last['config'].get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}" for k in keys
             if k not in FREE and not k.startswith(FREE_PREFIXES) and last["config"].get(k) != now.get(k)]
    return model_diff, other


def introduced(workdir: str, config) -> list:
    """Settings this start has that the workdir's last start did not (added to the code since)."""
    last = last_run(workdir)
    return [] if last is None else [f"{k}: new setting -> {v!r}" for k, v in sorted(flat(config).items())
                                    if k not in last["config"]]


def check_resume(workdir: str, config, model: dict, version: int) -> list:
    """Before a checkpoint is restored: refuse a different model, and other changes outside
    FREE unless the config allows them. Returns the changes to record (allowed ones, plus a
    changed `train.steps` under a cosine schedule, which stretches the learning-rate curve)."""
    model_diff, other = changes(workdir, config, model)
    if model_diff:
        raise ValueError(f"{workdir} holds checkpoints (version {version}) of a different model; cannot resume: "
                         + "; ".join(model_diff) + ". Use another --workdir or --config.train.resume=fresh")
    if other and not config.train.allow_changes:
        raise ValueError(f"resuming {workdir} (version {version}) with changed settings: " + "; ".join(other)
                         + ". Pass --config.train.allow_changes=True to resume with them (they are recorded), "
                         "or use another --workdir")
    other += introduced(workdir, config)
    last = last_run(workdir)
    if last and config.learner.schedule == "cosine" and last["config"].get("train.steps") != config.train.steps:
        other.append(f"train.steps: {last['config'].get('train.steps')!r} -> {config.train.steps!r} "
                     "(the cosine learning-rate schedule is stretched to it)")
    return other


def record(workdir: str, config, model: dict, version: int, changed: list) -> None:
    """Append this start to the history (process 0 only)."""
    entry = {"version": version, "time": datetime.datetime.now().isoformat(timespec="seconds"),
             "model": model, "config": flat(config), "changes": changed}
    with open(os.path.join(workdir, HISTORY), "a") as f:
        f.write(json.dumps(entry) + "\n")


def check_eval_set(workdir: str, eval_set: dict, resumed: bool) -> str:
    """The refusal ('' if none) for a resumed run whose task would evaluate on other problems than
    the run it continues (a changed dataset, or held-out rows that moved: the old held-out
    problems could then be trained on); records `eval_set` in the workdir otherwise (process 0)."""
    path = os.path.join(workdir, EVAL_SET)
    same = ("split", "holdout", "seed", "rows")
    if resumed and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if {k: saved.get(k) for k in same} != {k: eval_set.get(k) for k in same}:
            return (f"{path}: the run being resumed evaluated on {_eval_set_line(saved)}; this one would evaluate on "
                    f"{_eval_set_line(eval_set)} (the dataset or task.eval_* changed). Use another --workdir, or "
                    "--config.train.resume=fresh")
    with open(path, "w") as f:
        json.dump(eval_set, f)
    return ""


def _eval_set_line(eval_set: dict) -> str:
    rows = eval_set.get("rows")
    held = f", rows {rows[:5]}{'...' if len(rows) > 5 else ''} of {eval_set.get('split')!r} held out" if rows else ""
    return f"split {eval_set.get('split')!r}{held}"


def record_policy(workdir: str, model: dict, tokenizer: str) -> None:
    """What a full-weight export (`store/export.py`) needs and a checkpoint does not hold: the
    policy's model config (`dataclasses.asdict` of it, without LoRA) and the directory of its
    tokenizer ('' for an embedded task's). Written at each start (process 0)."""
    with open(os.path.join(workdir, POLICY), "w") as f:
        json.dump({"model": model, "tokenizer": tokenizer}, f, indent=2)
