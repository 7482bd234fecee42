"""Expert parallelism in the sampler (`experts.among_devices`, `Sampler.splits_experts`): a
mixture's experts split over the sampler's devices sample what one device holding them all
samples, and each device holds only its share, as the weight store publishes it and as the
memory plan counts it."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl_llm import models
from jaxrl_llm.models import decoder
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.run import memory
from jaxrl_llm.runtime.weights import WeightStore

CFG = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, head_dim=8, model_type="qwen2_moe", num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         shared_expert_intermediate_size=16)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3], [5], [7, 2]]
# rows 0-2 (the first device's of 4, static batching) stop after 2 tokens: the others decode on,
# and the first device must keep running their MoE layers' exchanges with them
LIMITS = [2, 2, 2] + [12] * 9


def _sampled(params, devices, dispatch, batching="static", split=True):
    s = Sampler(CFG.replace(moe_dispatch=dispatch),
                SamplerConfig(max_new_tokens=12, temperature=1.0, capture_topk=2, num_samples=2, prompt_buckets=(8,),
                              decode_segment=4, eos_token_id=3, record_routing=True, batching=batching, slots=4,
                              expert_parallel=split),
                mesh=Mesh(np.asarray(jax.devices()[:devices]), ("data",)))
    return s, jax.tree.map(np.asarray, s.generate(params, PROMPTS, jax.random.key(3), limits=LIMITS))


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("dispatch,batching", [("blocked", "static"), ("blocked", "continuous"), ("dense", "static"),
                                               ("grouped", "static")])
def test_experts_split_over_four_devices_sample_what_one_device_does(params, dispatch, batching):
    """Tokens, recorded routing (zeros past each row's end) and behaviour log-probs equal a
    one-device sampler's, with rows ending at different steps on different devices; each device
    holds 2 of the 8 experts (and the shared expert whole), and the program moves tokens, not
    weights: one all-gather and one reduce-scatter per sparse layer."""
    split, got = _sampled(params, 4, dispatch, batching)
    _, one = _sampled(params, 1, dispatch, batching)
    assert split.splits_experts
    np.testing.assert_array_equal(got.tokens, one.tokens)
    np.testing.assert_array_equal(got.routing, one.routing)
    np.testing.assert_allclose(got.behav_logp, one.behav_logp, atol=1e-5)
    assert got.loss_mask[:3].sum(1).max() <= 2 < got.loss_mask[3:].sum(1).max()
    after = ~(got.input_mask[:, 8:] > 0)  # new-token columns past a row's end
    assert after.any() and not got.routing[:, 8:][after].any()
    placed = split.place_params(params)
    moe = placed["layers_0"]["moe"]
    assert {s.data.shape[0] for s in moe["gate"].addressable_shards} == {2}
    assert moe["shared_gate"].addressable_shards[0].data.shape == moe["shared_gate"].shape
    if batching == "static":
        hlo = split.lower_generate(params, PROMPTS, jax.random.key(3)).as_text()
        assert hlo.count("all_gather") >= 3 * CFG.num_layers and "reduce_scatter" in hlo, hlo.count("all_gather")


def test_split_off_or_an_indivisible_count_replicates_them(params):
    assert not _sampled(params, 4, "dense", split=False)[0].splits_experts
    assert not Sampler(CFG, SamplerConfig(), mesh=Mesh(np.asarray(jax.devices()[:3]), ("data",))).splits_experts
    assert not Sampler(CFG.replace(num_experts=0), SamplerConfig(),
                       mesh=Mesh(np.asarray(jax.devices()[:4]), ("data",))).splits_experts


def test_the_weight_store_publishes_each_devices_share_and_the_plan_counts_it(params):
    """Published onto the sampler's shardings (once: the sampler takes the copy as it is), each
    device's bytes are what the memory plan's sampler parts say: the replicated weights and a
    quarter of the experts."""
    s = Sampler(CFG, SamplerConfig(max_new_tokens=4), mesh=Mesh(np.asarray(jax.devices()[:4]), ("data",)))
    store = WeightStore(placement=s.shardings)
    store.publish(0, params)
    copy = store.latest()[1]
    assert s.place_params(copy) is copy
    device = jax.devices()[0]
    held = sum(sh.data.nbytes for x in jax.tree.leaves(copy) for sh in x.addressable_shards if sh.device == device)
    plan = memory.sampler(CFG, 4, 8, 4, split_experts=4)
    assert plan["weights"] + plan["experts"] == held
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    assert memory.sampler(CFG, 4, 8, 4)["weights"] == whole and plan["experts"] * 4 == 4 * CFG.expert_params


def test_a_run_splits_its_samplers_experts_and_samples_the_learners_log_probs(tmp_path):
    """A random 8-expert policy in a run on 8 devices: the samplers split the experts (the run
    says so), and the sampled log-probs are the learner's (mismatch < 1e-4, float32), as with
    the experts replicated."""
    import json

    from jaxrl_llm.run import experiment
    from tests.test_experiment import _tiny

    c = _tiny("ppo", mode="async")
    c.model.moe.update(experts=8, top_k=2, intermediate_size=16)
    c.train.update(steps=2, eval_every=2, save_every=2)
    lines = []
    assert experiment.run(c, str(tmp_path), log=lines.append)["version"] == 2
    assert "samplers: each of 8 devices holds 1 of every layer's experts" in "\n".join(lines)
    steps = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert len(steps) == 2 and max(s["mismatch/abs_logp_max"] for s in steps) < 1e-4
