"""Assemble and run an experiment from a config: task, model, sampler, learner, runtime,
evaluation, metrics, checkpoints (resumed automatically from the workdir)."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from jaxrl_llm import learner as learner_lib
from jaxrl_llm import models, objectives
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.runtime import orchestrator
from jaxrl_llm.tasks import arithmetic, warmstart

TASKS = ("arithmetic",)


def validate(config) -> None:
    """Fail at startup, naming what to change."""
    if config.task.name not in TASKS:
        raise ValueError(f"unknown task {config.task.name!r}; valid: {', '.join(TASKS)}")
    obj = objectives.make_config(config.objective)
    orchestrator.validate(config.runtime)
    needs = learner_lib.required_passes(objectives.get(obj.name), obj)
    if needs & {"topk", "logp_at_behav_topk"} and config.sampler.capture_topk == 0:
        raise ValueError(f"objective {obj.name!r} reads behaviour top-k log-probs; set "
                         "--config.sampler.capture_topk to a positive K")
    if config.train.steps < 1 or config.train.eval_every < 1:
        raise ValueError("train.steps and train.eval_every must be >= 1")


def build(config):
    validate(config)
    task = arithmetic.Arithmetic(digits=config.task.digits, ops=config.task.ops, eval_size=config.task.eval_size)
    m = config.model
    if m.hf_path:
        params, mcfg = models.load_params(m.hf_path)
    else:
        mcfg = models.ModelConfig(vocab_size=arithmetic.VOCAB_SIZE, hidden_size=m.hidden_size,
                                  intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                                  num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                  dtype=m.dtype, eos_token_id=arithmetic.EOS)
        params = None
    s = config.sampler
    scfg = SamplerConfig(max_new_tokens=s.max_new_tokens or task.max_answer_len, temperature=s.temperature,
                         top_k=s.top_k, top_p=s.top_p, capture_topk=s.capture_topk, num_samples=s.num_samples,
                         eos_token_id=arithmetic.EOS, pad_token_id=arithmetic.PAD,
                         prompt_buckets=(task.max_prompt_len,))
    greedy = Sampler(mcfg, SamplerConfig(max_new_tokens=scfg.max_new_tokens, temperature=0.0,
                                         eos_token_id=arithmetic.EOS, pad_token_id=arithmetic.PAD,
                                         prompt_buckets=(task.max_prompt_len,)))
    config.learner.temperature = s.temperature
    lrn = learner_lib.Learner(mcfg, config.objective, config.learner, mesh_cfg=config.mesh)
    orch = orchestrator.Orchestrator(lrn, Sampler(mcfg, scfg), task, config.runtime)
    return task, mcfg, params, lrn, orch, greedy


class MetricsWriter:
    """One JSON object per line in WORKDIR/metrics.jsonl (appends on resume)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._f = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def run(config, workdir: str, log=print) -> dict:
    os.makedirs(workdir, exist_ok=True)
    t_start = time.time()
    task, mcfg, params, lrn, orch, greedy = build(config)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), save_every=config.train.save_every,
                        keep=config.train.keep)
    key = jax.random.key(config.seed)
    if ckpt.latest_version() is not None:
        state = lrn.place(ckpt.restore(lrn.init(key)))
        log(f"resumed from {workdir} at version {int(state.version)}")
    else:
        if params is None:
            params = models.init_params(mcfg, key)
            if config.warm_start.steps:
                w = config.warm_start
                params, _ = warmstart.warm_start(params, mcfg, task, w.steps, w.batch_size, w.lr, config.seed)
        state = lrn.init(key, params=params)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    writer = MetricsWriter(workdir)
    eval_prompts = task.eval_prompts()

    def evaluate(state):
        return warmstart.accuracy(state.params, greedy, task, eval_prompts)

    summary = {"eval/reward_start": evaluate(state)} if int(state.version) == 0 else {}
    if summary:
        writer.write({"step": 0, "eval/reward": summary["eval/reward_start"], "time_s": time.time() - t_start})
        log(f"step 0 eval/reward={summary['eval/reward_start']:.3f}")

    def on_metrics(m):
        rec = {"step": int(m["version"]), "time_s": time.time() - t_start}
        rec.update({k: v for k, v in m.items() if isinstance(v, (int, float, list))})
        writer.write(rec)
        log(f"step {rec['step']:4d} reward={m['reward/mean']:.3f} loss={m['loss']:+.4f} "
            f"staleness={m['staleness/mean']:.2f} tok/s={m['tokens_per_s']:.0f}")

    try:
        while int(state.version) < config.train.steps:
            todo = min(config.train.eval_every - int(state.version) % config.train.eval_every,
                       config.train.steps - int(state.version))
            state, _ = orch.run(state, todo, on_metrics)
            ckpt.save(state)
            if int(state.version) % config.train.eval_every == 0 or int(state.version) == config.train.steps:
                r = evaluate(state)
                writer.write({"step": int(state.version), "eval/reward": r, "time_s": time.time() - t_start})
                log(f"step {int(state.version)} eval/reward={r:.3f}")
                summary["eval/reward"] = r
    except KeyboardInterrupt:
        state = orch.state or state  # `state` itself may have been donated mid-chunk
        log(f"interrupted at version {int(state.version)}: saving a checkpoint")
        ckpt.save(state, force=True)
    finally:
        ckpt.close()
        writer.close()
    summary.update(version=int(state.version), time_s=time.time() - t_start)
    return summary
