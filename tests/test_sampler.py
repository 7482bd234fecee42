"""The jitted sampler against transformers, the learner-side head, the softmax it claims, and a
mixture's experts split over its devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from scipy import stats

from jaxrl_llm import models
from jaxrl_llm.models import decoder
from jaxrl_llm.models.policy_dist import PolicyDist
from jaxrl_llm.rollout import Sampler, SamplerConfig, sampling_logprobs
from jaxrl_llm.run import memory
from jaxrl_llm.runtime.weights import WeightStore
from tests import hf_fixtures as F


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model = F.make_hf_model("qwen2_tied", vocab=61)
    params, cfg = models.load_params(F.save(model, str(tmp_path_factory.mktemp("q"))))
    return model, params, cfg


PROMPTS = [[5, 9, 2, 33, 4], [7] * 9, [1, 2, 3], [60, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_greedy_matches_transformers_generate(qwen):
    model, params, cfg = qwen
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=14, temperature=0.0, prompt_buckets=(16,), decode_segment=5, num_samples=1, capture_topk=0))
    batch = sampler.generate(params, PROMPTS, jax.random.key(0)).validate()
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # explicit mask: the prompt may contain the pad id
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        np.testing.assert_array_equal(np.asarray(batch.tokens[i, 16:]), out[0, len(prompt):].numpy())


def test_behaviour_logprobs_and_topk_match_learner_head(qwen):
    _, params, cfg = qwen
    scfg = SamplerConfig(max_new_tokens=20, temperature=0.8, capture_topk=5, num_samples=3, prompt_buckets=(16,))
    batch = Sampler(cfg, scfg).generate(params, PROMPTS, jax.random.key(1), version=7).validate()
    assert batch.shape == (12, 36) and batch.topk == 5
    np.testing.assert_array_equal(batch.group_ids, np.repeat(np.arange(4), 3))
    gen = np.asarray(batch.loss_mask) > 0
    assert gen[:, 16:].all() and not gen[:, :16].any()
    assert set(np.asarray(batch.versions)[gen].tolist()) == {7} and (np.asarray(batch.versions)[~gen] == -1).all()
    learner = models.sequence_logprobs(params, cfg, batch.tokens, batch.input_mask, dist=PolicyDist(0.8), topk=5,
                                       gather_ids_BxLxK=batch.topk_ids)
    np.testing.assert_allclose(np.asarray(learner["logp"])[gen], np.asarray(batch.behav_logp)[gen], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(learner["topk_ids"])[gen], np.asarray(batch.topk_ids)[gen])
    np.testing.assert_allclose(np.asarray(learner["topk_logp"])[gen], np.asarray(batch.topk_logp)[gen], atol=1e-5)
    # sanity: the rows of one group differ (they are samples, not copies)
    assert len({tuple(r) for r in np.asarray(batch.tokens[:3])}) > 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.3, 0, 1.0), (1.0, 6, 1.0), (0.9, 0, 0.7), (1.0, 8, 0.8)])
def test_empirical_frequencies_match_sampling_distribution(qwen, temperature, top_k, top_p):
    _, params, cfg = qwen
    prompt, n = [3, 14, 15, 9, 26], 4000
    scfg = SamplerConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, num_samples=n,
                         prompt_buckets=(8,), capture_topk=0)
    batch = Sampler(cfg, scfg).generate(params, [prompt], jax.random.key(2))
    first = np.asarray(batch.tokens[:, 8])
    logits = models.full_logits(params, cfg, jnp.asarray([prompt]))[:, -1]
    logp_all, kept = sampling_logprobs(logits, scfg)
    logp = np.asarray(logp_all[0], np.float64)
    p = np.exp(logp)
    support = p > 0
    if top_k or top_p < 1:
        assert support.sum() < cfg.vocab_size
    assert support[first].all(), "sampled a token outside the truncated support"
    assert int(kept[0]) == support.sum()
    if top_k or top_p < 1:  # the batch records each token's support size for the learner
        np.testing.assert_array_equal(np.asarray(batch.behav_kept[:, 8]), support.sum())
    else:
        assert batch.behav_kept is None
    np.testing.assert_allclose(np.asarray(batch.behav_logp[:, 8]), logp[first], atol=1e-5)
    counts = np.bincount(first, minlength=cfg.vocab_size)
    big = support & (p * n >= 5)  # chi-square needs expected counts >= 5; pool the tail
    obs = np.append(counts[big], counts[support & ~big].sum())
    exp = np.append(p[big] * n, p[support & ~big].sum() * n)
    keep = exp > 0
    pvalue = stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    assert pvalue > 1e-3, pvalue


def test_eos_stops_rows_and_truncation_flags(tmp_path):
    model = F.make_hf_model("llama3", vocab=7)
    params, cfg = models.load_params(F.save(model, str(tmp_path)))
    eos = 3
    scfg = SamplerConfig(max_new_tokens=12, temperature=1.5, eos_token_id=eos, pad_token_id=0, num_samples=32,
                         prompt_buckets=(4,), decode_segment=4, capture_topk=0)
    batch = Sampler(cfg, scfg).generate(params, [[1, 2]], jax.random.key(3))
    tokens, mask = np.asarray(batch.tokens[:, 4:]), np.asarray(batch.loss_mask[:, 4:])
    ended = 0
    for row, m, trunc in zip(tokens, mask, np.asarray(batch.truncated)):
        hits = np.flatnonzero(row == eos)
        if len(hits):
            end = hits[0]
            ended += 1
            assert not trunc
            assert m[: end + 1].all() and not m[end + 1:].any()  # EOS itself is trained on
            assert (row[end + 1:] == 0).all()
        else:
            assert trunc and m.all()
    assert 0 < ended < 32  # P(no EOS in 12 tokens) ~ 0.16 per row: both kinds of row occur
    assert (np.asarray(batch.versions[:, 4:])[mask == 0] == -1).all()
    assert (np.asarray(batch.behav_logp[:, 4:])[mask == 0] == 0).all()
    np.testing.assert_array_equal(batch.input_mask[:, 4:], batch.loss_mask[:, 4:])


def test_reproducible_and_no_retrace_within_a_bucket(qwen, monkeypatch):
    from jaxrl_llm.rollout import decode

    traced, real = [], decode.generate
    monkeypatch.setattr(decode, "generate", lambda *a, **kw: (traced.append(1), real(*a, **kw))[1])
    _, params, cfg = qwen
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=6, prompt_buckets=(8, 16), capture_topk=2, num_samples=1))
    a = sampler.generate(params, PROMPTS[:3], jax.random.key(4))
    b = sampler.generate(params, PROMPTS[:3], jax.random.key(4))
    # other prompts, lengths and version, same bucket (longest prompt in (8, 16]) and batch size
    c = sampler.generate(params, [[1] * 12, [3], [4, 5, 6, 7]], jax.random.key(5), version=3)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(sampler.generate(params, PROMPTS[:3], jax.random.key(6)).tokens))
    assert a.tokens.shape == c.tokens.shape == (3, 22)
    assert len(traced) == 1  # one compiled program for the bucket


def test_bucket_selection_and_errors(qwen):
    _, params, cfg = qwen
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=2, prompt_buckets=(4, 8), num_samples=1, capture_topk=0))
    assert sampler.generate(params, [[1, 2, 3]], jax.random.key(0)).tokens.shape == (1, 6)
    assert sampler.generate(params, [[1, 2, 3, 4, 5]], jax.random.key(0)).tokens.shape == (1, 10)
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        sampler.generate(params, [list(range(9))], jax.random.key(0))
    with pytest.raises(ValueError, match="non-empty"):
        sampler.generate(params, [[]], jax.random.key(0))
    with pytest.raises(ValueError, match="invalid sampling options"):
        SamplerConfig(top_p=0.0)


def test_mid_generation_refresh_tags_each_token_with_its_params_version(qwen):
    _, params, cfg = qwen
    sampler = Sampler(cfg, SamplerConfig(max_new_tokens=14, temperature=1.0, prompt_buckets=(16,), decode_segment=5, num_samples=1, capture_topk=0))
    key = jax.random.key(3)
    plain = sampler.generate(params, PROMPTS, key, version=4)
    # Same weights under new version numbers: identical tokens; segments end at 5, 10, 14 and
    # token t is drawn from the logits of step t-1, so tokens 0-5 carry v4, 6-10 v5, 11-13 v6.
    calls = iter([(5, params), (6, params)])
    same = sampler.generate(params, PROMPTS, key, version=4, refresh=lambda: next(calls)).validate()
    np.testing.assert_array_equal(np.asarray(same.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(same.behav_logp), np.asarray(plain.behav_logp), atol=1e-6)
    want = np.array([4] * 6 + [5] * 5 + [6] * 3)
    np.testing.assert_array_equal(np.asarray(same.versions[:, 16:]), np.broadcast_to(want, (4, 14)))
    # New weights from segment 1 on: tokens up to 5 are unchanged, later log-probs come from them.
    other = jax.tree.map(lambda x: x * 1.5, params)
    swapped = sampler.generate(params, PROMPTS, key, version=4, refresh=lambda: (9, other))
    np.testing.assert_array_equal(np.asarray(swapped.tokens[:, 16:22]), np.asarray(plain.tokens[:, 16:22]))
    assert not np.allclose(np.asarray(swapped.behav_logp[:, 22:]), np.asarray(plain.behav_logp[:, 22:]))
    assert set(np.asarray(swapped.versions[:, 22:]).ravel().tolist()) == {9}
    stale = sampler.generate(params, PROMPTS, key, version=4, refresh=lambda: (3, other))  # older: ignored
    np.testing.assert_array_equal(np.asarray(stale.tokens), np.asarray(plain.tokens))
    assert sampler._segment._cache_size() == 1  # one program for the three segments (`end` is an input)


def _skewed_logp(v, rows, seed, keep=None):
    """log-softmax rows with a wide dynamic range; `keep` < v leaves only that many finite."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, v)) * 3.0
    if keep is not None:
        kth = -np.sort(-logits, -1)[:, keep - 1: keep]
        logits = np.where(logits >= kth, logits, -np.inf)
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1))


