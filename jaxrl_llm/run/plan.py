"""`RunPlan`: the experiment config resolved once at start-up into typed, immutable parts. The
learner, the samplers, the orchestrator, the memory plan and evaluation receive these parts;
none of them reads the raw config again. `resolve` validates first (`config.validate`), so a
bad config fails before anything is resolved, loaded or compiled.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping, Optional

import ml_collections

from jaxrl_llm.run import config as config_lib
from jaxrl_llm import models, objectives, tasks
from jaxrl_llm.gateway import agents
from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm.run import memory, paths
from jaxrl_llm.rollout import SamplerConfig, devices as sampler_devices_lib

_MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    config: ml_collections.FrozenConfigDict  # as the user ran it (hub ids resolved to local paths)
    task: Any
    model: models.ModelConfig  # the policy's decoder
    aux_model: Optional[models.ModelConfig]  # the objective's auxiliary decoder, when it has one
    objective: ml_collections.FrozenConfigDict  # `objectives.make_config`, resolved once
    passes: frozenset  # `objectives.required_passes`
    sampler: SamplerConfig  # the training samplers'
    greedy: SamplerConfig  # evaluation's
    learner_devices: tuple
    sampler_devices: tuple
    memory: Mapping[str, int]  # bytes per device by part (`memory.estimate`), checked against what is available
    memory_layout: memory.Layout = memory.Layout()  # where those parts live (`memory.need`)
    warnings: tuple = ()  # said once at start-up (e.g. an evaluation set smaller than asked)

    @property
    def played(self):
        """The task whose prompts evaluation samples and whose end token the policy has: the task
        itself, or for `task.name=agent` the source its agents play."""
        return self.task.source if isinstance(self.task, agents.AgentTask) else self.task

    @property
    def own_sampler_devices(self) -> bool:
        """Whether the samplers hold weight copies of their own (devices of their own, or many
        processes), so the weight store publishes each version onto them."""
        return bool(self.config.runtime.sampler_devices) or distributed.count() > 1


def resolve(config) -> RunPlan:
    """Validate `config` and resolve it; the memory plan is checked before any weight is loaded
    or program compiled."""
    objective = config_lib.validate(config)
    config = paths.resolved(config)  # hub ids -> local snapshot directories (the caller's config is untouched)
    resolve_dtypes(config)
    task = tasks.make(config.task, config.model.hf_path)
    played = task  # evaluation samples it; the policy ends where it does
    if config.task.name == "agent":  # its agents play `task` through the gateway
        task = agents.AgentTask(task, config.task.agent, agent_settings(config))
    mcfg = model_cfg(config.model, played)
    acfg = model_cfg(config.aux_model, task) if config_lib.has_aux_model(config) else None
    for section, cfg in (("model", mcfg), ("aux_model", acfg)):
        if cfg is not None and config[section].hf_path:
            models.check_weights(config[section].hf_path, cfg)
    check_sampling(config, task, mcfg)
    check_replay(config, task, mcfg)
    learner_devices, sampler_devices = config_lib.devices(config)
    mesh = sharding.make_mesh(config.mesh, learner_devices)
    check_layout(config, mcfg, acfg, mesh)
    warnings = tuple(getattr(task, "warnings", ()))
    check_sampler_tensor(config, sampler_devices)
    if config.task.name in tasks.MULTI_TURN + ("agent",) and len(sampler_devices) > 1:
        warnings += (f"task {config.task.name!r} is multi-turn, whose episodes decode on one device for now: the "
                     f"samplers use 1 of this process's {len(sampler_devices)} sampler devices",)
        sampler_devices = sampler_devices[:1]
    layout = memory.Layout.of(mesh, sampler_devices, not config.runtime.sampler_devices, config.sampler.tensor)
    parts = memory.estimate(config, task, mcfg, acfg, objective, layout)
    memory.check_run(config, task, mcfg, acfg, parts, layout)
    return RunPlan(config=ml_collections.FrozenConfigDict(config), task=task, model=mcfg, aux_model=acfg,
                   objective=objective, passes=frozenset(objectives.required_passes(objective)),
                   sampler=sampler_cfg(config, task, record_routing=bool(mcfg.num_experts)),
                   greedy=sampler_cfg(config, played, greedy=True),
                   learner_devices=tuple(learner_devices), sampler_devices=tuple(sampler_devices),
                   memory=types.MappingProxyType(parts), memory_layout=layout, warnings=warnings)


def agent_settings(config) -> types.SimpleNamespace:
    """What `gateway.agents.AgentTask` reads: the gateway section, the run's seed, the task's
    observation width and turns per session."""
    return types.SimpleNamespace(**config.gateway.to_dict(), seed=config.seed,
                                 max_obs_tokens=config.task.max_obs_tokens, max_turns=config.task.max_turns)


def node_agent(config):
    """What a sampler node needs to host the gateway of `task.name=agent` (remote mode): the
    agent and the gateway's settings but where it listens and its key (each node's gateway
    listens on its own loopback, with a key of its own, and plays its agents itself); None for
    other tasks."""
    if config.task.name != "agent":
        return None
    own = ("host", "port", "token", "external")
    return {"spec": config.task.agent,
            "settings": {k: v for k, v in vars(agent_settings(config)).items() if k not in own}}


def check_sampling(config, task, mcfg: models.ModelConfig) -> None:
    """Sampling options the model and tokenizer can honour, refused before any thread starts."""
    s, problems = config.sampler, []
    for key in ("top_k", "capture_topk"):
        if s[key] > mcfg.vocab_size:
            problems.append(f"sampler.{key}={s[key]} exceeds the model's vocabulary of {mcfg.vocab_size} tokens")
    new = s.max_new_tokens or task.max_answer_len
    prompt = getattr(task, "max_prompt_len", task.prompt_buckets[-1])
    if config.model.hf_path and prompt + new > mcfg.max_position_embeddings:
        problems.append(f"the longest prompt ({prompt} tokens) + {new} new tokens (sampler.max_new_tokens, else "
                        f"task.max_answer_len) exceed the {mcfg.max_position_embeddings} positions of "
                        f"{config.model.hf_path} (max_position_embeddings)")
    if problems:
        raise ValueError("; ".join(problems))


def resolve_dtypes(config, platform: Optional[str] = None) -> None:
    """`model.dtype=auto` (and the auxiliary's) -> bfloat16 where matmuls run natively in it (GPU,
    TPU: float32 accumulation, float32 heads and master weights), float32 on CPU, whose bf16
    matmuls are emulated. In place, on the resolved copy: every consumer sees the dtype."""
    for section in ("model", "aux_model"):
        if config[section].dtype == "auto":
            config[section].dtype = auto_dtype(platform)


def auto_dtype(platform: Optional[str] = None) -> str:
    import jax

    return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"


def check_layout(config, mcfg, acfg, mesh) -> None:
    """Every split the learner's mesh must make divides evenly (`sharding.check_divisible`),
    refused with the settings that fix it before any weight is loaded or program compiled."""
    import jax

    rows = config.runtime.prompts_per_batch * config.sampler.num_samples * distributed.count()
    problems = []
    for what, cfg in (("model", mcfg), ("aux_model", acfg)):
        if cfg is not None:
            shapes = jax.eval_shape(lambda cfg=cfg: models.init_params(cfg.without_lora(), jax.random.key(0)))
            problems += sharding.check_divisible(models.logical_axes(cfg.without_lora()), shapes, mesh,
                                                 rows if what == "model" else 0, what, config.mesh, cfg.num_kv_heads)
    if problems:
        raise ValueError("; ".join(problems))


def model_cfg(m, task) -> models.ModelConfig:
    """The decoder of model section `m`: a local HF checkpoint's config.json (read, nothing
    loaded) or a random model sized by `m`; compute dtype, attention kernel and remat from `m`."""
    chosen = dict(dtype=auto_dtype() if m.dtype == "auto" else m.dtype, attention=m.attention, remat=m.remat,
                  matmul_precision=m.get("matmul_precision", "default"))
    if "lora" in m and m.lora.rank:
        chosen.update(lora_rank=m.lora.rank, lora_alpha=float(m.lora.alpha),
                      lora_targets=models.lora.parse_targets(m.lora.targets))
    moe = m.get("moe")
    if moe is not None:
        chosen.update(moe_routing=moe.routing, moe_dispatch=moe.dispatch, moe_exchange=moe.exchange,
                      sampler_router_dtype=moe.sampler_router_dtype)
    if m.hf_path:
        if moe is not None and moe.experts:
            raise ValueError("model.moe.experts sizes a random mixture of experts; with model.hf_path the "
                             "checkpoint's config.json decides (set model.moe.experts=0)")
        cfg = models.load_config(m.hf_path)
        if task.vocab_size > cfg.vocab_size:
            raise ValueError(f"the task's tokenizer has {task.vocab_size} tokens but {m.hf_path!r} embeds only "
                             f"{cfg.vocab_size}")
        if moe is not None and moe.aux_loss_coef:
            chosen["moe_aux_loss_coef"] = cfg.router_aux_loss_coef if moe.aux_loss_coef < 0 else moe.aux_loss_coef
        return cfg.replace(**chosen)
    if moe is not None and moe.experts:
        if moe.top_k > moe.experts:
            raise ValueError(f"model.moe.top_k={moe.top_k} exceeds model.moe.experts={moe.experts}")
        chosen.update(model_type="qwen3_moe", num_experts=moe.experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=moe.intermediate_size or m.intermediate_size, norm_topk_prob=True,
                      moe_aux_loss_coef=max(moe.aux_loss_coef, 0.0))
    return models.ModelConfig(vocab_size=task.vocab_size, eos_token_id=task.eos_id, **chosen,
                              **{f: m[f] for f in _MODEL_FIELDS})


def check_replay(config, task, mcfg: models.ModelConfig) -> None:
    """`model.moe.routing=replay` replays what the samplers record: every sampler of a mixture of
    experts does (the run's own, its nodes, the agent gateway's slots), for replay or the mismatch
    metrics."""
    if mcfg.moe_routing == "replay" and not mcfg.num_experts:
        raise ValueError("model.moe.routing=replay needs a mixture of experts (here: the model is dense)")


def check_sampler_tensor(config, sampler_devices) -> None:
    """`sampler.tensor` must divide the samplers' devices; multi-turn episodes decode on one device."""
    t = config.sampler.tensor
    if t > 1 and config.task.name in tasks.MULTI_TURN + ("agent",):
        raise ValueError(f"sampler.tensor={t}: task {config.task.name!r} is multi-turn, whose episodes decode on one "
                         "device for now (set --config.sampler.tensor=1)")
    sampler_devices_lib.check_tensor(len(sampler_devices), t)


def sampler_cfg(config, task, greedy: bool = False, record_routing: bool = False) -> SamplerConfig:
    """The `sampler` section as the sampler's frozen config (greedy: evaluation's)."""
    s = config.sampler
    kw = dict(max_new_tokens=s.max_new_tokens or task.max_answer_len, eos_token_id=task.eos_id,
              pad_token_id=task.pad_id, prompt_buckets=tuple(task.prompt_buckets),
              cache_dtype=s.cache_dtype if s.cache_dtype != "auto" else config.model.dtype,
              turn_stop_ids=tuple(getattr(task, "turn_stop_ids", ())), backend=s.backend,
              expert_parallel=s.expert_parallel, tensor=s.tensor)
    if greedy:
        return SamplerConfig(temperature=0.0, num_samples=1, capture_topk=0, **kw)
    return SamplerConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, capture_topk=s.capture_topk,
                         num_samples=s.num_samples, batching=s.batching, slots=s.slots,
                         decode_segment=s.decode_segment, turn_cache=s.turn_cache, record_routing=record_routing, **kw)
