"""Evaluate a policy, a run's checkpoint or a Hugging Face directory, on a task: `n` samples per
problem at the run's sampling settings (or given ones) plus a greedy pass, reported as mean
reward, pass@k, maj@k, response lengths and truncation (`tasks.evaluation`), written to `eval.json`
and `eval.md` (`docs/evaluation.md`).

The task and sampling settings come from `config` when one is given, else from the run's own
`<workdir>/config.json`, else the defaults (the embedded arithmetic task).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Optional

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm import models, tasks
from jaxrl_llm.tasks import evaluation as sampled
from jaxrl_llm.rollout import backend, sampling
from jaxrl_llm.run import config as config_lib
from jaxrl_llm.run import plan
from jaxrl_llm.store import policy as policy_lib
from jaxrl_llm.tasks import multiturn, splits


@dataclasses.dataclass(frozen=True)
class Request:
    """What to evaluate and how (the command line's flags)."""

    workdir: str = ""  # a run (its newest checkpoint, or `version`) ...
    version: Optional[int] = None
    hf_path: str = ""  # ... or a Hugging Face directory
    n: int = 8  # samples per problem
    ks: tuple = (1, 2, 4, 8)  # pass@k / maj@k for each k <= n
    temperature: Optional[float] = None  # None: the config's sampler settings
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_new_tokens: int = 0  # 0: the config's (else the task's answer length)
    greedy: bool = True  # also the greedy reward (one sample at temperature 0)
    split: str = ""  # the dataset split (task.eval_split); empty: the config's
    size: int = 0  # problems (task.eval_size); 0: the config's
    seed: int = 0
    chunk: int = 64  # problems per generate call
    success: Optional[float] = None  # a sample succeeds at this reward (None: the task's highest)
    out: str = ""  # where eval.json and eval.md go (default: <workdir>/eval/v<version>)
    overwrite: bool = False


def sections(req: Request, config=None) -> ml_collections.ConfigDict:
    """The task, sampler and model sections: the defaults, updated with `config`'s (or the run's
    recorded config), then with the request's split and size."""
    c = ml_collections.ConfigDict(dict(task=tasks.default_config(), sampler=sampling.default_config(),
                                       model=config_lib.model_config()))
    given = config.to_dict() if config is not None else _recorded(req.workdir)
    for name in ("task", "sampler", "model"):
        known = {k: v for k, v in given.get(name, {}).items() if k in c[name] and not isinstance(c[name][k],
                                                                                                   ml_collections.ConfigDict)}
        c[name].update(known)
    if req.split:
        if c.task.name not in ("math", "math_tools"):
            raise ValueError(f"--split={req.split!r} picks a dataset split; task {c.task.name!r} generates its "
                             "problems (its evaluation set is fixed by its seed)")
        c.task.update(eval_split=req.split, eval_holdout=0.0)
    if req.size:
        c.task.eval_size = req.size
    return c


def _recorded(workdir: str) -> dict:
    path = os.path.join(workdir, "config.json") if workdir else ""
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def source(req: Request, c) -> policy_lib.Policy:
    """The weights and model to evaluate: the run's checkpoint, or the HF directory's."""
    if bool(req.workdir) == bool(req.hf_path):
        raise ValueError("evaluate one policy: pass --workdir (a run, with --version) or --hf_path (an HF directory)")
    dtype = plan.auto_dtype() if c.model.dtype == "auto" else c.model.dtype
    if req.workdir:
        p = policy_lib.load(req.workdir, req.version)
        return dataclasses.replace(p, cfg=p.cfg.replace(dtype=dtype))
    cfg = models.load_config(req.hf_path).replace(dtype=dtype, attention=c.model.attention)
    models.check_weights(req.hf_path, cfg)
    return policy_lib.Policy(params=models.load_params(req.hf_path, cfg)[0], cfg=cfg, version=-1,
                             tokenizer=req.hf_path)


def samplers(req: Request, c, task, cfg: models.ModelConfig):
    """(the n-sample sampler, the greedy one): continuous batching over this process's devices
    (a multi-turn task's episodes decode on one)."""
    holder = ml_collections.ConfigDict(dict(sampler=c.sampler, model=dict(dtype=cfg.dtype)))
    if req.max_new_tokens:
        holder.sampler.max_new_tokens = req.max_new_tokens
    base = plan.sampler_cfg(holder, task)
    chosen = {k: v for k, v in dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k).items()
              if v is not None}
    drawn = dataclasses.replace(base, num_samples=req.n, capture_topk=0, batching="continuous", **chosen)
    greedy = plan.sampler_cfg(holder, task, greedy=True)
    devices = jax.local_devices()[:1] if multiturn.is_multi_turn(task) else jax.local_devices()
    mesh = Mesh(np.asarray(devices), ("data",))
    return backend.make(cfg, drawn, mesh), backend.make(cfg, greedy, mesh)