@pytest.mark.parametrize("v,keep,block", [(1000, None, None), (512, None, 32), (512, 7, 32), (8192, None, 256),
                                          (8192, 5, 256), (12288, 300, 256)])
def test_inverse_cdf_matches_numpy_searchsorted(v, keep, block):
    """The inverse CDF (two-level where V splits into blocks) picks the token NumPy's float64
    CDF picks."""
    from jaxrl_llm.rollout.sampling import cdf_block as _cdf_block, inverse_cdf as _inverse_cdf

    assert _cdf_block(v) == block
    logp = _skewed_logp(v, 64, seed=v + (keep or 0), keep=keep)
    u = np.random.default_rng(1).uniform(size=64)
    got = np.asarray(jax.jit(_inverse_cdf)(jnp.asarray(logp), jnp.asarray(u, jnp.float32)))
    p = np.exp(logp.astype(np.float64))
    cdf = np.cumsum(p, -1)
    want = np.array([np.searchsorted(c, ui * c[-1], side="right") for c, ui in zip(cdf, u)])
    # float32 rounding may move a draw lying within 1e-5 of a boundary; none of these do
    assert (got == want).mean() == 1.0, np.flatnonzero(got != want)
    assert np.isfinite(logp[np.arange(64), got]).all()


@pytest.mark.parametrize("v,keep", [(512, None), (8192, None), (32768, None), (8192, 3)])
def test_top_k_equals_lax_top_k(v, keep):
    from jaxrl_llm.rollout.sampling import top_k

    logp = jnp.asarray(_skewed_logp(v, 16, seed=v, keep=keep))
    vals, ids = jax.jit(top_k, static_argnums=1)(logp, 8)
    ref_vals, ref_ids = jax.lax.top_k(logp, 8)
    np.testing.assert_array_equal(vals, ref_vals)
    ids, ref_ids = np.asarray(ids), np.asarray(ref_ids)
    finite = np.isfinite(np.asarray(ref_vals))
    np.testing.assert_array_equal(ids[finite], ref_ids[finite])
    # past the support (-inf ties) the ids may differ but stay distinct, valid and -inf
    assert ((ids >= 0) & (ids < v)).all() and all(len(set(r)) == 8 for r in ids)
    assert np.isneginf(np.take_along_axis(np.asarray(logp), ids, -1)[~finite]).all()


