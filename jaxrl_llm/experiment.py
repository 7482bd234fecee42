"""Assemble and run an experiment from a config: task, model, sampler, learner, runtime,
evaluation, metrics, checkpoints (resumed automatically from the workdir)."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import learner as learner_lib
import ml_collections

from jaxrl_llm import checkpoint, distributed, memory, models, objectives, paths, preemption, sharding, tasks
from jaxrl_llm import validation as V
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.metrics import MetricsWriter, Progress
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.runtime import orchestrator
from jaxrl_llm.tasks import warmstart

_MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def model_config(**over):
    """`model` section. hf_path: a local Hugging Face directory (config.json + safetensors);
    empty -> a random model of these sizes (the embedded task warm-starts it)."""
    c = ml_collections.ConfigDict(dict(hf_path="", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                       num_kv_heads=2, head_dim=16,
                                       dtype="float32",  # compute (and sampler weights); master weights stay float32
                                       attention="auto",  # models/decoder.py: attention
                                       remat="none"))  # none | full | dots: decoder layers recomputed in backward
    c.update(over)
    return c


def aux_model_config():
    """`aux_model`: a second model for objectives that train one (e.g. Jackpot's rollout
    actor): hf_path, or a random model of hidden_size > 0; off (all 0) by default."""
    return model_config(hidden_size=0, intermediate_size=0, num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0)


def train_config():
    """`train`. resume: auto continues from the newest readable checkpoint in the workdir
    (damaged newer ones are reported and moved aside); fresh moves the checkpoints aside and
    starts over. preempt_grace_s: after SIGTERM / Ctrl-C, the seconds the final save may take."""
    return ml_collections.ConfigDict(dict(steps=300, eval_every=50, save_every=50, keep=2, tensorboard=True,
                                          progress=True, resume="auto", preempt_grace_s=30.0,
                                          check_memory=True))  # refuse a memory plan beyond what is available


MODEL_RULES = {"hf_path": V.anything(),  # paths.py
               "hidden_size": V.integer(1), "intermediate_size": V.integer(1), "num_layers": V.integer(1),
               "num_heads": V.integer(1), "num_kv_heads": V.integer(1), "head_dim": V.integer(1),
               "dtype": V.one_of(*models.config.DTYPES), "attention": V.one_of(*models.config.ATTENTION),
               "remat": V.one_of(*models.config.REMAT)}
AUX_MODEL_RULES = {**{k: V.integer(0) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                  "num_kv_heads", "head_dim")},
                   "hf_path": V.anything(), "dtype": V.one_of(*models.config.DTYPES),
                   "attention": V.one_of(*models.config.ATTENTION),
                   "remat": V.one_of(*models.config.REMAT)}  # 0: no second model
TRAIN_RULES = {"steps": V.integer(1), "eval_every": V.integer(1), "save_every": V.integer(1), "keep": V.integer(1),
               "tensorboard": V.boolean(), "progress": V.boolean(), "resume": V.one_of("auto", "fresh"),
               "preempt_grace_s": V.positive(), "check_memory": V.boolean()}
TOP_RULES = {"seed": V.integer(0), "cpu_devices": V.integer(0, extra=(-1,))}


def config_rules() -> dict:
    """Every declared constraint of the experiment config, by full dotted key."""
    from jaxrl_llm.objectives.registry import RULES as OBJECTIVE_RULES
    from jaxrl_llm.rollout import sampling
    sections = {"task": tasks.RULES, "model": MODEL_RULES, "aux_model": AUX_MODEL_RULES,
                "warm_start": warmstart.RULES, "sampler": sampling.RULES, "objective": OBJECTIVE_RULES,
                "learner": learner_lib.RULES, "runtime": orchestrator.RULES, "mesh": sharding.RULES,
                "distributed": distributed.RULES, "train": TRAIN_RULES}
    out = dict(TOP_RULES)
    for name, rules in sections.items():
        out.update(V.flatten(rules, name + "."))
    return out


class BadStepsError(RuntimeError):
    """Too many consecutive training steps with non-finite loss or gradients."""


def validate(config) -> None:
    """Fail at start-up, before any model is built, naming every problem: first each field
    against its declared constraint (`config_rules`), then the cross-field rules and the
    local paths, all collected into one error."""
    V.raise_all(V.check(config, config_rules()))
    problems = []

    def collect(fn, *args):
        try:
            return fn(*args)
        except ValueError as e:
            problems.append(str(e))

    collect(tasks.validate, config.task, config.model.hf_path)
    obj = collect(objectives.make_config, config.objective)
    collect(orchestrator.validate, config.runtime)
    if obj is not None:
        needs = objectives.required_passes(obj)
        if needs & {"topk", "logp_at_behav_topk"} and config.sampler.capture_topk == 0:
            problems.append(f"objective {obj.name!r} reads behaviour top-k log-probs; set "
                            "--config.sampler.capture_topk to a positive K")
        aux = objectives.get(obj.name).aux
        if _has_aux_model(config) and not (aux and aux.needs_model):
            with_model = [n for n in objectives.with_aux() if objectives.get(n).aux.needs_model]
            problems.append(f"config.aux_model sets a second model, but objective {obj.name!r} trains none; "
                            f"objectives that do: {', '.join(with_model) or 'none'} (or set "
                            "--config.aux_model.hidden_size=0 and --config.aux_model.hf_path='')")
    if config.runtime.staleness_policy == "admit" and config.sampler.batching != "continuous":
        problems.append("runtime.staleness_policy='admit' holds prompts back from decode slots: it needs "
                        "--config.sampler.batching=continuous")
    rows = config.runtime.prompts_per_batch * config.sampler.num_samples * distributed.count()
    if rows % config.learner.num_minibatches:
        problems.append(f"learner.num_minibatches={config.learner.num_minibatches} does not divide the batch's "
                        f"{rows} rows (runtime.prompts_per_batch x sampler.num_samples"
                        + (" x processes)" if distributed.count() > 1 else ")"))
    for name in ("model", "aux_model"):
        m = config[name]
        if not m.hf_path and m.num_kv_heads and m.num_heads % m.num_kv_heads:
            problems.append(f"{name}.num_heads={m.num_heads} is not a multiple of {name}.num_kv_heads={m.num_kv_heads}")
    try:
        sharding.make_mesh(config.mesh, devices(config)[0])
    except ValueError as e:
        problems.append(f"mesh / runtime.sampler_devices: {e}")
    collect(paths.check, config)
    V.raise_all(problems, what="config problem")


def devices(config):
    """(learner devices, this process's sampler devices): `runtime.sampler_devices` = n > 0
    gives each process's last n devices to its samplers and the rest of every process's to
    the learner's mesh; 0 shares them. Samplers only ever use their own process's devices."""
    n, local = config.runtime.sampler_devices, jax.local_devices()
    if n == 0:
        return jax.devices(), local
    if n >= len(local):
        raise ValueError(f"runtime.sampler_devices={n} leaves no device for the learner: {len(local)} "
                         "available (on CPU, set --config.cpu_devices, e.g. -1 for one device per core)")
    by_process = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    return [d for p in sorted(by_process) for d in by_process[p][:-n]], local[-n:]


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


def _has_aux_model(config) -> bool:
    return bool(config.aux_model.hf_path or config.aux_model.hidden_size)


def _model_cfg(m, task) -> models.ModelConfig:
    """The decoder of model section `m`: a local HF checkpoint's config.json (read, nothing
    loaded) or a random model sized by `m`; compute dtype, attention kernel and remat from `m`."""
    chosen = dict(dtype=m.dtype, attention=m.attention, remat=m.remat)
    if m.hf_path:
        cfg = models.load_config(m.hf_path)
        if task.vocab_size > cfg.vocab_size:
            raise ValueError(f"the task's tokenizer has {task.vocab_size} tokens but {m.hf_path!r} embeds only "
                             f"{cfg.vocab_size}")
        return cfg.replace(**chosen)
    return models.ModelConfig(vocab_size=task.vocab_size, eos_token_id=task.eos_id, **chosen,
                              **{f: m[f] for f in _MODEL_FIELDS})


def _load(m, cfg):
    """The checkpoint's weights (float32 master copies) or None for a random model."""
    return models.load_params(m.hf_path, cfg)[0] if m.hf_path else None


