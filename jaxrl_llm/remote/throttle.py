"""Rate limits with no I/O and an injectable clock: a token bucket per key (e.g. a peer's host).

`Buckets(burst, every_s).take(key)` is True while `key` has a token: each key starts with `burst`
and regains one every `every_s` seconds, up to `burst`. The table of keys is bounded (`max_keys`:
the keys full again are forgotten first, then the oldest), so a caller cannot grow it without end.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Buckets:
    def __init__(self, burst: int, every_s: float, max_keys: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.burst, self.every_s, self.max_keys, self.clock = burst, every_s, max_keys, clock
        self._tokens: dict = {}  # key -> (tokens, when counted)
        self._lock = threading.Lock()

    def take(self, key) -> bool:
        """Spend one of `key`'s tokens; False (nothing spent) when it has none."""
        with self._lock:
            now = self.clock()
            tokens = self._level(key, now)
            if tokens < 1:
                return False
            self._tokens[key] = (tokens - 1, now)
            if len(self._tokens) > self.max_keys:
                self._forget(now)
            return True

    def wait_s(self, key) -> float:
        """Seconds until `key` has a token again."""
        with self._lock:
            return max(0.0, (1 - self._level(key, self.clock())) * self.every_s)

    def _level(self, key, now: float) -> float:
        tokens, then = self._tokens.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - then) / self.every_s)

    def _forget(self, now: float) -> None:
        full = [k for k in self._tokens if self._level(k, now) >= self.burst]
        for k in full or sorted(self._tokens, key=lambda k: self._tokens[k][1])[: len(self._tokens) - self.max_keys]:
            del self._tokens[k]
