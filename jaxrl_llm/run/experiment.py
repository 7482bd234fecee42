"""Run an experiment from a config: its parts (`parts.build`), resumed from the workdir's
newest checkpoint or started afresh, trained in chunks between evaluations and saves, stopped
cleanly on Ctrl-C or SIGTERM (saved, resumable), and closed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

import jax
import ml_collections
import numpy as np

from jaxrl_llm import models, validation
from jaxrl_llm.models import adapters as peft_adapters
from jaxrl_llm.parallel import distributed, preemption
from jaxrl_llm.run import memory, paths, tracking, xla
from jaxrl_llm.run.metrics import MetricsWriter, Progress
from jaxrl_llm.run.parts import Parts, build, initial_params  # noqa: F401  (build: the run's parts, public here)
from jaxrl_llm.store import checkpoint, frozen_base
from jaxrl_llm.store import workdir as workdir_lib
from jaxrl_llm.store.checkpoint import Checkpointer
from jaxrl_llm.rollout import backend as rollout_backend
from jaxrl_llm.tasks import evaluation, splits, warmstart


COMPILE_CACHE = "xla_cache"  # under the workdir: JAX's persistent cache, so a restart compiles nothing slow again


class BadStepsError(validation.Refused):
    """Too many consecutive training steps with non-finite loss or gradients."""


def run(config, workdir: str, log=None) -> dict:
    """Train `config` in `workdir` (resuming from its checkpoints) and return a summary.
    `log(line)` receives progress lines; by default they go beside a tqdm bar on a terminal."""
    paths.check(config, workdir)  # before anything is built or written
    os.makedirs(workdir, exist_ok=True)
    lock = _hold(workdir)
    try:
        with contextlib.ExitStack() as stack:
            precision = config.model.get("matmul_precision", "default")  # a bad value is refused by name in `build`
            stack.enter_context(xla.matmul_precision(precision if precision in models.config.PRECISIONS else "default"))
            if config.train.get("compile_cache", True):  # one directory per process: no two write one entry
                stack.enter_context(xla.compilation_cache(
                    os.path.join(workdir, COMPILE_CACHE, f"process_{distributed.index()}"), min_compile_s=1.0))
            return _run(config, workdir, log, stack.enter_context(xla.CompileLog()))
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
    busy = _agreed(busy, f"{workdir} is held by another run (process 0 found its lock)")
    if busy:
        raise workdir_lib.WorkdirBusy(busy)
    return lock


def _agreed(problem: str, elsewhere: str) -> str:
    """Process 0's refusal on every process (`elsewhere`: what the others say of it), so that
    all of them stop together; '' when there is none."""
    if distributed.count() > 1 and int(np.max(distributed.agree(1 if problem else 0))):
        return problem or elsewhere
    return problem


def _run(config, workdir: str, log, compiles: xla.CompileLog) -> dict:
    t_start = time.time()
    b = build(config)
    user_config, config = config, b.plan.config  # from here on the resolved, immutable one
    have, what = memory.available()
    line, warning = distributed.backend_line()
    need = memory.need(b.memory_plan, b.plan.memory_layout)
    notes = [line, f"memory plan (GiB per device): {memory.describe(b.memory_plan)}; needs {need / memory.GB:.2f} "
             f"of {what}: {have / memory.GB:.1f} GiB"] + ([f"warning: {warning}"] if warning else [])
    notes.extend(f"warning: {w}" for w in b.plan.warnings)
    m = b.model_cfg
    if m.num_experts:
        notes.append(f"mixture of experts: {m.num_experts} experts, top {m.num_experts_per_tok}; "
                     f"{m.num_params / 1e6:.1f}M parameters, {m.active_params / 1e6:.1f}M active per token")
        rollout = b.orchestrator.sampler
        if getattr(rollout, "splits_experts", False):  # sampler.expert_parallel
            n = rollout.row_devices
            notes.append(f"samplers: each of {n} devices holds {m.num_experts // n} of every layer's experts")
    if b.plan.sampler.tensor > 1:
        notes.append(f"samplers: tensor parallel, each group of {b.plan.sampler.tensor} devices splits every layer's "
                     "heads, KV cache, MLP width and vocabulary")
    ckpt = _checkpointer(config, workdir, notes)
    state, resumed, changed, shape = _resume_or_init(b, user_config, workdir, ckpt, notes)
    _record_start(b, workdir, resumed)
    b = b.without_weights()  # the learner holds its own copy now
    out = _Output(b, user_config, workdir, state, resumed, log, compiles)
    out.start(notes, ckpt, state, resumed, changed, shape)
    evaluate = _Evaluator(b, out, t_start)
    summary = {}
    if int(state.version) == 0:
        summary["eval/reward_start"] = evaluate(state)["eval/reward"]
    state = _train(b, state, ckpt, out, evaluate, summary, t_start)
    summary.update(version=int(state.version), time_s=time.time() - t_start,
                   reward_failures=b.orchestrator.reward_failures, compile_s=sum(compiles.total.values()))
    if compiles.total:
        out.log("longest compiles: " + ", ".join(f"{name} {s:.1f} s" for name, s in compiles.slowest(5)))
    return summary


def _record_start(b: Parts, workdir: str, resumed: bool) -> None:
    """Process 0 records which problems evaluation uses (`workdir.check_eval_set`, refusing a
    resume that would evaluate on others: every process stops with it) and the policy that
    `python -m jaxrl_llm.export` writes out besides the checkpoints."""
    config, eval_set, main = b.plan.config, getattr(b.task, "eval_set", None), distributed.is_main()
    problem = workdir_lib.check_eval_set(workdir, eval_set, resumed) if eval_set and main else ""
    problem = _agreed(problem, "process 0 refused to resume: see its log")
    if problem:
        raise ValueError(problem)
    if main:
        tokenizer = (config.task.tokenizer or config.model.hf_path) if hasattr(b.task, "tokenizer") else ""
        policy = b.model_cfg.without_lora().replace(eos_token_id=b.plan.played.eos_id)  # the played task's end
        workdir_lib.record_policy(workdir, dataclasses.asdict(policy), tokenizer)


def _checkpointer(config, workdir: str, notes: list) -> Checkpointer:
    """The run's checkpoints; with `train.resume=fresh`, earlier ones moved aside first."""
    ckdir = os.path.join(workdir, "checkpoints")
    if config.train.get("resume", "auto") == "fresh" and distributed.is_main():
        aside = checkpoint.move_all_aside(ckdir)
        if aside:
            notes.append(f"starting afresh: earlier checkpoints moved to {aside}")
    distributed.agree(0)  # nobody opens the directory while process 0 moves it
    return Checkpointer(ckdir, save_every=config.train.save_every, keep=config.train.keep)