@pytest.mark.parametrize("shape,refresh", [((2,), False), ((8,), True), ((2, 2), False)])
def test_data_parallel_mesh_matches_one_device(qwen, shape, refresh):
    """Rows split over a mesh (12 rows: 6 per device on 2; padded to 16 on 8; over both axes of
    a 2 x 2 mesh) sample the same tokens and log-probs as one device (each device draws by
    global row id); mid-generation refresh keeps working on the mesh."""
    from jax.sharding import Mesh

    _, params, cfg = qwen
    scfg = SamplerConfig(max_new_tokens=8, num_samples=3, capture_topk=4, prompt_buckets=(16,), decode_segment=4)
    one = Sampler(cfg, scfg)
    mesh = Mesh(np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape), ("data", "fsdp")[:len(shape)])
    sharded = Sampler(cfg, scfg, mesh=mesh)
    kw = dict(refresh=(lambda: (1, params))) if refresh else {}
    a = one.generate(params, PROMPTS, jax.random.key(5), 0, **kw)
    b = sharded.generate(params, PROMPTS, jax.random.key(5), 0, **kw)
    assert b.tokens.shape == a.tokens.shape == (12, 24)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.versions, a.versions)
    np.testing.assert_allclose(b.behav_logp, a.behav_logp, atol=1e-5)
    np.testing.assert_allclose(b.topk_logp, a.topk_logp, atol=1e-5)
    if refresh:
        assert set(np.asarray(b.versions)[:, 16:].ravel()) == {0, 1}


