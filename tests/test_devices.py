"""`rollout/devices.py`: tensor-parallel samplers (`sampler.tensor`) sample what one device does,
static and continuous, dense and mixture-of-experts; each device holds its share of the weights
and of the KV cache, as the memory plan counts; a size that does not divide is refused."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl_llm import models
from jaxrl_llm.models import decoder
from jaxrl_llm.rollout import Sampler, SamplerConfig
from jaxrl_llm.run import memory
from tests.test_sampler import MOE_CFG, MOE_LIMITS, MOE_PROMPTS

CFG = models.ModelConfig(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, head_dim=8, model_type="qwen2")


def _sampler(cfg, devices, tensor, batching="static", new=12, record=False):
    return Sampler(cfg, SamplerConfig(max_new_tokens=new, temperature=1.0, capture_topk=2, num_samples=2,
                                      prompt_buckets=(8,), decode_segment=4, eos_token_id=3, batching=batching,
                                      slots=4, tensor=tensor, record_routing=record),
                   mesh=Mesh(np.asarray(jax.devices()[:devices]), ("data",)))


def _bytes_on(tree, device):
    return sum(sh.data.nbytes for x in jax.tree.leaves(tree) for sh in x.addressable_shards if sh.device == device)


def _held(tree, device):
    return {jax.tree_util.keystr(p): [s.data.shape for s in x.addressable_shards if s.device == device][0]
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_tensor_parallel_samplers_sample_what_one_device_does(params, batching):
    """4 devices as data 2 x tensor 2: the tokens and behaviour log-probs (1e-5) of one device;
    every device holds half of each attention and MLP projection, the embedding and the head,
    and the norms whole."""
    s = _sampler(CFG, 4, 2, batching)
    got = jax.tree.map(np.asarray, s.generate(params, MOE_PROMPTS, jax.random.key(3), limits=MOE_LIMITS))
    one = jax.tree.map(np.asarray, _sampler(CFG, 1, 1, batching).generate(params, MOE_PROMPTS, jax.random.key(3),
                                                                           limits=MOE_LIMITS))
    np.testing.assert_array_equal(got.tokens, one.tokens)
    np.testing.assert_allclose(got.behav_logp, one.behav_logp, atol=1e-5)
    assert s.row_devices == 2 and dict(s.mesh.shape) == {"data": 2, "tensor": 2}
    held = _held(s.place_params(params), jax.devices()[3])
    assert held["['layers_0']['attn']['q']['kernel']"] == (32, 2, 8)  # 4 heads: 2 here
    assert held["['layers_0']['attn']['k']['kernel']"] == (32, 1, 8)
    assert held["['layers_1']['attn']['o']['kernel']"] == (2, 8, 32)
    assert held["['layers_1']['mlp']['down']['kernel']"] == (32, 32)
    assert held["['embed']"] == (12, 32) and held["['lm_head']"] == (32, 12)
    assert held["['final_norm']['scale']"] == (32,)


def test_each_device_holds_half_the_cache_and_the_plan_counts_its_share(params):
    """At the same rows per device, a tensor pair's program holds about half the temporary bytes
    (the KV cache dominates at 200 new tokens) of a data-parallel one; the plan's weights per
    device are the placed shards' bytes (the norms, whole, within 2%)."""
    prompts = MOE_PROMPTS * 4
    temp = {t: _sampler(CFG, 2 * t, t, new=200).lower_generate(params, prompts, jax.random.key(3)).compile()
            .memory_analysis().temp_size_in_bytes for t in (1, 2)}
    assert 0.4 < temp[2] / temp[1] < 0.6, temp
    s = _sampler(CFG, 4, 2)
    placed = s.place_params(params)
    held = _bytes_on(placed, jax.devices()[0])
    plan = memory.sampler(CFG, 12, 8, 12, tensor=2)
    assert plan["weights"] == pytest.approx(held, rel=0.02) and plan["weights"] < 0.55 * CFG.num_params * 4
    assert plan["kv_cache"] * 2 == memory.sampler(CFG, 12, 8, 12)["kv_cache"]


def test_a_mixture_of_experts_splits_its_experts_over_the_rows_and_the_rest_over_tensor():
    """MoE (a shared expert, top 2 of 8) on data 2 x tensor 2: the tokens, routing and log-probs
    of one device; the stacked experts split over the 2 row devices (4 each) and their width
    over tensor, the shared expert's MLP over tensor, as the plan counts them."""
    moe_params = decoder.init_params(MOE_CFG, jax.random.key(0))
    s = _sampler(MOE_CFG, 4, 2, new=12, record=True)
    got = jax.tree.map(np.asarray, s.generate(moe_params, MOE_PROMPTS, jax.random.key(3), limits=MOE_LIMITS))
    one = jax.tree.map(np.asarray, _sampler(MOE_CFG, 1, 1, new=12, record=True).generate(
        moe_params, MOE_PROMPTS, jax.random.key(3), limits=MOE_LIMITS))
    np.testing.assert_array_equal(got.tokens, one.tokens)
    np.testing.assert_array_equal(got.routing, one.routing)
    np.testing.assert_allclose(got.behav_logp, one.behav_logp, atol=1e-5)
    assert s.splits_experts
    placed = s.place_params(moe_params)
    held = _held(placed, jax.devices()[1])
    assert held["['layers_0']['moe']['gate']"] == (4, 32, 8)
    assert held["['layers_0']['moe']['shared_gate']"] == (32, 8)
    nbytes = _bytes_on(placed, jax.devices()[1])
    plan = memory.sampler(MOE_CFG, 6, 8, 12, split_experts=2, tensor=2)
    # the routers and norms are whole on every device; the plan splits them too (3% of this tiny model)
    assert plan["weights"] + plan["experts"] == pytest.approx(nbytes, rel=0.04)
    assert plan["experts"] * 2 * 2 == MOE_CFG.expert_params * 4


def test_a_tensor_size_that_does_not_divide_the_devices_is_refused():
    from jaxrl_llm.run import plan
    from tests.test_experiment import _tiny

    with pytest.raises(ValueError, match=r"sampler.tensor=3 must divide the sampler's devices \(4\).*\[1, 2, 4\]"):
        _sampler(CFG, 4, 3)
    c = _tiny("ppo", mode="async")
    c.sampler.tensor = 3  # checked before anything is built (the suite's 8 devices)
    with pytest.raises(ValueError, match=r"sampler.tensor=3 must divide the sampler's devices \(8\): set "
                                         r"--config.sampler.tensor to one of \[1, 2, 4, 8\]"):
        plan.resolve(c)
