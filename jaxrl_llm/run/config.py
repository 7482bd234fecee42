"""The experiment config: the sections this module owns (`model`, `aux_model`, `train`, the top
level), every section's declared constraints by full key (`rules`; each owning module declares
its section once, as a `validation.Section`), and `validate`, where every cross-field rule is
stated once. `plan.resolve` turns a valid config into the immutable `RunPlan` the rest receives.
"""

from __future__ import annotations

import os

import jax

from jaxrl_llm import models, objectives, tasks
from jaxrl_llm.learner import learner
from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm.run import paths, tracking
from jaxrl_llm import validation as V
from jaxrl_llm.objectives.registry import RULES as OBJECTIVE_RULES
from jaxrl_llm import remote  # noqa: F401  registers the remote mode (and its runtime.remote section)
from jaxrl_llm.gateway import config as gateway_config
from jaxrl_llm.rollout import sampling
from jaxrl_llm.runtime import orchestrator
from jaxrl_llm.tasks import warmstart

_SIZES = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def _model(size_low: int, sizes: tuple, **more) -> V.Section:
    """A `model` section; sizes below `size_low` are refused (0 allowed for `aux_model`: off)."""
    return V.Section(**more,
        hf_path=("", V.anything()),  # a local Hugging Face directory (paths.py); empty: a random model of these sizes
        **{f: (n, V.integer(size_low)) for f, n in zip(_SIZES, sizes)},
        # compute (and sampler weights); master weights stay float32. auto: bfloat16 on a GPU / TPU
        # (float32 accumulation and log-softmax), float32 on CPU (`plan.resolve_dtypes`)
        dtype=("auto", V.one_of("auto", *models.config.DTYPES)),
        attention=("auto", V.one_of(*models.config.ATTENTION)),  # models/decoder.py: attention
        remat=("none", V.one_of(*models.config.REMAT)))  # none | full | dots: decoder layers recomputed in backward


MODEL = _model(1, (64, 128, 2, 4, 2, 16), lora=models.lora.SECTION,  # lora: models/lora.py
               # float32 matmuls' precision, for the whole run (models/config.py: PRECISIONS)
               matmul_precision=("default", V.one_of(*models.config.PRECISIONS)),
               moe=models.moe.SECTION)  # a mixture of experts (models/moe.py; routing=replay: R3)
# A second model for objectives that train one (e.g. Jackpot's rollout actor): hf_path, or a
# random model of hidden_size > 0; off (all sizes 0) by default.
AUX_MODEL = _model(0, (0,) * len(_SIZES))
# resume: auto continues from the newest readable checkpoint in the workdir (damaged newer ones
# are reported and moved aside); fresh moves the checkpoints aside and starts over.
# preempt_grace_s: after SIGTERM / Ctrl-C, the seconds the final save may take.
TRAIN = V.Section(
    steps=(300, V.integer(1)), eval_every=(50, V.integer(1)), save_every=(50, V.integer(1)), keep=(2, V.integer(1)),
    # each evaluation also draws this many samples per held-out problem at the sampler's settings:
    # eval/pass@k, eval/maj@k, eval/sampled_reward (tasks/evaluation.py); 0: the greedy reward only
    eval_samples=(0, V.integer(0)),
    tensorboard=(True, V.boolean()), progress=(True, V.boolean()), resume=("auto", V.one_of("auto", "fresh")),
    preempt_grace_s=(30.0, V.positive()),
    check_memory=(True, V.boolean()),  # refuse a memory plan beyond what is available
    deterministic=(False, V.boolean()),  # GPU: deterministic XLA ops (scatter-adds too), at some speed
    compile_cache=(True, V.boolean()),  # keep programs that took >= 1 s to compile in <workdir>/xla_cache
    allow_changes=(False, V.boolean()))  # resume with settings outside workdir.FREE changed (recorded)
model_config, aux_model_config, train_config = MODEL.config, AUX_MODEL.config, TRAIN.config
TOP_RULES = {"seed": V.integer(0), "cpu_devices": V.integer(0, extra=(-1,))}


def rules() -> dict:
    """Every declared constraint of the experiment config, by full dotted key."""
    sections = {"task": tasks.RULES, "model": MODEL.rules, "aux_model": AUX_MODEL.rules,
                "warm_start": warmstart.RULES, "sampler": sampling.RULES, "objective": OBJECTIVE_RULES,
                "learner": learner.RULES, "runtime": orchestrator.rules(), "mesh": sharding.RULES,
                "distributed": distributed.RULES, "train": TRAIN.rules, "gateway": gateway_config.RULES,
                "logging": tracking.RULES}
    out = dict(TOP_RULES)
    for name, rules in sections.items():
        out.update(V.flatten(rules, name + "."))
    return out


