# Shared by this session's processes: xdist workers and the subprocesses tests start inherit the
# environment set here, before jax is imported anywhere (see tests/processes.py).
from tests import processes

processes.configure_session()

from hypothesis import settings  # noqa: E402

# jit compilation makes first examples slow; correctness, not speed, is under test.
settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")

import jax  # noqa: E402

# Implicit rank promotion hides shape bugs ([B] + [B, L] broadcasting silently): make it an error.
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

from tests import timing  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of one test, in its turn on the CPU (tests/processes.py) and,
    with JAXRL_TEST_TIMING=FILE, timed (tests/timing.py)."""
    with processes.turn(item.get_closest_marker("serial") is not None), timing.record(item.nodeid):
        yield
