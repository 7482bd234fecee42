"""Prompt leases: which sampler node works on which prompt groups, and until when.

The remote prompt stream is the data position's stream of worker 0 (`position.py`): draw d is
`Producer.draw(1, d)` wherever it is generated, so any node produces the same prompts and
sampling keys for it. A lease hands one draw's undelivered groups to one node until its
deadline; the node's heartbeats push the deadline on. A group arriving for a lease that is not
held (expired, released, from before a learner restart) is refused, so nothing is trained
twice; the groups of a lease that expires or is released go back to the front of the stream and
are leased again, so nothing is lost. The learner never waits on a dead node longer than
`lease_s`, nor on a node that heartbeats but delivers nothing longer than `stall_s`: a node
holding leases whose last group arrived (or whose first lease was issued) longer ago loses them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable, Iterator, Optional


class LeaseError(ValueError):
    """A group for a lease that the node does not hold (or a group not in it)."""


@dataclasses.dataclass
class Lease:
    id: int
    node: str
    draw: int
    groups: list  # leased groups of the draw
    version: int  # the node's weights version when it was issued (admission)
    deadline: float
    pending: set = dataclasses.field(default_factory=set)  # groups not yet received

    def __post_init__(self):
        self.pending = set(self.groups)


class Leases:
    def __init__(self, todo: Iterator[tuple[int, list]], lease_s: float, clock: Callable[[], float] = time.monotonic,
                 stall_s: float = float("inf")):
        """`todo`: (draw, undelivered groups) in stream order (`DataPosition.todo(0)`)."""
        self._todo, self.lease_s, self.clock, self.stall_s = todo, lease_s, clock, stall_s
        self._progress: dict[str, float] = {}  # node -> when it last delivered, or began to hold leases
        self._returned: collections.deque = collections.deque()  # (draw, groups) to lease again first
        self._held: dict[int, Lease] = {}
        self._next = None  # the stream's next draw, once peeked
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.expired = 0  # leases that ran out (their node died or stalled)
        self.stalled = 0  # of those, leases of a node that heartbeated but delivered nothing

    def pending_groups(self, node: Optional[str] = None) -> int:
        """Groups leased and not yet received (`node`'s only, if given)."""
        with self._lock:
            return sum(len(x.pending) for x in self._held.values() if node is None or x.node == node)

    def issue(self, node: str, version: int, admit: Optional[Callable[[int, int], bool]] = None) -> Optional[Lease]:
        """A lease on the next draw for `node` (whose weights are at `version`), or None when
        `admit(version, groups)` holds it back."""
        with self._lock:
            # Never a second lease on a draw the node still holds (its slots track draws by id).
            mine = {x.draw for x in self._held.values() if x.node == node}
            i = next((i for i, (d, _) in enumerate(self._returned) if d not in mine), None)
            draw, groups = self._returned[i] if i is not None else self._peek()
            if admit is not None and not admit(version, len(groups)):
                return None
            if i is not None:
                del self._returned[i]
            else:
                self._next = None
            lease = Lease(next(self._ids), node, draw, list(groups), version, self.clock() + self.lease_s)
            if not mine:
                self._progress[node] = self.clock()
            self._held[lease.id] = lease
            return lease

    def _peek(self):
        if self._next is None:
            self._next = next(self._todo)
        return self._next

    def heartbeat(self, node: str) -> list[int]:
        """Push on the deadlines of `node`'s leases; returns the ids it still holds."""
        with self._lock:
            held = [x for x in self._held.values() if x.node == node]
            for x in held:
                x.deadline = self.clock() + self.lease_s
            return [x.id for x in held]

    def held(self, lease_id: int, node: str, group: int) -> Lease:
        """The lease, if `node` holds it with `group` pending; else LeaseError."""
        with self._lock:
            lease = self._held.get(lease_id)
            if lease is None or lease.node != node or group not in lease.pending:
                raise LeaseError(f"group {group} of lease {lease_id} is not held by node {node} (expired, released, "
                                 "already received or from an earlier learner run)")
            return lease

    def received(self, lease_id: int, node: str, group: int) -> Lease:
        """Group `group` of lease `lease_id` arrived from `node`: it leaves the lease (which ends
        with its last group). Raises LeaseError when that is not a group the node holds."""
        with self._lock:
            lease = self._held.get(lease_id)
            if lease is None or lease.node != node:
                raise LeaseError(f"lease {lease_id} is not held by node {node} (expired, released or from an earlier "
                                 "learner run)")
            if group not in lease.pending:
                raise LeaseError(f"group {group} of draw {lease.draw} is not pending in lease {lease_id}")
            lease.pending.discard(group)
            self._progress[node] = self.clock()
            if not lease.pending:
                del self._held[lease_id]
            return lease

    def give_back(self, lease_id: int, group: int) -> Optional[Lease]:
        """A group the learner refused goes back to the front of the stream at once (its node
        would otherwise keep the lease alive with heartbeats); returns its lease, if held."""
        with self._lock:
            lease = self._held.get(lease_id)
            if lease is None or group not in lease.pending:
                return None
            lease.pending.discard(group)
            if not lease.pending:
                del self._held[lease_id]
            self._returned.appendleft((lease.draw, [group]))
            return lease

    def expire(self) -> list[Lease]:
        """Leases past their deadline end, and every lease of a node that delivered nothing for
        `stall_s`; their pending groups go back to the stream."""
        with self._lock:
            now = self.clock()
            stalled = {x.node for x in self._held.values() if now - self._progress.get(x.node, now) > self.stall_s}
            gone = [x for x in self._held.values() if x.deadline < now or x.node in stalled]
            self.expired += len(gone)
            self.stalled += sum(x.node in stalled for x in gone)
            return self._return(gone)

    def release(self, node: Optional[str] = None) -> list[Lease]:
        """End `node`'s leases (None: everyone's), returning their pending groups to the stream."""
        with self._lock:
            return self._return([x for x in self._held.values() if node is None or x.node == node])

    def _return(self, leases: list[Lease]) -> list[Lease]:
        for x in sorted(leases, key=lambda x: -x.draw):  # the oldest draw ends up first
            del self._held[x.id]
            if x.pending:
                self._returned.appendleft((x.draw, sorted(x.pending)))
        return leases
