"""The one staleness definition, on every kind of input the project hands it."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import staleness as S
from jaxrl_llm import testing
from jaxrl_llm.objectives import common


def test_definition_prompt_pad_and_future_tokens():
    versions = np.array([[-1, -1, 3, 4, 5, 7], [-1, 0, 0, 1, -1, -1]])
    want = np.array([[0, 0, 2, 1, 0, 0], [0, 5, 5, 4, 0, 0]])  # learner at 5; version 7 claims the future
    np.testing.assert_array_equal(S.staleness(5, versions), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(S.staleness)(jnp.int32(5), jnp.asarray(versions))), want)
    assert S.staleness(5, 2) == 3 and S.staleness(5, -1) == 0


def test_bound_and_batch_helpers():
    assert not S.exceeds(4, 4) and S.exceeds(5, 4) and not S.exceeds(100, -1) and not S.exceeds(3, None)
    versions = np.array([[-1, 2, 3], [-1, 4, -1]])
    mask = np.array([[0, 1, 1], [0, 1, 0]])
    np.testing.assert_array_equal(S.of_batch(5, versions, mask), [3, 2, 1])
    assert S.oldest_version(versions, mask) == 2 and S.oldest_version(versions, 0 * mask) == -1


def test_objectives_use_the_same_definition():
    s = testing.random_batch(seed=1)
    got = np.asarray(common.staleness(s.policy, s.batch))
    np.testing.assert_array_equal(got, S.staleness(int(s.policy.version), np.asarray(s.batch.versions)))
