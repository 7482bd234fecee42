"""Staleness bounded at admission (`runtime.staleness_policy="admit"`, async with continuous
batching), after AReaL's rollout controller: rather than dropping finished work that came out
too stale (which discards long completions far more often than short ones, so the learner sees
shorter answers than the sampler produced), a prompt draw only enters the decode slots while
the learner can still train its tokens within `max_staleness`.

Counting in prompt groups, with B groups per learner step, U groups admitted but not yet
trained, a worker holding params v_w and the learner at v_L: a new draw is trained at the
latest at version v_L + ceil(U / B) (older groups go first), so it is admitted iff
v_L + ceil(U / B) - v_w <= max_staleness. A group is as stale as its oldest token, sampled with
the params it was admitted under (later tokens come from refreshed params), so the learner also
waits, before a step, while a group still decoding was admitted under params that the step
would leave more than `max_staleness` versions behind; and it trains the oldest groups first.
Nothing is dropped; anything beyond the bound would still be counted (`runtime/over_stale`).
"""

from __future__ import annotations

import collections
import threading


class Admission:
    def __init__(self, max_staleness: int, groups_per_step: int):
        self.bound, self.per_step = max_staleness, groups_per_step
        self._lock = threading.Lock()
        self.untrained = 0  # groups admitted and not yet taken by the learner
        self._decoding = collections.Counter()  # admission version -> groups not yet enqueued

    def try_admit(self, worker_version: int, learner_version: int, groups: int) -> bool:
        """Admit a draw of `groups` prompt groups sampled from params `worker_version`?"""
        with self._lock:
            trained_by = learner_version + -(-self.untrained // self.per_step)
            if trained_by - worker_version > self.bound:
                return False
            self.untrained += groups
            self._decoding[worker_version] += groups
            return True

    def enqueued(self, admitted_version: int) -> None:
        """One group admitted under `admitted_version` finished decoding and is queued."""
        with self._lock:
            self._decoding[admitted_version] -= 1
            if not self._decoding[admitted_version]:
                del self._decoding[admitted_version]

    def revoke(self, admitted_version: int, groups: int) -> None:
        """`groups` admitted under `admitted_version` will not arrive (their lease ended)."""
        with self._lock:
            self.untrained -= groups
            self._decoding[admitted_version] -= groups
            if self._decoding[admitted_version] <= 0:
                del self._decoding[admitted_version]

    def trained(self, groups: int) -> None:
        with self._lock:
            self.untrained -= groups

    def ready(self, learner_version: int, queued: int, groups: int) -> bool:
        """Whether a step at `learner_version` may take its `groups` now (`queued` are waiting)."""
        return queued >= groups and self.may_step(learner_version)

    def may_step(self, learner_version: int) -> bool:
        """Whether a step at `learner_version` leaves every group still decoding within the bound
        (it will be trained at learner_version + 1 or later)."""
        with self._lock:
            return not self._decoding or learner_version + 1 - min(self._decoding) <= self.bound