def as_recorded(user_config, resolved):
    """The user's config as the workdir's history compares it: `auto` dtypes as they resolved
    on this platform (a run moved from CPU to GPU changes its numerics; one that only upgraded
    to the `auto` default does not)."""
    out = ml_collections.ConfigDict(user_config.to_dict())
    for section in ("model", "aux_model"):
        if section in out:
            out[section].dtype = resolved[section].dtype
    return out


def _resume_or_init(b: Parts, user_config, workdir: str, ckpt: Checkpointer, notes: list):
    """The learner's state: the newest readable checkpoint (its LoRA base from the workdir's
    record) or a new one from the loaded or warm-started weights. Returns (state, resumed,
    the config changes since the saved run, the model's shape record)."""
    config, lrn, mcfg = b.plan.config, b.learner, b.model_cfg
    key, lora = jax.random.key(config.seed), bool(mcfg.lora_rank)
    saved = ckpt.manager.all_steps()
    frozen_base.check_resumable(workdir, mcfg, bool(saved))
    shape = {k: getattr(mcfg, k) for k in workdir_lib.MODEL_KEYS}
    changed = workdir_lib.check_resume(workdir, as_recorded(user_config, config), shape, max(saved)) if saved else []
    restored = ckpt.restore_newest_readable(lrn.abstract_state(), log=notes.append)
    if restored is not None:
        if lora:  # the adapters' frozen base: referenced by the workdir, not in the checkpoint
            lrn.hold_base(frozen_base.restore(workdir, config.model.hf_path, b.params, mcfg))
        return lrn.place(restored), True, changed, shape
    params = initial_params(config, b.params, mcfg.without_lora(), b.task, key, b.greedy, notes)
    aux = (initial_params(config, b.aux_params, b.aux_cfg, b.task, jax.random.fold_in(key, 1), b.aux_greedy, notes,
                          role="actor") if b.aux_cfg else None)
    adapters = None
    if lora:
        frozen_base.record(workdir, config.model.hf_path, params, mcfg)
        if config.model.lora.init_from:
            adapters = peft_adapters.load(config.model.lora.init_from, mcfg)
            notes.append(f"LoRA adapters start from {config.model.lora.init_from}")
    return lrn.init(key, params=params, aux_params=aux, adapters=adapters), False, changed, shape


