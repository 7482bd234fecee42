"""`Sampler`, the single entry point of rollout: prompts -> a version-tagged TrajectoryBatch.

A static batch is one jitted prefill and a `lax.while_loop` decode (`decode.py`); with
`batching="continuous"` the rows go through decode slots (`continuous.SlotEngine`), which run
the same decode step.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.parallel import sharding
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.models import experts
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import continuous, decode, devices
from jaxrl_llm.rollout.decode import DecodeState
from jaxrl_llm.rollout.sampling import SamplerConfig


class Sampler:
    """`Sampler(model_cfg, sampler_cfg).generate(params, prompts, key, version)` -> TrajectoryBatch.

    One compiled program per (prompt bucket, batch size); batches of the same bucket and size
    never retrace. With a `mesh`, rows are split over all its devices (data parallel; params
    replicated onto the mesh unless they already live there), padded to a multiple of its size.
    Each device then runs the whole generation on its own rows (`shard_map`): no collective in
    the decode loop, and a device stops as soon as its own rows are done.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Optional[Mesh] = None):
        self.model_cfg, self.cfg = model_cfg, cfg
        self._slots = None
        self._static_slots = {}  # multi-turn static batches: one slot engine per batch size
        # turn_cache="recompute", over every engine: rows resumed, drawn tokens re-scored, sum and
        # max |log-prob gap| to the recorded behaviour log-probs (`continuous.SlotEngine._rebuilt`)
        self.reprefill = dict(rows=0, tokens=0, abs_sum=0.0, abs_max=0.0)
        # rows over the mesh's devices, with `cfg.tensor` > 1 over its data axis (`devices.py`)
        self.mesh, self.rows = mesh, rows = devices.grid(mesh, cfg.tensor)
        self.row_devices = devices.row_devices(mesh)
        local = functools.partial(decode.per_device, mesh, rows)
        r, rep = PartitionSpec(rows), PartitionSpec()
        # a mixture of experts on several devices: each holds E / devices of the experts (`place_params`)
        self.splits_experts = mesh is not None and experts.splits(model_cfg.num_experts, self.row_devices,
                                                                  cfg.expert_parallel)
        # the params' specs as the `shard_map` over the rows reads them (the continuous engine's too)
        self.manual_specs = ps = lambda params: devices.manual(rows, self.param_specs(params))  # noqa: E731

        def generate(params, prompt, mask, limit, key, version, mcfg, scfg):
            f = functools.partial(decode.generate, mcfg=mcfg, scfg=scfg, rows=rows)
            return local(f, (ps(params), r, r, r, rep, rep), r)(params, prompt, mask, limit, key, version)

        def prefill(params, prompt, mask, limit, key, version, mcfg, scfg):
            f = functools.partial(decode.prefill, mcfg=mcfg, scfg=scfg, rows=rows)
            specs = DecodeState.specs(rows, routing=scfg.record_routing)
            return local(f, (ps(params), r, r, r, rep, rep), specs)(params, prompt, mask, limit, key, version)

        def segment(params, st, version, end, p, mcfg, scfg):
            f = lambda params, st, version, end: decode.decode_segment(params, st, version, p, end, mcfg, scfg)  # noqa: E731
            s = DecodeState.specs(rows, routing=scfg.record_routing)
            return local(f, (ps(params), s, rep, rep), s)(params, st, version, end)

        self._generate = jax.jit(generate, static_argnames=("mcfg", "scfg"))
        # Host-driven pieces for mid-generation weight refresh (same code; `end` is an input, so
        # one segment program serves every segment).
        self._prefill = jax.jit(prefill, static_argnames=("mcfg", "scfg"))
        self._segment = jax.jit(segment, static_argnames=("p", "mcfg", "scfg"))

    def bucket(self, length: int) -> int:
        for b in self.cfg.prompt_buckets:
            if length <= b:
                return b
        raise ValueError(f"prompt of {length} tokens exceeds the largest bucket {self.cfg.prompt_buckets[-1]}; "
                         "add a bucket to SamplerConfig.prompt_buckets")

    def pad_prompts(self, prompts: Sequence[Sequence[int]], width: Optional[int] = None):
        """Left-pad to the bucket (or `width`) and repeat each prompt G times -> (tokens, mask,
        group_ids); row r = i * G + g is sample g of prompt i (its draws follow r: `row_keys`)."""
        if not len(prompts) or min(len(x) for x in prompts) == 0:
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        p = max(width or 0, self.bucket(max(len(x) for x in prompts)))
        g = self.cfg.num_samples
        toks, mask = left_pad(prompts, p, self.cfg.pad_token_id)
        return np.repeat(toks, g, 0), np.repeat(mask, g, 0), np.repeat(np.arange(len(prompts), dtype=np.int32), g)

    def generate(self, params, prompts, key, version: int = 0, refresh=None, limits=None, turns=None) -> TrajectoryBatch:
        """`refresh`: optional `() -> (version, params) | None`, asked between decode segments
        (every `decode_segment` tokens); when it returns newer weights, the rest of the batch is
        decoded with them (the KV cache of earlier tokens is kept, as in-flight weight updates
        do) and each token's `versions` entry names the params it was sampled from.
        `limits`: optional per-row budgets of new tokens (<= max_new_tokens; rows as in
        `pad_prompts`); a row that uses its budget ends truncated. `turns` (`turns.Turns`):
        multi-turn episodes, run in decode slots (static batching: one slot per row, held
        while the row waits for its environment; see `turns`)."""
        toks, mask, group_ids = self.pad_prompts(prompts)
        limit = row_limits(limits, len(toks), self.cfg.max_new_tokens)
        if turns is not None and self.mesh is not None and self.mesh.size > 1:
            raise ValueError("multi-turn episodes run on one sampler device for now (sampler mesh of "
                             f"{self.mesh.size}): build this Sampler on one device (a run's plan does)")
        if turns is not None and self.cfg.batching == "static":
            turns.release = False  # a static batch keeps every row in its slot until the batch ends
            if len(toks) not in self._static_slots:
                self._static_slots[len(toks)] = continuous.SlotEngine(self, len(toks))
            engine = self._static_slots[len(toks)]
            return to_batch(toks, mask, group_ids, engine.generate(params, toks, mask, limit, key, version, refresh,
                                                                   turns=turns))
        if self.cfg.batching == "continuous":
            return to_batch(toks, mask, group_ids, self.slots(len(toks)).generate(
                params, toks, mask, limit, key, version, refresh, turns=turns))
        (toks_j, mask_j, limit_j), params = self._place((toks, mask, limit), params)
        if refresh is None:
            out = self._generate(params, toks_j, mask_j, limit_j, key, version, mcfg=self.model_cfg, scfg=self.cfg)
            return to_batch(toks, mask, group_ids, out)
        st = self._prefill(params, toks_j, mask_j, limit_j, key, version, mcfg=self.model_cfg, scfg=self.cfg)
        for j, end in enumerate(decode.segment_ends(self.cfg.max_new_tokens, self.cfg)):
            newer = refresh() if j else None
            if newer is not None and newer[0] > version:
                version, params = newer[0], self.place_params(newer[1])
            st = self._segment(params, st, version, np.int32(end), p=toks.shape[1], mcfg=self.model_cfg, scfg=self.cfg)
        return to_batch(toks, mask, group_ids, decode.outputs(st, self.cfg))

    def lower_generate(self, params, prompts, key):
        """A static batch's `generate` program, lowered and not run (its memory analysis)."""
        toks, mask, _ = self.pad_prompts(prompts)
        (toks_j, mask_j, limit_j), params = self._place(
            (toks, mask, row_limits(None, len(toks), self.cfg.max_new_tokens)), params)
        return self._generate.lower(params, toks_j, mask_j, limit_j, key, 0, mcfg=self.model_cfg, scfg=self.cfg)

    def slots(self, rows: int):
        """The continuous-batching engine (`continuous.py`); `slots=0` sizes it to the first
        batch's rows."""
        if self._slots is None:
            self._slots = continuous.SlotEngine(self, self.cfg.slots or rows)
        return self._slots

    def param_specs(self, params):
        """The params' PartitionSpecs on the sampler mesh (`devices.specs`): replicated, stacked
        experts split over the row devices (`splits_experts`), heads / MLP / vocab over tensor."""
        return devices.specs(self.model_cfg, params, self.mesh, self.rows, self.splits_experts)

    def shardings(self, params):
        """Where `place_params` puts `params`: a NamedSharding per leaf (the weight store's placement)."""
        return devices.shardings(self.mesh, self.param_specs(params))

    def place_params(self, params):
        """Params on the sampler mesh (`shardings`) unless already there (`sharding.put`: CPU
        devices share one host copy of what is replicated)."""
        if self.mesh is None:
            return params
        if self.splits_experts or self.row_devices < self.mesh.size:
            want = self.shardings(params)
            if not all(getattr(x, "sharding", None) is not None and x.sharding.is_equivalent_to(w, x.ndim)
                       for x, w in zip(jax.tree.leaves(params), jax.tree.leaves(want))):
                params = sharding.put(params, want)
            return params
        leaf = jax.tree_util.tree_leaves(params)[0]
        if getattr(leaf, "sharding", None) is None or leaf.sharding.device_set != set(self.mesh.devices.flat):
            params = sharding.put(params, NamedSharding(self.mesh, PartitionSpec()))
        return params

    def _place(self, arrays, params):
        """Device arrays for the program: on the mesh, rows split (padded with copies of the
        last row, dropped again by `to_batch`) and params replicated."""
        if self.mesh is None:
            return tuple(jnp.asarray(x) for x in arrays), params
        extra = -len(arrays[0]) % self.row_devices
        rows = NamedSharding(self.mesh, PartitionSpec(self.rows))
        pad = lambda x: np.concatenate([x, np.repeat(x[-1:], extra, 0)])
        return tuple(jax.device_put(pad(x), rows) for x in arrays), self.place_params(params)


