"""`runtime.throttle.Buckets`: a token bucket per key, against a step-by-step reference."""

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.remote.throttle import Buckets


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 5)), max_size=40))
def test_each_key_spends_a_burst_then_regains_one_token_per_period(calls):
    now = [0.0]
    b = Buckets(burst=3, every_s=2.0, clock=lambda: now[0])
    level, when = {}, {}
    for key, dt in calls:
        now[0] += dt
        tokens = min(3.0, level.get(key, 3.0) + (now[0] - when.get(key, now[0])) / 2.0)
        want = tokens >= 1
        assert b.take(key) == want
        level[key], when[key] = (tokens - 1 if want else level.get(key, 3.0)), (now[0] if want else when.get(key, now[0]))
        if want:
            assert abs(b.wait_s(key) - max(0.0, (1 - (tokens - 1)) * 2.0)) < 1e-9


def test_the_table_of_keys_stays_bounded():
    now = [0.0]
    b = Buckets(burst=1, every_s=100.0, max_keys=8, clock=lambda: now[0])
    for i in range(100):
        now[0] += 1
        assert b.take(i)
    assert len(b._tokens) <= 8