class _Output:
    """Where the run reports: the workdir's records, the metrics writer, the progress bar and
    `log` (process 0 alone writes and prints)."""

    def __init__(self, b: Parts, user_config, workdir: str, state, resumed: bool, log, compiles: xla.CompileLog):
        self.config = config = b.plan.config
        self.main, self.compiles = distributed.is_main(), compiles
        self.user_config, self.workdir, self.orchestrator = user_config, workdir, b.orchestrator
        self.progress = Progress(config.train.steps, int(state.version),  # None: a terminal decides
                                 enabled=None if config.train.progress and log is None and self.main else False)
        self.log = log or (self.progress.write if self.main else (lambda line: None))
        logging_c = tracking.section(config)
        trackers = tracking.Trackers(logging_c, workdir, workdir_lib.public(user_config), self.log, self.main)
        # Records past the restored version (or all, starting afresh) belong to a run that died.
        self.writer = MetricsWriter(workdir, tensorboard=tracking.tensorboard(logging_c, config.train.tensorboard),
                                    enabled=self.main, resume_at=int(state.version) if resumed else -1,
                                    also=trackers)

    def start(self, notes: list, ckpt: Checkpointer, state, resumed: bool, changed: list, shape: dict) -> None:
        """The workdir's config and history records, the start-up notes, and a resume's runtime state."""
        if self.main:
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                json.dump(workdir_lib.public(self.user_config), f, indent=2)  # as the user ran it, secrets redacted
            workdir_lib.record(self.workdir, as_recorded(self.user_config, self.config), shape, int(state.version),
                               changed if resumed else [])
        for note in notes:
            self.log(note)
        if not resumed:
            return
        self.log(f"resumed from {self.workdir} at version {int(state.version)}")
        if changed:  # allowed by train.allow_changes (or free but worth saying), and recorded
            self.log("resumed with changes: " + "; ".join(changed))
            self.writer.write({"step": int(state.version), "config_changes": changed})
        saved = ckpt.runtime(int(state.version))
        note = (self.orchestrator.load_runtime_state(saved) if saved is not None else
                f"no runtime state was saved with version {int(state.version)} (an older checkpoint, or one from "
                "fewer processes): async samplers start their prompt streams from the beginning")
        if note:
            self.log(note)