def validate(config):
    """Fail at start-up, before any model is built, naming every problem: first each field
    against its declared constraint (`rules`), then the cross-field rules (each stated
    here, once) and the local paths, all collected into one error. Returns the objective's
    resolved config (`objectives.make_config`), for the plan."""
    V.raise_all(V.check(config, rules()))
    problems = []

    def collect(fn, *args):
        try:
            return fn(*args)
        except ValueError as e:
            problems.append(str(e))

    collect(tasks.validate, config.task, config.model.hf_path)
    obj = collect(objectives.make_config, config.objective)
    collect(orchestrator.validate, config.runtime, config.sampler.batching)
    if config.task.name == "agent":
        collect(_agents, config.task, config.gateway)
    if config.task.name == "agent" and config.runtime.mode not in ("sync", "async", "remote"):
        problems.append(f"task.name=agent runs in runtime.mode=sync, async or remote (got {config.runtime.mode!r})")
    if config.task.name == "agent" and config.runtime.mode == "remote" and config.gateway.external:
        problems.append("gateway.external=True: in runtime.mode=remote each sampler node hosts a gateway and plays "
                        "its agents itself (task.agent); set gateway.external=False")
    if obj is not None:
        needs = objectives.required_passes(obj)
        if needs & {"topk", "logp_at_behav_topk"} and config.sampler.capture_topk == 0:
            problems.append(f"objective {obj.name!r} reads behaviour top-k log-probs; set "
                            "--config.sampler.capture_topk to a positive K")
        aux = objectives.get(obj.name).aux
        if has_aux_model(config) and not (aux and aux.needs_model):
            with_model = [n for n in objectives.with_aux() if objectives.get(n).aux.needs_model]
            problems.append(f"config.aux_model sets a second model, but objective {obj.name!r} trains none; "
                            f"objectives that do: {', '.join(with_model) or 'none'} (or set "
                            "--config.aux_model.hidden_size=0 and --config.aux_model.hf_path='')")
    rows = config.runtime.prompts_per_batch * config.sampler.num_samples * distributed.count()
    if rows % config.learner.num_minibatches:
        problems.append(f"learner.num_minibatches={config.learner.num_minibatches} does not divide the batch's "
                        f"{rows} rows (runtime.prompts_per_batch x sampler.num_samples"
                        + (" x processes)" if distributed.count() > 1 else ")"))
    for name in ("model", "aux_model"):
        m = config[name]
        if not m.hf_path and m.num_kv_heads and m.num_heads % m.num_kv_heads:
            problems.append(f"{name}.num_heads={m.num_heads} is not a multiple of {name}.num_kv_heads={m.num_kv_heads}")
    lo = config.model.lora
    if lo.init_from and not lo.rank:
        problems.append(f"model.lora.init_from={lo.init_from!r} needs LoRA on: set --config.model.lora.rank "
                        "to the adapter's rank")
    elif lo.init_from and not os.path.isfile(os.path.join(lo.init_from, "adapter_config.json")):
        problems.append(f"model.lora.init_from={lo.init_from!r}: expected a PEFT adapter directory "
                        "(adapter_config.json + adapter_model.safetensors)")
    try:
        sharding.make_mesh(config.mesh, devices(config)[0])
    except ValueError as e:
        problems.append(f"mesh / runtime.sampler_devices: {e}")
    collect(paths.check, config)
    V.raise_all(problems, what="config problem")
    return obj


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


def has_aux_model(config) -> bool:
    return bool(config.aux_model.hf_path or config.aux_model.hidden_size)


def _agents(task, gateway) -> None:
    """Who plays task.name=agent's sessions: `task.agent` here, or agents elsewhere
    (`gateway.external`), which need the token and port to reach the gateway."""
    if not gateway.external and not task.agent:
        raise ValueError("task.name=agent plays an agent: set --config.task.agent=module:function (or "
                         "--config.gateway.external=True for agents in other processes)")
    if gateway.external and (not gateway.token or not gateway.port):
        raise ValueError("gateway.external=True: agents elsewhere reach the gateway with its port and token; set "
                         "--config.gateway.port and --config.gateway.token")