def _sampler_cfg(config, task, greedy=False):
    s = config.sampler
    kw = dict(max_new_tokens=s.max_new_tokens or task.max_answer_len, eos_token_id=task.eos_id,
              pad_token_id=task.pad_id, prompt_buckets=tuple(task.prompt_buckets),
              cache_dtype=s.cache_dtype if s.cache_dtype != "auto" else config.model.dtype)
    if greedy:
        return SamplerConfig(temperature=0.0, **kw)
    return SamplerConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, capture_topk=s.capture_topk,
                         num_samples=s.num_samples, batching=s.batching, slots=s.slots,
                         decode_segment=s.decode_segment, **kw)


def build(config):
    validate(config)
    config = paths.resolved(config)  # hub ids -> local snapshot directories (the caller's config is untouched)
    task = tasks.make(config.task, config.model.hf_path)
    mcfg = _model_cfg(config.model, task)
    acfg = _model_cfg(config.aux_model, task) if _has_aux_model(config) else None
    plan = memory.run_plan(config, task, mcfg, acfg)
    memory.check_run(config, task, mcfg, acfg, plan)  # before any weight is loaded or program compiled
    params, aux_params = _load(config.model, mcfg), acfg and _load(config.aux_model, acfg)
    learner_devices, sampler_devices = devices(config)
    lrn = learner_lib.Learner(mcfg, config.objective, config.learner, mesh=sharding.make_mesh(config.mesh, learner_devices),
                              mesh_cfg=config.mesh, aux_model_cfg=acfg, dist=_sampler_cfg(config, task).dist)
    # Samplers split rows over their devices (data parallel); with devices of their own, the
    # weight store publishes each version onto them.
    mesh = Mesh(np.asarray(sampler_devices), ("data",))
    own = config.runtime.sampler_devices or distributed.count() > 1  # samplers hold copies of their own
    placement = NamedSharding(mesh, PartitionSpec()) if own else None
    orch = orchestrator.Orchestrator(lrn, Sampler(lrn.rollout_model_cfg, _sampler_cfg(config, task), mesh), task,
                                     config.runtime, placement=placement)
    # A sampling auxiliary (a rollout model) is evaluated beside the policy; any auxiliary may be warm-started.
    return dict(task=task, model_cfg=mcfg, params=params, memory_plan=plan, aux_cfg=acfg, aux_params=aux_params,
                learner=lrn, orchestrator=orch, greedy=Sampler(mcfg, _sampler_cfg(config, task, greedy=True), mesh),
                aux_greedy=acfg and Sampler(acfg, _sampler_cfg(config, task, greedy=True), mesh),
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
    t_start = time.time()
    b = build(config)
    task, lrn, orch = b["task"], b["learner"], b["orchestrator"]
    ckdir, notes = os.path.join(workdir, "checkpoints"), []
    have, what = memory.available()
    notes.append(f"memory plan (GiB): {memory.describe(b['memory_plan'])}; {what}: {have / memory.GB:.1f} GiB")
    if config.train.get("resume", "auto") == "fresh" and distributed.is_main():
        aside = checkpoint.move_all_aside(ckdir)
        if aside:
            notes.append(f"starting afresh: earlier checkpoints moved to {aside}")
    distributed.agree(0)  # nobody opens the directory while process 0 moves it
    ckpt = Checkpointer(ckdir, save_every=config.train.save_every, keep=config.train.keep)
    key = jax.random.key(config.seed)
    restored = ckpt.restore_newest_readable(lrn.abstract_state(), log=notes.append)
    resumed = restored is not None
    loaded, loaded_aux = b.pop("params"), b.pop("aux_params")  # dropped once the learner holds its copy
    if resumed:
        state = lrn.place(restored)
    else:
        params = _initial_params(config, loaded, b["model_cfg"], task, key, b["greedy"], notes)
        aux = (_initial_params(config, loaded_aux, b["aux_cfg"], task, jax.random.fold_in(key, 1),
                               b["aux_greedy"], notes, role="actor")
               if b["aux_cfg"] else None)
        state = lrn.init(key, params=params, aux_params=aux)
        del params, aux
    del loaded, loaded_aux, restored
    main = distributed.is_main()  # process 0 alone writes and prints
    if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
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
        local = warmstart.accuracy(distributed.to_local(params), sampler, task, eval_prompts)
        total, n = distributed.host_sum(np.array([local * len(eval_prompts), len(eval_prompts)]))
        return float(total / n)

    def evaluate(state) -> dict:
        rec = {"eval/reward": accuracy(state.params, b["greedy"])}
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
            if hasattr(task, "close"):  # e.g. the math task's scoring process
                task.close()
            grace.cancel()
    summary.update(version=int(state.version), time_s=time.time() - t_start,
                   reward_failures=orch.reward_failures)
    return summary