class _Evaluator:
    """`evaluate(state)`: the greedy reward on the held-out set (each process its share; the mean
    is over all of it), of the policy and of a sampling auxiliary, written and logged."""

    def __init__(self, b: Parts, out: _Output, t_start: float):
        self.b, self.out, self.t_start = b, out, t_start
        problems = b.task.eval_prompts()
        self.prompts = problems[distributed.index()::distributed.count()]
        eval_set = getattr(b.task, "eval_set", None)  # which split, so no record is read as held out wrongly
        self.about = {"eval/problems": len(problems), **({"eval_set": splits.describe(eval_set)} if eval_set else {})}
        n, greedy = b.plan.config.train.get("eval_samples", 0), b.plan.greedy
        # at the sampler's settings, on the played task's prompts and ends (an agent run's training
        # sampler stops at each chat turn)
        self.drawer = n and rollout_backend.make(b.model_cfg.for_sampling(), dataclasses.replace(
            b.plan.sampler, num_samples=n, capture_topk=0, eos_token_id=greedy.eos_token_id,
            turn_stop_ids=greedy.turn_stop_ids, prompt_buckets=greedy.prompt_buckets), getattr(b.greedy, "mesh", None))
        self.ks = tuple(sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n} | {n}))

    def sampled(self, params, local: bool) -> dict:
        """`train.eval_samples` samples per held-out problem at the sampler's settings (the same
        key at every evaluation): pass@k, maj@k, their mean reward, lengths; over every process."""
        params = params if local else distributed.to_local(params)
        task = self.b.plan.played
        d = evaluation.draw(self.drawer, params, task, self.b.scorer, self.prompts,
                            jax.random.key(self.b.plan.config.seed + 1))
        r = evaluation.report(d, self.ks, evaluation.success_threshold(task))
        keys = [k for k in r if k.startswith(("pass@", "maj@")) or k in ("reward", "length/mean", "truncated")]
        sums = distributed.host_sum(np.array([r[k] * len(self.prompts) for k in keys] + [len(self.prompts)]))
        names = {"reward": "sampled_reward", "length/mean": "sampled_length", "truncated": "sampled_truncated"}
        return {f"eval/{names.get(k, k)}": float(s / sums[-1]) for k, s in zip(keys, sums[:-1])}

    def accuracy(self, params, sampler, local: bool = False) -> float:
        """`local`: `params` are this process's already (a published copy), not the learner's."""
        params = params if local else distributed.to_local(params)
        mine = warmstart.accuracy(params, sampler, self.b.plan.played, self.prompts, scorer=self.b.scorer)
        total, n = distributed.host_sum(np.array([mine * len(self.prompts), len(self.prompts)]))
        return float(total / n)

    def published(self, state):
        """The samplers' copy of the policy at this version (compute dtype, on their devices, LoRA
        merged), when the store holds it and the policy is what samples: no gather of the float32
        masters per evaluation. Every process publishes every version, so all agree."""
        lrn = self.b.learner
        if lrn.aux is not None and lrn.aux.samples:
            return None
        try:
            return self.b.orchestrator.store.get(int(state.version))
        except LookupError:  # not published yet (the first evaluation)
            return None

    def __call__(self, state) -> dict:
        b = self.b
        copy = self.published(state)
        params, local = (b.learner.policy_params(state), False) if copy is None else (copy, True)
        rec = {"eval/reward": self.accuracy(params, b.greedy, local)}
        if self.drawer:
            rec.update(self.sampled(params, local))
        if b.aux_eval:
            rec[f"eval/{b.learner.aux.name}_reward"] = self.accuracy(state.aux.params, b.aux_greedy)
        rec.update(self.about, step=int(state.version), time_s=time.time() - self.t_start)
        self.out.writer.write(rec)
        self.out.log(f"step {rec['step']} " + " ".join(f"{k}={v:.3f}" for k, v in rec.items()
                                                        if k.startswith("eval/") and k != "eval/problems"))
        return rec


