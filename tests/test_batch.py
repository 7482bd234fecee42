import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import testing
from jaxrl_llm.batch import PolicyOutput, TrajectoryBatch


def test_valid_batch_passes_and_is_a_pytree():
    s = testing.random_batch(0, topk=3)
    assert s.batch.validate() is s.batch
    s.policy.validate(s.batch)
    assert s.batch.topk == 3 and s.batch.shape == (12, 12)
    leaves = jax.tree_util.tree_leaves(s.batch)
    assert len(leaves) == 13  # every field present in the synthetic batch
    doubled = jax.tree_util.tree_map(lambda x: x, s.batch)
    assert isinstance(doubled, TrajectoryBatch)


def test_topk_zero_is_allowed():
    s = testing.random_batch(0)
    b = s.batch.replace(topk_ids=jnp.zeros((12, 12, 0), jnp.int32), topk_logp=jnp.zeros((12, 12, 0)),
                        prox_topk_logp=None)
    assert b.validate().topk == 0


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("behav_logp", jnp.zeros((12, 11)), r"TrajectoryBatch.behav_logp: expected shape \[B=12, L=12\]"),
        ("versions", jnp.zeros((12, 12), jnp.float32), "TrajectoryBatch.versions: expected an integer dtype"),
        ("tokens", jnp.zeros((12, 12), jnp.float32), "TrajectoryBatch.tokens: expected an integer dtype"),
        ("topk_logp", jnp.zeros((12, 12, 5)), r"TrajectoryBatch.topk_logp: expected shape \[B=12, L=12, K=4\]"),
        ("rewards", jnp.zeros((12, 1)), r"TrajectoryBatch.rewards"),
        ("group_ids", jnp.zeros(12, jnp.float32), "TrajectoryBatch.group_ids: expected an integer dtype"),
        ("prox_logp", jnp.zeros((3, 12)), "TrajectoryBatch.prox_logp"),
        ("truncated", jnp.zeros(12, jnp.int32), "TrajectoryBatch.truncated: expected bool"),
    ],
)
def test_wrong_field_is_named(field, value, match):
    s = testing.random_batch(0)
    with pytest.raises(ValueError, match=match):
        s.batch.replace(**{field: value}).validate()


def test_policy_output_checked_against_batch():
    s = testing.random_batch(0)
    with pytest.raises(ValueError, match="PolicyOutput.logp: shape"):
        s.policy.replace(logp=jnp.zeros((12, 10))).validate(s.batch)
    with pytest.raises(ValueError, match="PolicyOutput.logp_at_behav_topk"):
        s.policy.replace(logp_at_behav_topk=jnp.zeros((12, 12, 2))).validate(s.batch)
    with pytest.raises(ValueError, match="PolicyOutput.version: expected an integer"):
        s.policy.replace(version=jnp.asarray(1.5)).validate(s.batch)


def test_validate_works_under_jit():
    s = testing.random_batch(0)

    @jax.jit
    def f(batch):
        batch.validate()
        return batch.loss_mask.sum()

    assert float(f(s.batch)) == float(np.asarray(s.batch.loss_mask).sum())
    with pytest.raises(ValueError, match="behav_logp"):
        f(s.batch.replace(behav_logp=jnp.zeros((12, 3))))


def test_policy_output_minimal():
    PolicyOutput(logp=jnp.zeros((2, 3)), version=jnp.asarray(0)).validate()
