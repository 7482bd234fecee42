"""Helpers shared by the sampler-node tests (test_wire, test_leases, test_service, test_hub,
test_node): a well-formed group, a lease stream and a hub over a tiny model."""

import numpy as np

from jaxrl_llm.remote import wire
from jaxrl_llm.remote.leases import Leases

def _group(rows=2, p=4, new=3, k=2, prompt=(7, 8, 9), vocab=20, kept=True):
    """A well-formed group: prompt left-padded into p positions, `new` generated tokens; `kept`:
    sampled from a truncated distribution (top-k / top-p), so it carries behav_kept."""
    w = p + new
    toks = np.zeros((rows, w), np.int32)
    toks[:, p - len(prompt):p] = prompt
    toks[:, p:] = np.arange(new) + 1
    gen = np.zeros((rows, w), np.float32)
    gen[:, p:] = 1
    return {"tokens": toks, "loss_mask": gen, "behav_logp": -gen * 0.5, "versions": np.where(gen > 0, 2, -1).astype(np.int32),
            "topk_ids": np.ones((rows, w, k), np.int32), "topk_logp": np.full((rows, w, k), -1.0, np.float32),
            "rewards": (np.arange(rows) % 2).astype(np.float32), "truncated": np.zeros(rows, bool),
            "input_mask": (toks > 0).astype(np.float32), **({"behav_kept": gen.astype(np.int32) * 3} if kept else {})}


def _todo():
    d = 0
    while True:
        yield d, [0, 1]
        d += 1


def _hub(verify_fraction=1.0, task=None, max_new_tokens=4, capacity=100, experts=0):
    """A hub over a 1-layer model (`experts` > 0: a top-2 mixture of experts whose sampler records
    routing) with version 3 published."""
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.rollout import Sampler, SamplerConfig
    from jaxrl_llm.runtime import orchestrator
    from jaxrl_llm.remote.hub import Hub
    from jaxrl_llm.runtime.producer import Producer
    from jaxrl_llm.runtime.queue import VersionedQueue
    from jaxrl_llm.runtime.weights import WeightStore
    from jaxrl_llm.tasks.arithmetic import Arithmetic

    task = task or Arithmetic()
    moe = dict(model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=8)
    mcfg = models.ModelConfig(vocab_size=task.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=8, eos_token_id=task.eos_id,
                              **(moe if experts else {}))
    cfg = orchestrator.default_config()
    cfg.prompts_per_batch, cfg.remote.verify_fraction = 2, verify_fraction
    scfg = SamplerConfig(max_new_tokens=max_new_tokens, num_samples=2, capture_topk=0, eos_token_id=task.eos_id,
                         record_routing=bool(experts))
    producer = Producer(Sampler(mcfg, scfg), task, cfg)
    store = WeightStore()
    store.publish(3, models.init_params(mcfg, jax.random.key(0)))
    queue = VersionedQueue(100)
    return Hub(producer, store, Leases(_todo(), 30.0), queue, cfg, {"task": {}}, capacity=capacity), task


def _weights(hub, session) -> dict:
    """The fingerprint an honest node reports for the hub's newest version (as it fetched it)."""
    manifest = hub.manifest(session)
    return {str(manifest["version"]): wire.fingerprint(wire.manifest_crcs(manifest), manifest["nbytes"])}
