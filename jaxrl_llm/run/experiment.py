"""Assemble and run an experiment from a config: task, model, sampler, learner, runtime,
evaluation, metrics, checkpoints (resumed automatically from the workdir)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import models, tasks, validation
from jaxrl_llm.learner import learner
from jaxrl_llm.parallel import distributed, preemption, sharding
from jaxrl_llm.run import memory, paths
from jaxrl_llm.store import checkpoint, frozen_base
from jaxrl_llm.store import workdir as workdir_lib
from jaxrl_llm.run import plan as plan_lib
from jaxrl_llm.store.checkpoint import Checkpointer
from jaxrl_llm.run.metrics import MetricsWriter, Progress
from jaxrl_llm.models import adapters as peft_adapters
from jaxrl_llm.rollout import Sampler
from jaxrl_llm.runtime import orchestrator
from jaxrl_llm.tasks import warmstart


class BadStepsError(validation.Refused):
    """Too many consecutive training steps with non-finite loss or gradients."""


@contextlib.contextmanager
def compilation_cache(directory: str):
    """Within: every compiled program is kept in `directory` (JAX's persistent cache), so runs
    that differ only in seed or in values the programs take as inputs (a sweep's cells) compile
    once. JAX's previous settings come back on exit."""
    settings = {"jax_compilation_cache_dir": directory, "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {k: getattr(jax.config, k) for k in settings}
    try:
        for k, v in settings.items():
            jax.config.update(k, v)
        cc.reset_cache()  # JAX decides whether to use the cache once, at its first compile
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        cc.reset_cache()


def set_cpu_devices(n: int) -> None:
    """Expose `n` CPU devices to JAX (-1: one per core; 0: leave JAX's default). Must run before
    the first JAX computation; samplers and the learner then split rows over them."""
    if n:
        jax.config.update("jax_num_cpu_devices", os.cpu_count() if n < 0 else n)


def _load(m, cfg):
    """The checkpoint's weights (float32 master copies) or None for a random model."""
    return models.load_params(m.hf_path, cfg.without_lora())[0] if m.hf_path else None


def build(config) -> dict:
    """The run's parts, from its plan (`plan.resolve`: validated, resolved, memory checked)."""
    p = plan_lib.resolve(config)
    c = p.config
    params, aux_params = _load(c.model, p.model), p.aux_model and _load(c.aux_model, p.aux_model)
    lrn = learner.Learner(p.model, p.objective, c.learner, mesh=sharding.make_mesh(c.mesh, p.learner_devices),
                          mesh_cfg=c.mesh, aux_model_cfg=p.aux_model, dist=p.sampler.dist)
    # Samplers split rows over their devices (data parallel); with devices of their own, the
    # weight store publishes each version onto them.
    mesh = Mesh(np.asarray(p.sampler_devices), ("data",))
    placement = NamedSharding(mesh, PartitionSpec()) if p.own_sampler_devices else None
    scorer = tasks.scorer(p.task, c.task)
    orch = orchestrator.Orchestrator(lrn, Sampler(lrn.rollout_model_cfg, p.sampler, mesh), p.task, c.runtime,
                                     placement=placement, scorer=scorer,
                                     node_config={"task": c.task.to_dict(), "hf_path": c.model.hf_path})
    # A sampling auxiliary (a rollout model) is evaluated beside the policy; any auxiliary may be warm-started.
    return dict(plan=p, task=p.task, scorer=scorer, model_cfg=p.model, params=params, memory_plan=p.memory,
                aux_cfg=p.aux_model, aux_params=aux_params, learner=lrn, orchestrator=orch,
                greedy=Sampler(p.model.without_lora(), p.greedy, mesh),
                aux_greedy=p.aux_model and Sampler(p.aux_model, p.greedy, mesh),
                aux_eval=lrn.aux is not None and lrn.aux.samples)


def _initial_params(config, params, cfg, task, key, greedy, notes, role="policy"):
    """Given weights, or random ones warm-started on the task (tasks with `supervised`)."""
    if params is not None:
        return params
    params = models.init_params(cfg, key)
    w = config.warm_start
    if w.steps and hasattr(task, "supervised") and distributed.is_main():  # the others take process 0's
        params, note = warmstart.cached(
            lambda p: warmstart.to_target(p, cfg, task, greedy, w, config.seed), params, w,
            warmstart.cache_key(cfg, config.task, w, config.seed, role))
        notes.append(note)
    return distributed.broadcast(params)  # every process starts from process 0's weights


def run(config, workdir: str, log=None) -> dict:
    """Train `config` in `workdir` (resuming from its checkpoints) and return a summary.
    `log(line)` receives progress lines; by default they go beside a tqdm bar on a terminal."""
    paths.check(config, workdir)  # before anything is built or written
    os.makedirs(workdir, exist_ok=True)
    lock = _hold(workdir)
    try:
        return _run(config, workdir, log)
    finally:
        if lock is not None:
            lock.release()


def _hold(workdir: str):
    """Process 0 locks the workdir for the run (`workdir.Lock`); if another run holds it, every
    process stops here, before anything is built."""
    lock, busy = None, ""
    if distributed.is_main():
        try:
            lock = workdir_lib.Lock(workdir).acquire()
        except workdir_lib.WorkdirBusy as e:
            busy = str(e)
    if distributed.count() > 1 and int(np.max(distributed.agree(1 if busy else 0))):
        busy = busy or f"{workdir} is held by another run (process 0 found its lock)"
    if busy:
        raise workdir_lib.WorkdirBusy(busy)
    return lock


def _run(config, workdir: str, log) -> dict:
    t_start = time.time()
    b = build(config)
    user_config, config = config, b["plan"].config  # from here on the resolved, immutable one
    task, lrn, orch = b["task"], b["learner"], b["orchestrator"]
    ckdir, notes = os.path.join(workdir, "checkpoints"), []
    have, what = memory.available()
    notes.append(f"memory plan (GiB): {memory.describe(b['memory_plan'])}; {what}: {have / memory.GB:.1f} GiB")
    notes.extend(f"warning: {w}" for w in b["plan"].warnings)
    if config.train.get("resume", "auto") == "fresh" and distributed.is_main():
        aside = checkpoint.move_all_aside(ckdir)
        if aside:
            notes.append(f"starting afresh: earlier checkpoints moved to {aside}")
    distributed.agree(0)  # nobody opens the directory while process 0 moves it
    ckpt = Checkpointer(ckdir, save_every=config.train.save_every, keep=config.train.keep)
    key = jax.random.key(config.seed)
    lora, mcfg = bool(b["model_cfg"].lora_rank), b["model_cfg"]
    saved = ckpt.manager.all_steps()
    frozen_base.check_resumable(workdir, mcfg, bool(saved))
    shape = {k: getattr(mcfg, k) for k in workdir_lib.MODEL_KEYS}
    changed = workdir_lib.check_resume(workdir, user_config, shape, max(saved)) if saved else []
    restored = ckpt.restore_newest_readable(lrn.abstract_state(), log=notes.append)
    resumed = restored is not None
    loaded, loaded_aux = b.pop("params"), b.pop("aux_params")  # dropped once the learner holds its copy
    if resumed:
        if lora:  # the adapters' frozen base: referenced by the workdir, not in the checkpoint
            lrn.hold_base(frozen_base.restore(workdir, config.model.hf_path, loaded, mcfg))
        state = lrn.place(restored)
    else:
        params = _initial_params(config, loaded, mcfg.without_lora(), task, key, b["greedy"], notes)
        aux = (_initial_params(config, loaded_aux, b["aux_cfg"], task, jax.random.fold_in(key, 1),
                               b["aux_greedy"], notes, role="actor")
               if b["aux_cfg"] else None)
        adapters = None
        if lora:
            frozen_base.record(workdir, config.model.hf_path, params, mcfg)
            if config.model.lora.init_from:
                adapters = peft_adapters.load(config.model.lora.init_from, mcfg)
                notes.append(f"LoRA adapters start from {config.model.lora.init_from}")
        state = lrn.init(key, params=params, aux_params=aux, adapters=adapters)
        del params, aux, adapters
    del loaded, loaded_aux, restored
    main = distributed.is_main()  # process 0 alone writes and prints
    if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(workdir_lib.public(user_config), f, indent=2)  # the config the user ran, secrets redacted
        workdir_lib.record(workdir, user_config, shape, int(state.version), changed if resumed else [])
    # Records past the restored version (or all, starting afresh) belong to a run that died.
    writer = MetricsWriter(workdir, tensorboard=config.train.tensorboard, enabled=main,
                           resume_at=int(state.version) if resumed else -1)
    progress = Progress(config.train.steps, int(state.version),
                        enabled=None if config.train.progress and log is None and main else False)  # None: a tty
    log = log or (progress.write if main else (lambda line: None))
    for note in notes:
        log(note)
    if resumed:
        log(f"resumed from {workdir} at version {int(state.version)}")
        if changed:  # allowed by train.allow_changes (or free but worth saying), and recorded
            log("resumed with changes: " + "; ".join(changed))
            writer.write({"step": int(state.version), "config_changes": changed})
        saved = ckpt.runtime(int(state.version))
        if saved is not None:
            note = orch.load_runtime_state(saved)
        else:
            note = (f"no runtime state was saved with version {int(state.version)} (an older checkpoint, or "
                    "one from fewer processes): async samplers start their prompt streams from the beginning")
        if note:
            log(note)
    # Each process evaluates its share of the held-out set; the mean is over all of it.
    eval_prompts = task.eval_prompts()[distributed.index()::distributed.count()]

    def accuracy(params, sampler) -> float:
        local = warmstart.accuracy(distributed.to_local(params), sampler, task, eval_prompts, scorer=b["scorer"])
        total, n = distributed.host_sum(np.array([local * len(eval_prompts), len(eval_prompts)]))
        return float(total / n)

    def evaluate(state) -> dict:
        rec = {"eval/reward": accuracy(lrn.policy_params(state), b["greedy"])}
        if b["aux_eval"]:
            rec[f"eval/{lrn.aux.name}_reward"] = accuracy(state.aux.params, b["aux_greedy"])
        rec.update(step=int(state.version), time_s=time.time() - t_start)
        writer.write(rec)
        log(f"step {rec['step']} " + " ".join(f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("eval/")))
        return rec

    summary = {}
    if int(state.version) == 0:
        summary["eval/reward_start"] = evaluate(state)["eval/reward"]

    bad = {"run": 0, "skipped": int(state.skipped)}

    def stop_after_bad_steps(m):
        """Non-finite updates are skipped; `learner.max_bad_steps` steps in a row with a skipped
        update stop the run instead of training on forever."""
        skipped = int(m["skipped_updates"])
        bad["run"] = bad["run"] + 1 if skipped > bad["skipped"] else 0
        bad["skipped"] = skipped
        limit = config.learner.max_bad_steps
        if limit and bad["run"] >= limit:
            raise BadStepsError(
                f"{bad['run']} consecutive steps up to step {int(m['version'])} had a non-finite loss or gradient "
                f"(their updates were skipped); last good checkpoint: version {ckpt.latest_version()} in "
                f"{ckpt.directory}. Check the rewards, the learning rate and the data; raise "
                "--config.learner.max_bad_steps (0: never stop) to tolerate more")

    def on_metrics(m):
        stop_after_bad_steps(m)
        rec = {"step": int(m["version"]), "time_s": time.time() - t_start}
        rec.update({k: v for k, v in m.items() if isinstance(v, (int, float, list))})
        writer.write(rec)
        progress.update(rec["step"], m)
        if not progress.enabled:
            g = lambda k: m.get(k, float("nan"))  # noqa: E731  (an objective may log less)
            log(f"step {rec['step']:4d} reward={g('reward/mean'):.3f} loss={g('loss'):+.4f} "
                f"staleness={g('staleness/mean'):.2f} tok/s={g('tokens_per_s'):.0f}")
        grace.check()  # preempted: stop here, with this step trained and recorded

    grace = preemption.Grace(config.train.get("preempt_grace_s", 30.0))
    try:
        grace.install()
        while int(state.version) < config.train.steps:
            v, t = int(state.version), config.train
            todo = min(t.eval_every - v % t.eval_every, t.save_every - v % t.save_every, t.steps - v)
            state, _ = orch.run(state, todo, on_metrics)
            # On the save interval, and always at the end: the final state is kept whatever the interval.
            ckpt.save(state, force=int(state.version) == config.train.steps, runtime=orch.runtime_state())
            if int(state.version) % config.train.eval_every == 0 or int(state.version) == config.train.steps:
                summary["eval/reward"] = evaluate(state)["eval/reward"]
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (preemption) through `preemption.Grace`
        grace.start(e)
        state = orch.state or state  # `state` itself may have been donated mid-chunk
        log(f"interrupted ({grace.signal_name}) at version {int(state.version)}: saving a checkpoint")
        ckpt.save(state, force=True, runtime=orch.runtime_state())
        summary["interrupted_by"] = grace.signal_name
    finally:
        inflight = sys.exc_info()[1]  # an error already on its way out is the one to report
        grace.uninstall()
        progress.close()
        try:
            ckpt.close()
        except Exception:
            if inflight is None:
                raise
        finally:
            writer.close()
            orch.close()  # e.g. the remote mode's service
            b["scorer"].close()  # e.g. the math task's checker processes
            if hasattr(task, "close"):
                task.close()
            grace.cancel()
    summary.update(version=int(state.version), time_s=time.time() - t_start,
                   reward_failures=orch.reward_failures)
    return summary


def main(config, workdir: str) -> int:
    """The CLI's whole job after parsing flags: start the processes' runtime, run, print the
    summary; returns the exit code (128 + the signal after a preemption, saved and resumable:
    130 after Ctrl-C, 143 after SIGTERM)."""
    set_cpu_devices(config.cpu_devices)
    distributed.initialize(config.distributed)  # many processes, when asked; else a no-op
    summary = run(config, workdir)
    if distributed.is_main():
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    return 128 + signal.Signals[summary["interrupted_by"]].value if "interrupted_by" in summary else 0
