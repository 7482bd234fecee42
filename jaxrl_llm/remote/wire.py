"""What travels between a learner and its sampler nodes (`service.py`, `client.py`), as Arrow data.

Weights: one published version is an *artifact*: the sampler copy's leaves laid end to end in
one buffer, cut into chunks of at most `chunk_bytes` along leaf boundaries where it can, and a
JSON manifest naming each leaf (path, dtype, shape, offset) and each chunk (offset, size,
CRC-32C: the hardware checksum catches a damaged or truncated transfer at ~10 GB/s a core, where
SHA-256 runs at 1.3 and would halve the transfer rate; tampering is what the token and TLS keep
out). A node fetches the chunks in parallel streams, checks each against the manifest and
rebuilds the tree.

Rollouts: one prompt group is an Arrow table with a row per field (name, dtype, shape, bytes).
Nothing from the network is trusted: `decode_group` accepts only the declared fields at their
declared dtypes with consistent shapes, and `check_group` the values a sampler can produce for
the leased prompt (token ids in the vocabulary, versions no newer than the learner's, log-probs
that are log-probs, the prompt tokens the learner itself drew).
"""

from __future__ import annotations

import bisect
import crc32c
import jax
import numpy as np
import pyarrow as pa

from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.gateway import tally

PROTOCOL = 1  # bumped whenever a message below changes shape
CHUNK_BYTES = 16 << 20
ALIGN = 64  # leaf offsets, so a leaf read in place from a chunk buffer is aligned

# Field -> dtype on the wire; the learner recomputes group ids and advantages from the rewards.
GROUP_FIELDS = {"tokens": "int32", "loss_mask": "float32", "behav_logp": "float32", "versions": "int32",
                "topk_ids": "int32", "topk_logp": "float32", "rewards": "float32", "truncated": "bool",
                "input_mask": "float32", "behav_kept": "int32", "routing": "int16"}