def row_limits(limits, rows: int, n: int) -> np.ndarray:
    """Per-row budgets of new tokens as i32[rows] (default: all `n`), checked."""
    if limits is None:
        return np.full(rows, n, np.int32)
    limits = np.asarray(limits, np.int32)
    if limits.shape != (rows,) or limits.min() < 1 or limits.max() > n:
        raise ValueError(f"limits must be {rows} per-row budgets in [1, {n}]; got shape {limits.shape}")
    return limits


def left_pad(prompts: Sequence[Sequence[int]], width: int, pad_id: int):
    """Each prompt right-aligned in `width` columns -> (i32 tokens, i32 mask) [len(prompts), width]."""
    toks = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, x in enumerate(prompts):
        toks[i, width - len(x):] = x
        mask[i, width - len(x):] = 1
    return toks, mask


def to_batch(prompt_BxP, prompt_mask_BxP, group_ids_B, out) -> TrajectoryBatch:
    """Sampler output -> the batch contract (prompt positions: mask 0, version -1). Host
    (NumPy) outputs give a host batch (a streaming sampler's groups), device outputs a device one."""
    b, p = prompt_BxP.shape
    xp = np if isinstance(out["tokens"], np.ndarray) else jnp
    out = {k: v[:b] for k, v in out.items()}  # rows padded for a device mesh
    valid = out["valid"]
    k = out["topk_ids"].shape[-1]
    gen_mask = valid.astype(np.float32)  # every real token after the prompt: drawn, or an observation
    drawn = valid & ~out["obs"] if "obs" in out else valid  # observations are never trained on
    prompt = lambda x, dtype=np.float32, *tail: xp.concatenate([xp.zeros((b, p) + tail, dtype), x], 1)
    return TrajectoryBatch(
        tokens=xp.concatenate([xp.asarray(prompt_BxP), out["tokens"]], 1),
        loss_mask=prompt(drawn.astype(np.float32)),
        behav_logp=prompt(out["logp"]),
        versions=xp.concatenate([xp.full((b, p), -1, np.int32), out["versions"]], 1),
        topk_ids=prompt(out["topk_ids"], np.int32, k),
        topk_logp=prompt(out["topk_logp"], np.float32, k),
        rewards=xp.zeros((b,), np.float32),
        group_ids=xp.asarray(group_ids_B),
        advantages=xp.zeros((b, p + valid.shape[1]), np.float32),
        input_mask=xp.concatenate([xp.asarray(prompt_mask_BxP, np.float32), gen_mask], 1),
        truncated=~out["done"],
        behav_kept=prompt(out["kept"], np.int32) if "kept" in out else None,
        routing=out["routing"][:, :p + valid.shape[1]] if "routing" in out else None,
    )