# ---------------------------------------------------------------- a mixture's experts split over the devices
# (`experts.among_devices`, `Sampler.splits_experts`): what one device holding them all samples,
# each device holding only its share, as the weight store publishes it and the memory plan counts it.

MOE_CFG = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, head_dim=8, model_type="qwen2_moe", num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                             shared_expert_intermediate_size=16)
MOE_PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3], [5], [7, 2]]
# rows 0-2 (the first device's of 4, static batching) stop after 2 tokens: the others decode on,
# and the first device must keep running their MoE layers' exchanges with them
MOE_LIMITS = [2, 2, 2] + [12] * 9


def _moe_sampled(params, devices, dispatch, batching="static", split=True, exchange="gather"):
    s = Sampler(MOE_CFG.replace(moe_dispatch=dispatch, moe_exchange=exchange),
                SamplerConfig(max_new_tokens=12, temperature=1.0, capture_topk=2, num_samples=2, prompt_buckets=(8,),
                              decode_segment=4, eos_token_id=3, record_routing=True, batching=batching, slots=4,
                              expert_parallel=split),
                mesh=Mesh(np.asarray(jax.devices()[:devices]), ("data",)))
    return s, jax.tree.map(np.asarray, s.generate(params, MOE_PROMPTS, jax.random.key(3), limits=MOE_LIMITS))


@pytest.fixture(scope="module")
def moe_params():
    return decoder.init_params(MOE_CFG, jax.random.key(0))


@pytest.mark.parametrize("dispatch,batching,exchange", [
    ("blocked", "static", "gather"), ("blocked", "continuous", "gather"), ("dense", "static", "gather"),
    ("grouped", "static", "gather"), ("blocked", "continuous", "all_to_all")])