OPTIONAL = {"behav_kept", "routing"}
_SCHEMA = pa.schema([("field", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
                     ("data", pa.large_binary())])


class Rejected(ValueError):
    """A message from the network that the learner refuses (and counts under `reason`)."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


def max_group_bytes(rows: int, width: int, topk: int, routing=None) -> int:
    """The most bytes an encoded group of `rows` samples of `width` positions can take: every
    field at once, and room for the field names, dtypes and shapes. `routing`: `routing_spec`'s."""
    per_position = 6 * 4 + 2 * 4 * topk  # tokens, masks, log-probs, versions, behav_kept; top-K ids and log-probs
    per_position += 2 * routing[0] * routing[1] if routing else 0  # int16 experts per sparse layer and choice
    return rows * (width * per_position + 5) + (16 << 10)


def routing_spec(sampler):
    """(sparse layers, experts per token, experts) of the routing `sampler` records with every
    group (a mixture of experts, `SamplerConfig.record_routing`); None where it records none."""
    m = sampler.model_cfg
    if not sampler.cfg.record_routing:
        return None
    return sum(m.sparse(i) for i in range(m.num_layers)), m.num_experts_per_tok, m.num_experts


def check_size(table: pa.Table, limit: int) -> None:
    """Refuse a group table before reading it: more rows than fields, or more than `limit` bytes."""
    if table.num_rows > len(GROUP_FIELDS) or table.nbytes > limit:
        raise Rejected(f"rollout table of {table.num_rows} rows and {table.nbytes} bytes; this run's groups take at "
                       f"most {len(GROUP_FIELDS)} rows and {limit} bytes", reason="size")


MAX_BEAT_EPISODES = 1e7  # no node settles more episodes (or turns, tool calls ...) between two heartbeats


def check_beat(req: dict, totals: int) -> tuple:
    """A heartbeat's (version, busy share, episode totals or None, gateway report or None),
    refused naming the field: `episodes` is what the node's episodes added to each of the
    `totals` counters since its last beat (`envs.TOTALS`; multi-turn and agent tasks), finite,
    >= 0 and bounded; `gateway` (agent tasks: `check_gateway`)."""
    try:
        version, busy = int(req.get("version", -1)), float(req.get("busy", 0.0))
    except (TypeError, ValueError):
        raise Rejected("heartbeat: version must be an integer and busy a number", reason="request") from None
    busy = min(max(busy, 0.0), 1.0) if np.isfinite(busy) else 0.0  # a display figure: clipped, not refused
    episodes = req.get("episodes")
    if episodes is not None:
        episodes = _counts(episodes, totals, MAX_BEAT_EPISODES, "heartbeat: episodes")
    return version, busy, episodes, check_gateway(req.get("gateway"))


def check_gateway(report) -> tuple | None:
    """A node gateway's report, {"counts": what each of `tally.COUNTS` grew by since the node's
    last beat, "ms": at most `tally.MAX_LATENCIES` request latencies}, as (counts, ms) arrays."""
    if report is None:
        return None
    if not isinstance(report, dict) or set(report) != {"counts", "ms"}:
        raise Rejected("heartbeat: gateway must be {counts, ms}", reason="request")
    counts = _counts(report["counts"], len(tally.COUNTS), MAX_BEAT_EPISODES, "heartbeat: gateway.counts")
    ms = report["ms"]
    if not isinstance(ms, list) or len(ms) > tally.MAX_LATENCIES:
        raise Rejected(f"heartbeat: gateway.ms must be a list of at most {tally.MAX_LATENCIES}", reason="request")
    return counts, _counts(ms, len(ms), tally.MAX_MS, "heartbeat: gateway.ms")


def _counts(values, n: int, limit: float, field: str) -> np.ndarray:
    """`values` as n finite numbers in [0, limit], else refused naming `field`."""
    try:
        x = np.asarray(values, np.float64) if isinstance(values, list) and len(values) == n else None
    except (TypeError, ValueError):
        x = None
    if x is None or x.shape != (n,) or not (np.isfinite(x).all() and (x >= 0).all() and (x <= limit).all()):
        raise Rejected(f"{field} must be {n} finite numbers in [0, {limit:g}]", reason="request")
    return x


# ---------------------------------------------------------------------- weights


def pack_params(params, version: int, chunk_bytes: int = CHUNK_BYTES):
    """(manifest, buffer): the leaves of `params` in one uint8 buffer, each at a 64-byte aligned
    offset. A chunk holds whole leaves up to `chunk_bytes`, or one piece of a larger leaf, so a
    node reads every leaf of one chunk in place (`unpack_params`) and copies only the large ones."""
    arrays = [(jax.tree_util.keystr(path), np.asarray(x)) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    entries, spans, offset, start, end = [], [], 0, None, 0  # start: of the open chunk of small leaves
    for path, a in arrays:
        offset = -(-offset // ALIGN) * ALIGN
        big = a.nbytes > chunk_bytes
        if start is not None and (big or offset + a.nbytes - start > chunk_bytes):
            spans.append((start, end))
            start = None
        entries.append({"path": path, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset})
        if big:  # its own pieces
            spans += [(o, min(o + chunk_bytes, offset + a.nbytes)) for o in range(offset, offset + a.nbytes, chunk_bytes)]
        elif start is None:
            start = offset
        offset = end = offset + a.nbytes
    if start is not None:
        spans.append((start, end))
    buf = np.zeros(offset, np.uint8)
    for e, (_, a) in zip(entries, arrays):
        buf[e["offset"]:e["offset"] + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    chunks = [{"offset": lo, "nbytes": hi - lo, "crc32c": crc32c.crc32c(buf[lo:hi])} for lo, hi in spans]
    return {"version": int(version), "nbytes": offset, "leaves": entries, "chunks": chunks}, buf


def check_chunk(manifest: dict, index: int, data) -> int:
    """Raise if chunk `index` is not what the manifest says; else its CRC32C, as computed here."""
    want, crc = manifest["chunks"][index], crc32c.crc32c(data)
    if len(data) != want["nbytes"] or crc != want["crc32c"]:
        raise ValueError(f"weights version {manifest['version']}: chunk {index} fails its checksum "
                         f"({len(data)} bytes, expected {want['nbytes']})")
    return crc


def fingerprint(crcs, nbytes: int) -> str:
    """What identifies a set of weights on the wire: a CRC32C of their chunks' CRC32Cs (a version's
    artifact, then LoRA's base), and their size. The learner's from what it packed; a node's from
    the chunks it received and loaded."""
    return f"{crc32c.crc32c(np.asarray(list(crcs), '<u4').tobytes()):08x}-{int(nbytes)}"


def manifest_crcs(manifest: dict) -> list:
    return [c["crc32c"] for c in manifest["chunks"]]


def unpack_params(manifest: dict, chunks: list, like):
    """The tree of `like` (same structure: the node's model) with leaves read from `chunks`
    (the checked chunk buffers, in manifest order): in place where a leaf lies in one chunk."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
    got = [e["path"] for e in manifest["leaves"]]
    if paths != got:
        raise ValueError(f"the learner's weights do not match this node's model: {len(got)} leaves "
                         f"({got[:3]}...) vs {len(paths)} ({paths[:3]}...)")
    starts = [c["offset"] for c in manifest["chunks"]]
    leaves = []
    for e in manifest["leaves"]:
        dtype = jax.numpy.dtype(e["dtype"])
        lo = e["offset"]
        hi = lo + int(np.prod(e["shape"], dtype=np.int64)) * dtype.itemsize
        first = bisect.bisect_right(starts, lo) - 1
        c = manifest["chunks"][first]
        if hi <= c["offset"] + c["nbytes"]:
            flat = np.frombuffer(chunks[first], np.uint8)[lo - c["offset"]:hi - c["offset"]]
        else:
            flat = np.empty(hi - lo, np.uint8)
            for i in range(first, len(starts)):
                c = manifest["chunks"][i]
                a, b = max(lo, c["offset"]), min(hi, c["offset"] + c["nbytes"])
                if a >= b:
                    break
                flat[a - lo:b - lo] = np.frombuffer(chunks[i], np.uint8)[a - c["offset"]:b - c["offset"]]
        leaves.append(flat.view(dtype).reshape(e["shape"]))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


# ---------------------------------------------------------------------- rollouts


def encode_group(batch) -> pa.Table:
    """One prompt group's rows (a host `TrajectoryBatch`) as a table."""
    rows = []
    for name in GROUP_FIELDS:
        x = getattr(batch, name)
        if x is None:
            continue
        x = np.ascontiguousarray(np.asarray(x))
        rows.append((name, x.dtype.name, list(x.shape), x.tobytes()))
    return pa.Table.from_pylist([dict(zip(_SCHEMA.names, r)) for r in rows], schema=_SCHEMA)


def decode_group(table: pa.Table) -> dict:
    """Field -> array; raises Rejected on an unknown or missing field, a wrong dtype or a size
    that does not match its shape."""
    if table.schema != _SCHEMA:
        raise Rejected(f"rollout table has schema {table.schema}, expected {_SCHEMA}")
    out = {}
    for row in table.to_pylist():
        name, dtype, shape, data = row["field"], row["dtype"], row["shape"], row["data"]
        if name not in GROUP_FIELDS or name in out:
            raise Rejected(f"rollout field {name!r} is unknown or repeated; fields: {', '.join(GROUP_FIELDS)}")
        if dtype != GROUP_FIELDS[name]:
            raise Rejected(f"rollout field {name!r} has dtype {dtype}, expected {GROUP_FIELDS[name]}")
        if any(d < 0 for d in shape) or len(data) != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise Rejected(f"rollout field {name!r}: {len(data)} bytes do not hold shape {shape} of {dtype}")
        out[name] = np.frombuffer(data, dtype).reshape(shape)
    missing = set(GROUP_FIELDS) - OPTIONAL - set(out)
    if missing:
        raise Rejected(f"rollout lacks fields {sorted(missing)}")
    return out


def check_group(f: dict, *, rows: int, prompt, vocab: int, topk: int, max_new_tokens: int,
                learner_version: int, min_version: int = 0, kept: bool = False, max_width: int = 1 << 30,
                reward_range: tuple = (-float("inf"), float("inf")), routing=None) -> None:
    """Raise Rejected unless `f` (decoded fields) is one group of `rows` samples answering
    `prompt` (token ids, left-padded into the prompt span) with at most `max_new_tokens` new
    tokens each, sampled by versions in [min_version, learner_version]. `kept`: whether the
    run's sampling truncates (top-k / top-p), so that every group carries `behav_kept` (a batch
    is assembled from groups of many nodes: one field for all or none); `reward_range`: the task's
    (`tasks.reward_range`); `routing`: `routing_spec`'s, when every group carries its experts."""
    toks = f["tokens"]
    if toks.ndim != 2 or toks.shape[0] != rows:
        raise Rejected(f"tokens have shape {toks.shape}, expected ({rows}, L)")
    b, width = toks.shape
    if width > max_width:
        raise Rejected(f"rows of width {width}; this run's are at most {max_width} wide", reason="size")
    p = width - max_new_tokens
    shapes = {n: (b, width) for n in ("loss_mask", "behav_logp", "versions", "input_mask", "behav_kept")}
    shapes.update(topk_ids=(b, width, topk), topk_logp=(b, width, topk), rewards=(b,), truncated=(b,))
    for n, want in shapes.items():
        if n in f and f[n].shape != want:
            raise Rejected(f"{n} has shape {f[n].shape}, expected {want}")
    if p < len(prompt):
        raise Rejected(f"rows of width {width} cannot hold the {len(prompt)}-token prompt and {max_new_tokens} "
                       "new tokens")
    if toks.min() < 0 or toks.max() >= vocab or (topk and (f["topk_ids"].min() < 0 or f["topk_ids"].max() >= vocab)):
        raise Rejected(f"token ids outside the vocabulary [0, {vocab})")
    gen = f["loss_mask"]
    if not np.isin(gen, (0.0, 1.0)).all() or gen[:, :p].any() or not np.isin(f["input_mask"], (0.0, 1.0)).all():
        raise Rejected("loss_mask / input_mask must be 0 or 1, and 0 on the prompt span")
    v = f["versions"][gen > 0]
    if v.size and (v.max() > learner_version or v.min() < min_version):
        raise Rejected(f"token versions span [{v.min()}, {v.max()}]; the learner is at version {learner_version} "
                       f"and leased no older than {min_version}")
    # At every stored position, not only where loss_mask > 0: a masked NaN still poisons the loss
    # (NaN * 0 is NaN). Top-K log-probs may be -inf (greedy sampling's zero-probability entries).
    top = f["topk_logp"] if topk else np.zeros(0, np.float32)
    if not (np.isfinite(f["behav_logp"]).all() and (f["behav_logp"] <= 1e-3).all() and not np.isnan(top).any()
            and (top <= 1e-3).all()) or not np.isfinite(f["rewards"]).all():
        raise Rejected("log-probs must be finite (top-K: not NaN) and <= 0 at every position, rewards finite")
    lo, hi = reward_range
    if not ((f["rewards"] >= lo - 1e-6) & (f["rewards"] <= hi + 1e-6)).all():
        raise Rejected(f"rewards span [{f['rewards'].min():g}, {f['rewards'].max():g}]; this task's lie in "
                       f"[{lo:g}, {hi:g}]")
    if ("behav_kept" in f) != kept:
        raise Rejected("behav_kept " + ("missing: this run's sampling truncates (top-k / top-p)" if kept else
                                        "given, but this run's sampling does not truncate"))
    if kept and (f["behav_kept"].min() < 0 or f["behav_kept"].max() > vocab):
        raise Rejected(f"behav_kept must be in [0, {vocab}]")
    if not (toks[:, p - len(prompt):p] == np.asarray(prompt, np.int32)).all():
        raise Rejected("the rows do not answer the leased prompt")
    _check_routing(f, routing)


def _check_routing(f: dict, routing) -> None:
    """A group's experts: present iff the run records them, [B, L, sparse layers, k], each id in
    [0, E), and k different experts at every real position (`input_mask`); the learner replays
    them (`model.moe.routing=replay`), so a forged id would pick another expert's weights."""
    if ("routing" in f) != (routing is not None):
        raise Rejected("routing " + ("missing: this run records each token's experts" if routing else
                                     "given, but this run records no experts"))
    if routing is None:
        return
    r, (layers, k, experts) = f["routing"], routing
    if r.shape != f["tokens"].shape + (layers, k):
        raise Rejected(f"routing has shape {r.shape}, expected {f['tokens'].shape + (layers, k)}")
    if r.size and (r.min() < 0 or r.max() >= experts):
        raise Rejected(f"routing: expert ids outside [0, {experts})")
    real = np.sort(r[f["input_mask"] > 0], -1)
    if (real[..., 1:] == real[..., :-1]).any():
        raise Rejected(f"routing: an expert chosen twice for one position; the sampler chooses {k} different ones")


def group_batch(f: dict) -> TrajectoryBatch:
    """Decoded fields -> a host `TrajectoryBatch` (group id 0, advantages 0: the learner's own)."""
    b, w = f["tokens"].shape
    return TrajectoryBatch(**{n: None if f.get(n) is None else np.array(f[n]) for n in GROUP_FIELDS},
                           group_ids=np.zeros(b, np.int32), advantages=np.zeros((b, w), np.float32))