class _StepRecords:
    """`on_metrics(m)` for each trained step: written, shown, checked for a run of bad steps
    (`learner.max_bad_steps` steps in a row with a skipped update stop the run instead of
    training on forever), and a preemption honoured with the step recorded."""

    def __init__(self, config, out: _Output, ckpt: Checkpointer, grace, skipped: int, t_start: float, version: int):
        self.limit, self.out, self.ckpt, self.grace = config.learner.max_bad_steps, out, ckpt, grace
        self.t_start, self.run, self.skipped = t_start, 0, skipped
        # Watched from version 0 only: a resumed run does not know its first batches' rewards.
        self.zero_steps = config.task.zero_reward_steps if version == 0 else 0

    def __call__(self, m) -> None:
        skipped = int(m["skipped_updates"])
        self.run, self.skipped = (self.run + 1 if skipped > self.skipped else 0), skipped
        if self.limit and self.run >= self.limit:
            raise BadStepsError(
                f"{self.run} consecutive steps up to step {int(m['version'])} had a non-finite loss or gradient "
                f"(their updates were skipped); last good checkpoint: version {self.ckpt.latest_version()} in "
                f"{self.ckpt.directory}. Check the rewards, the learning rate and the data; raise "
                "--config.learner.max_bad_steps (0: never stop) to tolerate more")
        rec = {"step": int(m["version"]), "time_s": time.time() - self.t_start}
        rec.update({k: v for k, v in m.items() if isinstance(v, (int, float, list))})
        rec.update(self.out.compiles.drain())  # XLA compilations since the last step (any thread)
        self.out.writer.write(rec)
        self._watch_zero_rewards(rec["step"], m.get("reward/nonzero", 1.0))
        self.out.progress.update(rec["step"], m)
        if not self.out.progress.enabled:
            g = lambda k: m.get(k, float("nan"))  # noqa: E731  (an objective may log less)
            self.out.log(f"step {rec['step']:4d} reward={g('reward/mean'):.3f} loss={g('loss'):+.4f} "
                         f"staleness={g('staleness/mean'):.2f} tok/s={g('tokens_per_s'):.0f}")
        self.grace.check()  # preempted: stop here, with this step trained and recorded

    def _watch_zero_rewards(self, step: int, nonzero: float) -> None:
        """Warn once (log and records) when every sample of the first `task.zero_reward_steps`
        batches scored exactly 0: the run would train on zero advantages for its whole length."""
        if not self.zero_steps:
            return
        if nonzero > 0:
            self.zero_steps = 0  # a signal arrived: disarmed
        elif step >= self.zero_steps:
            warning = (f"every sample of the first {self.zero_steps} batches scored exactly 0, so the policy gets no "
                       "learning signal. Likely causes: the answer format (the gold answers' or what task.instruction "
                       "asks for), completions cut before their answer (sampler.max_new_tokens, task.max_answer_len), "
                       "or the chat template (task.chat_template); set task.zero_reward_steps=0 to silence this")
            self.out.writer.write({"step": step, "warning": warning})
            self.out.log(f"warning: {warning}")
            self.zero_steps = 0


def _train(b: Parts, state, ckpt: Checkpointer, out: _Output, evaluate, summary: dict, t_start: float):
    """Train to `train.steps` in chunks that end on save and eval intervals; on Ctrl-C or
    SIGTERM save and return; in every case close what the run opened. Returns the last state."""
    config, orch = b.plan.config, b.orchestrator
    grace = preemption.Grace(config.train.get("preempt_grace_s", 30.0))
    on_metrics = _StepRecords(config, out, ckpt, grace, int(state.skipped), t_start, int(state.version))
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
        out.log(f"interrupted ({grace.signal_name}) at version {int(state.version)}: saving a checkpoint")
        ckpt.save(state, force=True, runtime=orch.runtime_state())
        summary["interrupted_by"] = grace.signal_name
    finally:
        _finish(b, ckpt, out, grace, inflight=sys.exc_info()[1])
    return state


def _finish(b: Parts, ckpt: Checkpointer, out: _Output, grace, inflight) -> None:
    """Close what the run opened; a failure while closing is raised only when no error is
    already on its way out (that one is the one to report)."""
    grace.uninstall()
    out.progress.close()
    try:
        ckpt.close()
    except Exception:
        if inflight is None:
            raise
    finally:
        out.writer.close()
        b.orchestrator.close()  # e.g. the remote mode's service
        b.scorer.close()  # e.g. the math task's checker processes
        if hasattr(b.task, "close"):
            b.task.close()
        grace.cancel()


def main(config, workdir: str) -> int:
    """The CLI's whole job after parsing flags: start the processes' runtime, run, print the
    summary; returns the exit code (128 + the signal after a preemption, saved and resumable:
    130 after Ctrl-C, 143 after SIGTERM)."""
    xla.set_cpu_devices(config.cpu_devices)
    xla.set_deterministic(config.train.get("deterministic", False))
    distributed.initialize(config.distributed)  # many processes, when asked; else a no-op
    summary = run(config, workdir)
    if distributed.is_main():
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    return 128 + signal.Signals[summary["interrupted_by"]].value if "interrupted_by" in summary else 0