def evaluate(req: Request, config=None) -> dict:
    """Evaluate `req` (module docstring); returns the results written to `<out>/eval.json`."""
    if not 1 <= min(req.ks) or req.n < 1:
        raise ValueError(f"--n and every --k must be >= 1; got n={req.n}, k={list(req.ks)}")
    c = sections(req, config)
    pol = source(req, c)
    task = tasks.make(c.task, pol.tokenizer)  # an exported directory carries the run's tokenizer
    out = req.out or (os.path.join(req.workdir, "eval", f"v{pol.version}") if req.workdir else "")
    if not out:
        raise ValueError("--hf_path: name where the results go with --out")
    if os.path.isfile(os.path.join(out, "eval.json")) and not req.overwrite:
        raise ValueError(f"{out} already holds eval.json; pass --overwrite or another --out")
    if task.vocab_size > pol.cfg.vocab_size:
        raise ValueError(f"the task's tokenizer has {task.vocab_size} tokens but the policy embeds only "
                         f"{pol.cfg.vocab_size}")
    drawer, greedy = samplers(req, c, task, pol.cfg)
    scorer, t0 = tasks.scorer(task, c.task), time.time()
    try:
        prompts, key = task.eval_prompts(), jax.random.key(req.seed)
        success = sampled.success_threshold(task) if req.success is None else req.success
        results = sampled.report(sampled.draw(drawer, pol.params, task, scorer, prompts, key, req.chunk),
                                 req.ks, success, req.seed)
        if req.greedy:
            g = sampled.draw(greedy, pol.params, task, scorer, prompts, key, req.chunk)
            results["greedy/reward"] = float(g.rewards.mean())
    finally:
        scorer.close()
        getattr(task, "close", lambda: None)()
    results.update(_about(req, c, task, pol, drawer.cfg), time_s=round(time.time() - t0, 2), out=out)
    _write(out, results)
    return results


def _about(req: Request, c, task, pol, s) -> dict:
    eval_set = getattr(task, "eval_set", None)
    return {"source": req.hf_path or f"{req.workdir} (version {pol.version})", "version": pol.version,
            "task": c.task.name, "eval_set": splits.describe(eval_set) if eval_set else "",
            "sampling": dict(n=s.num_samples, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                             max_new_tokens=s.max_new_tokens, seed=req.seed),
            "devices": f"{jax.local_device_count()} x {jax.local_devices()[0].device_kind}", "cpu": _cpu()}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return f"{model} ({'AVX-512' if ' avx512f' in info else 'AVX2' if ' avx2' in info else 'no AVX2'})"


def _write(out: str, results: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, "eval.md"), "w") as f:
        f.write(page(results))


def page(r: dict) -> str:
    """The results as a markdown page."""
    s = r["sampling"]
    lines = [f"# Evaluation of {r['source']}", "",
             f"Task `{r['task']}`" + (f" ({r['eval_set']})" if r["eval_set"] else "") +
             f", {r['problems']} problems, {s['n']} samples each at temperature {s['temperature']:g}, top-p "
             f"{s['top_p']:g}, top-k {s['top_k']}, up to {s['max_new_tokens']} new tokens (seed {s['seed']}); "
             f"a sample succeeds at reward >= {r['success_threshold']:g}. {r['devices']}, {r['time_s']:.1f} s.", "",
             "| metric | value |", "|---|---|"]
    skip = {"out", "source", "task", "eval_set", "sampling", "devices", "cpu", "time_s", "problems", "version",
            "samples_per_problem", "success_threshold"}
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
              for k, v in r.items() if k not in skip]
    return "\n".join(lines) + "\n"
