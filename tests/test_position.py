"""DataPosition: what each async sampler worker has delivered, and what it generates next."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from jaxrl_llm.runtime.position import DataPosition


def _next(position, worker, n):
    return list(itertools.islice(position.todo(worker), n))


def test_out_of_order_groups_leave_only_the_missing_ones_to_generate():
    pos = DataPosition(3)
    pos.deliver(0, 0)  # a whole draw (static batching)
    pos.deliver(0, 2, [1])
    pos.deliver(0, 1, [0, 2])
    assert pos.delivered(0) == (1, {1: [0, 2], 2: [1]})
    assert _next(pos, 0, 3) == [(1, [1]), (2, [0, 2]), (3, [0, 1, 2])]
    assert _next(pos, 1, 1) == [(0, [0, 1, 2])]  # workers are independent
    pos.deliver(0, 1, [1])
    assert pos.delivered(0) == (2, {2: [1]})
    with pytest.raises(RuntimeError, match="draw 2 delivered twice"):
        pos.deliver(0, 2, [1])
    with pytest.raises(RuntimeError, match="draw 0 delivered twice"):
        pos.deliver(0, 0, [2])


def test_state_survives_json_and_a_changed_group_count_is_reported():
    pos = DataPosition(2)
    pos.deliver(0, 0)
    pos.deliver(0, 1, [1])
    pos.deliver(3, 0, [0])
    saved = json.loads(json.dumps(pos.state()))
    again = DataPosition(2)
    assert again.load(saved) is None
    assert _next(again, 0, 2) == [(1, [0]), (2, [0, 1])] and _next(again, 3, 1) == [(0, [1])]
    other = DataPosition(4)
    assert "2 prompt groups per draw, now 4" in other.load(saved)
    assert _next(other, 0, 1) == [(1, [0, 1, 2, 3])]


@settings(max_examples=60, deadline=None)
@given(hst.integers(1, 4), hst.integers(1, 8), hst.randoms(use_true_random=False))
def test_any_delivery_order_ends_where_the_draws_are_complete(groups, draws, rnd):
    """Deliver the groups of `draws` draws in a random order, stopping anywhere: the next draw
    to generate is the first incomplete one, and `todo` yields exactly the undelivered groups."""
    units = [(d, g) for d in range(draws) for g in range(groups)]
    rnd.shuffle(units)
    cut = rnd.randint(0, len(units))
    pos = DataPosition(groups)
    for d, g in units[:cut]:
        pos.deliver(0, d, [g])
    done = set(units[:cut])
    first = min([d for d in range(draws) if any((d, g) not in done for g in range(groups))], default=draws)
    assert pos.delivered(0)[0] == first
    todo = []
    for d, missing in pos.todo(0):
        if d >= draws:
            break
        todo += [(d, g) for g in missing]
    assert set(todo) == set(units) - done and len(todo) == len(set(todo))
