"""`remote/wire.py`: the weights artifact and the group table, every forgery refused."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_llm.remote import wire
from tests.remote_helpers import _group


# ---------------------------------------------------------------------- wire


def test_weights_artifact_roundtrip_and_checksums():
    big = np.arange(40, dtype=np.float32)  # 160 bytes: its own pieces of at most 64
    params = {"embed": np.arange(12, dtype=np.float32).reshape(3, 4), "big": big,
              "layers": [{"w": np.linspace(-1, 1, 10).astype(ml_dtypes.bfloat16)}, {"b": np.ones(7, np.float32)}]}
    manifest, buf = wire.pack_params(params, version=3, chunk_bytes=64)
    offsets = {e["path"]: e["offset"] for e in manifest["leaves"]}
    assert all(o % wire.ALIGN == 0 for o in offsets.values())
    spans = [(c["offset"], c["offset"] + c["nbytes"]) for c in manifest["chunks"]]
    assert spans == [(0, 64), (64, 128), (128, 160), (192, 240), (256, 276), (320, 348)]  # big; embed; w; b
    like = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params)
    chunks = [buf[lo:hi].tobytes() for lo, hi in spans]
    out = wire.unpack_params(json.loads(json.dumps(manifest)), chunks, like)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    for i, c in enumerate(chunks):
        wire.check_chunk(manifest, i, c)
    bad = bytearray(chunks[1])
    bad[3] ^= 1
    with pytest.raises(ValueError, match="chunk 1 fails its checksum"):
        wire.check_chunk(manifest, 1, bytes(bad))
    with pytest.raises(ValueError, match="chunk 0 fails its checksum"):
        wire.check_chunk(manifest, 0, chunks[0][:-1])
    with pytest.raises(ValueError, match="do not match this node's model"):
        wire.unpack_params(manifest, chunks, {"embed": like["embed"]})


def _check(f, **kw):
    args = dict(rows=2, prompt=(7, 8, 9), vocab=20, topk=2, max_new_tokens=3, learner_version=5, min_version=1,
                kept=True, reward_range=(0.0, 1.0), max_width=7)
    wire.check_group(f, **{**args, **kw})


def test_rollout_table_roundtrip_and_every_forgery_rejected():
    f = _group()
    batch = wire.group_batch(f)
    got = wire.decode_group(wire.encode_group(batch))
    assert set(got) == set(wire.GROUP_FIELDS) - {"routing"}  # a mixture of experts' (below)
    for name in got:
        np.testing.assert_array_equal(got[name], f[name])
    _check(got)
    forged = {
        "outside the vocabulary": dict(f, tokens=np.where(f["tokens"] == 1, 20, f["tokens"]).astype(np.int32)),
        "learner is at version 5": dict(f, versions=np.where(f["loss_mask"] > 0, 6, -1).astype(np.int32)),
        "leased no older than 1": dict(f, versions=np.where(f["loss_mask"] > 0, 0, -1).astype(np.int32)),
        "expected \\(2, L\\)": {n: x[:1] for n, x in f.items()},
        "topk_logp has shape": dict(f, topk_logp=f["topk_logp"][:, :, :1]),
        "do not answer the leased prompt": dict(f, tokens=np.where(f["tokens"] == 8, 5, f["tokens"]).astype(np.int32)),
        "log-probs must be finite": dict(f, behav_logp=-f["behav_logp"] + 0.5),
        # NaN / inf where loss_mask is 0 (the prompt span) still poisons the loss: NaN * 0 is NaN
        "log-probs must be finite ": dict(f, behav_logp=np.where(f["loss_mask"] > 0, f["behav_logp"], np.nan)),
        "log-probs must be finite  ": dict(f, behav_logp=np.where(f["loss_mask"] > 0, f["behav_logp"], -np.inf)),
        "top-K: not NaN": dict(f, topk_logp=np.where(f["loss_mask"][..., None] > 0, f["topk_logp"], np.inf)),
        "top-K: not NaN ": dict(f, topk_logp=np.where(f["loss_mask"][..., None] > 0, f["topk_logp"], np.nan)),
        "behav_kept must be in": dict(f, behav_kept=f["behav_kept"] * 10),
        # finite, but a single such reward skips every minibatch of its batch (the loss overflows)
        r"rewards span \[0, 3e\+38\]; this task's lie in \[0, 1\]": dict(f, rewards=np.float32([0, 3e38])),
        r"rewards span \[-0.5, 1\]": dict(f, rewards=np.float32([-0.5, 1])),
        "rows of width 8; this run's are at most 7 wide": {n: np.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
                                                           if x.ndim > 1 else x for n, x in f.items()},
    }
    for why, g in forged.items():
        with pytest.raises(wire.Rejected, match=why.strip()):
            _check(wire.decode_group(wire.encode_group(wire.group_batch(g))))
    # A batch is assembled from groups of many nodes: behav_kept is in all of them or none, as the
    # run's sampling decides (one group carrying it beside others without ended the learner).
    with pytest.raises(wire.Rejected, match="behav_kept given, but this run's sampling does not truncate"):
        _check(got, kept=False)
    with pytest.raises(wire.Rejected, match="behav_kept missing: this run's sampling truncates"):
        _check(wire.decode_group(wire.encode_group(batch.replace(behav_kept=None))))
    greedy = np.where(np.arange(2)[None, None, :] == 0, 0.0, -np.inf).astype(np.float32)  # honest -inf
    _check(dict(got, topk_logp=np.broadcast_to(greedy, got["topk_logp"].shape), behav_logp=0 * got["behav_logp"]))
    with pytest.raises(wire.Rejected, match="dtype float64, expected int32"):
        wire.decode_group(wire.encode_group(batch.replace(tokens=f["tokens"].astype(np.float64))))
    t = wire.encode_group(batch)
    with pytest.raises(wire.Rejected, match="bytes do not hold shape"):
        wire.decode_group(t.set_column(2, "shape", [[[9, 9]] * t.num_rows]))


def test_a_groups_experts_round_trip_and_forged_ones_are_refused():
    """Routing (a mixture of experts' experts per position, sparse layer and choice) travels as
    int16 and is checked where the learner would replay it: shape, ids in [0, E), k different
    experts at every real position, present exactly when the run records it."""
    f = _group()
    rng = np.random.default_rng(0)
    f["routing"] = np.argsort(rng.random((2, 7, 3, 4)), -1)[..., :2].astype(np.int16)  # 3 layers, top 2 of 4
    pad = f["input_mask"] == 0
    f["routing"][pad] = 0  # padding's (never decoded) may repeat an expert
    spec = (3, 2, 4)
    got = wire.decode_group(wire.encode_group(wire.group_batch(f)))
    np.testing.assert_array_equal(got["routing"], f["routing"])
    _check(got, routing=spec)
    assert wire.group_batch(got).routing.dtype == np.int16
    real = f["input_mask"] > 0
    twice, (i, j) = f["routing"].copy(), np.argwhere(real)[0]
    twice[i, j, 2, 1] = twice[i, j, 2, 0]
    forged = {r"expert ids outside \[0, 4\)": dict(f, routing=np.where(real[..., None, None], f["routing"] + 4, 0)),
              "ids outside": dict(f, routing=(f["routing"] - 1).astype(np.int16)),
              "an expert chosen twice": dict(f, routing=twice),
              r"routing has shape \(2, 7, 3, 1\)": dict(f, routing=f["routing"][..., :1])}
    for why, g in forged.items():
        with pytest.raises(wire.Rejected, match=why):
            _check(wire.decode_group(wire.encode_group(wire.group_batch(g))), routing=spec)
    with pytest.raises(wire.Rejected, match="routing missing: this run records each token's experts"):
        _check({k: v for k, v in got.items() if k != "routing"}, routing=spec)
    with pytest.raises(wire.Rejected, match="routing given, but this run records no experts"):
        _check(got)
    with pytest.raises(wire.Rejected, match="dtype int32, expected int16"):
        wire.decode_group(wire.encode_group(wire.group_batch(dict(f, routing=f["routing"].astype(np.int32)))))
    assert wire.max_group_bytes(2, 7, 2, spec) - wire.max_group_bytes(2, 7, 2) == 2 * 7 * 3 * 2 * 2


# ---------------------------------------------------------------------- leases
