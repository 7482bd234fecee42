"""A bounded, thread-safe, version-aware queue between samplers and the learner.

Producers block when it is full (backpressure: memory stays bounded). At consumption the
staleness of the head item (`jaxrl_llm.staleness`, with the item's version = its oldest
token's) is checked against `max_staleness`: policy "drop" discards it (and counts it),
"keep" returns it and counts it as over-stale, "admit" returns the oldest item first (the
bound was kept at admission, `admission.py`; anything beyond it is counted as over-stale).
Every accepted item is returned exactly once or counted as dropped; none is lost or duplicated. `close()` wakes everyone: producers get QueueClosed, consumers drain what
is left and then get QueueClosed.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Optional

from jaxrl_llm.staleness import POLICIES, exceeds, staleness


class QueueClosed(Exception):
    """The queue was closed (and, for a consumer, is empty)."""


class QueueTimeout(Exception):
    """No space (put) or no item (get) within the timeout."""


@dataclasses.dataclass
class Stats:
    accepted: int = 0
    consumed: int = 0
    dropped: int = 0  # over-stale items discarded (policy "drop")
    over_stale: int = 0  # over-stale items returned (policy "keep")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class VersionedQueue:
    def __init__(self, maxsize: int, max_staleness: Optional[int] = None, policy: str = "drop", on_drop=None):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1; got {maxsize}")
        if policy not in POLICIES:
            raise ValueError(f"unknown staleness policy {policy!r}; valid: {', '.join(POLICIES)}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None; got {max_staleness}")
        self.maxsize, self.max_staleness, self.policy = maxsize, max_staleness, policy
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._closed = False
        self.stats = Stats()
        self.on_drop = on_drop  # called with each dropped item (e.g. to record its lengths)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: Any, version: int, timeout: Optional[float] = None) -> None:
        """Enqueue `item` whose oldest token came from policy `version`; blocks while full."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_full:
            while len(self._items) >= self.maxsize and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise QueueTimeout(f"queue full ({self.maxsize}) for {timeout}s")
                self._not_full.wait(remaining)
            if self._closed:
                raise QueueClosed("put on a closed queue")
            self._items.append((int(version), item))
            self.stats.accepted += 1
            self._not_empty.notify()

    def get(self, learner_version: int, timeout: Optional[float] = None):
        """Next acceptable (item, version) for a learner at `learner_version`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            while True:
                while not self._items:
                    if self._closed:
                        raise QueueClosed("queue closed and drained")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise QueueTimeout(f"no item within {timeout}s")
                    self._not_empty.wait(remaining)
                if self.policy == "admit":  # oldest first
                    oldest = min(range(len(self._items)), key=lambda i: self._items[i][0])
                    self._items.rotate(-oldest)
                    version, item = self._items.popleft()
                    self._items.rotate(oldest)
                else:
                    version, item = self._items.popleft()
                self._not_full.notify()
                stale = exceeds(staleness(learner_version, version), self.max_staleness)
                if stale and self.policy == "drop":
                    self.stats.dropped += 1
                    if self.on_drop is not None:
                        self.on_drop(item)
                    continue
                self.stats.over_stale += int(stale)
                self.stats.consumed += 1
                return item, version

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()
