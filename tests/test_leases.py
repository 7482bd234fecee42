"""`remote/leases.py`: leases expire back to the front of the stream; a stalled node loses them."""

import pytest

from jaxrl_llm.remote.leases import LeaseError, Leases
from tests.remote_helpers import _todo


def test_leases_expire_back_to_the_front_and_refuse_late_groups():
    now = [0.0]
    leases = Leases(_todo(), lease_s=10, clock=lambda: now[0])
    a, b = leases.issue("a", 0), leases.issue("b", 0)
    assert (a.draw, b.draw) == (0, 1)
    leases.received(a.id, "a", 0)
    with pytest.raises(LeaseError):
        leases.received(a.id, "a", 0)  # a group is received once
    with pytest.raises(LeaseError):
        leases.received(b.id, "a", 0)  # only by its holder
    now[0] = 8
    leases.heartbeat("b")
    now[0] = 12
    assert [x.id for x in leases.expire()] == [a.id] and leases.expired == 1
    with pytest.raises(LeaseError):
        leases.received(a.id, "a", 1)  # too late: the group is someone else's now
    c = leases.issue("b", 1)
    assert (c.draw, c.groups) == (0, [1])  # the expired lease's missing group first
    assert leases.issue("b", 1).draw == 2
    assert not leases.issue("a", 1, admit=lambda v, g: False) and leases.issue("a", 1).draw == 3
    assert len(leases.release("b")) == 3 and leases.issue("a", 1).draw == 0  # b held groups of draws 0, 1, 2
    d = leases.issue("a", 1)
    assert leases.give_back(d.id, 0) is d and d.pending == {1}  # a refused group: leased again at once
    assert leases.issue("a", 1).draw != d.draw  # a still holds d's draw: never two leases on one draw
    assert (lambda x: (x.draw, x.groups))(leases.issue("b", 1)) == (d.draw, [0])


def test_a_node_that_heartbeats_but_delivers_nothing_loses_its_leases_after_stall_s():
    now = [0.0]
    leases = Leases(_todo(), lease_s=10, clock=lambda: now[0], stall_s=25)
    slow, honest = leases.issue("slow", 0), leases.issue("honest", 0)
    for t in range(5, 30, 5):
        now[0] = t
        leases.heartbeat("slow"), leases.heartbeat("honest")
        if t == 20:
            leases.received(honest.id, "honest", 0)
        assert leases.expire() == [] or t > 25
    now[0] = 26
    assert [x.id for x in leases.expire()] == [slow.id] and (leases.expired, leases.stalled) == (1, 1)
    assert leases.pending_groups("honest") == 1 and leases.pending_groups("slow") == 0
    again = leases.issue("slow", 0)
    assert (again.draw, again.groups) == (slow.draw, slow.groups)  # first in line, and a fresh clock
    now[0] = 52
    leases.heartbeat("slow"), leases.heartbeat("honest")
    assert {x.node for x in leases.expire()} == {"slow", "honest"}  # 26 and 32 s without a group


# ---------------------------------------------------------------------- service