def test_experts_split_over_four_devices_sample_what_one_device_does(moe_params, dispatch, batching, exchange):
    """Tokens, recorded routing (zeros past each row's end) and behaviour log-probs equal a
    one-device sampler's, with rows ending at different steps on different devices; each device
    holds 2 of the 8 experts (and the shared expert whole), and the program moves tokens, not
    weights: one all-gather (of tokens, weights and expert ids together) and one reduce-scatter
    per sparse layer (or with `moe_exchange=all_to_all`, all-to-alls)."""
    split, got = _moe_sampled(moe_params, 4, dispatch, batching, exchange=exchange)
    _, one = _moe_sampled(moe_params, 1, dispatch, batching)
    assert split.splits_experts
    np.testing.assert_array_equal(got.tokens, one.tokens)
    np.testing.assert_array_equal(got.routing, one.routing)
    np.testing.assert_allclose(got.behav_logp, one.behav_logp, atol=1e-5)
    assert got.loss_mask[:3].sum(1).max() <= 2 < got.loss_mask[3:].sum(1).max()
    after = ~(got.input_mask[:, 8:] > 0)  # new-token columns past a row's end
    assert after.any() and not got.routing[:, 8:][after].any()
    placed = split.place_params(moe_params)
    moe = placed["layers_0"]["moe"]
    assert {s.data.shape[0] for s in moe["gate"].addressable_shards} == {2}
    assert moe["shared_gate"].addressable_shards[0].data.shape == moe["shared_gate"].shape
    if batching == "static":
        hlo = split.lower_generate(moe_params, MOE_PROMPTS, jax.random.key(3)).as_text()
        gathers = [line for line in hlo.splitlines() if '"stablehlo.all_gather"' in line]
        # prefill's and the decode loop's: tokens, weights and expert ids in one (`exchange.gather_rows`)
        assert len(gathers) == 2 * MOE_CFG.num_layers and all("xui8>" in line for line in gathers), len(gathers)
        assert hlo.count('"stablehlo.reduce_scatter"') == 2 * MOE_CFG.num_layers


def test_split_off_or_an_indivisible_count_replicates_them(moe_params):
    assert not _moe_sampled(moe_params, 4, "dense", split=False)[0].splits_experts
    assert not Sampler(MOE_CFG, SamplerConfig(), mesh=Mesh(np.asarray(jax.devices()[:3]), ("data",))).splits_experts
    assert not Sampler(MOE_CFG.replace(num_experts=0), SamplerConfig(),
                       mesh=Mesh(np.asarray(jax.devices()[:4]), ("data",))).splits_experts


def test_the_weight_store_publishes_each_devices_share_and_the_plan_counts_it(moe_params):
    """Published onto the sampler's shardings (once: the sampler takes the copy as it is), each
    device's bytes are what the memory plan's sampler parts say: the replicated weights and a
    quarter of the experts."""
    s = Sampler(MOE_CFG, SamplerConfig(max_new_tokens=4), mesh=Mesh(np.asarray(jax.devices()[:4]), ("data",)))
    store = WeightStore(placement=s.shardings)
    store.publish(0, moe_params)
    copy = store.latest()[1]
    assert s.place_params(copy) is copy
    device = jax.devices()[0]
    held = sum(sh.data.nbytes for x in jax.tree.leaves(copy) for sh in x.addressable_shards if sh.device == device)
    plan = memory.sampler(MOE_CFG, 4, 8, 4, split_experts=4)
    assert plan["weights"] + plan["experts"] == held
    whole = sum(x.nbytes for x in jax.tree.leaves(moe_params))
    assert memory.sampler(MOE_CFG, 4, 8, 4)["weights"] == whole and plan["experts"] * 4 == 4 * MOE_CFG.expert_params


def test_a_run_splits_its_samplers_experts_and_samples_the_learners_log_probs(tmp_path):
    """A random 8-expert policy in a run on 8 devices, its samplers tensor parallel in pairs
    (`sampler.tensor=2`): the samplers split the experts over the 4 row devices and the rest
    over each pair (the run says both), and the sampled log-probs are the learner's (mismatch
    < 1e-4, float32), as with the experts replicated."""
    import json

    from jaxrl_llm.run import experiment
    from tests.test_experiment import _tiny

    c = _tiny("ppo", mode="async")
    c.model.moe.update(experts=8, top_k=2, intermediate_size=16)
    c.train.update(steps=2, eval_every=2, save_every=2)
    c.sampler.tensor = 2
    lines = []
    assert experiment.run(c, str(tmp_path), log=lines.append)["version"] == 2
    assert "samplers: each of 4 devices holds 2 of every layer's experts" in "\n".join(lines)
    assert "samplers: tensor parallel, each group of 2 devices splits" in "\n".join(lines)
    steps = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert len(steps) == 2 and max(s["mismatch/abs_logp_max"] for s in steps) < 1e-4
