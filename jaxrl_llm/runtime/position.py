"""Where each async sampler worker stands in its prompt stream: which groups are done for good.

A worker's prompts come in draws: draw d of worker w is `Orchestrator.draw(w, d)`, seeded by
both, so it is the same prompts (and sampling keys) whenever it is drawn again. Each draw holds
`groups` prompt groups. A group is *delivered* once the learner has trained on it or the queue
has dropped it as over-stale (counted in `runtime/dropped`). Whatever was generated but not
delivered when the workers stop (queued or still decoding at an eval / checkpoint boundary, or
lost with a process that died) is generated again from the same prompts the next time workers
start, with the weights of then: every prompt is trained on once, none is skipped, and the
staleness bound holds across the boundary. With continuous batching groups finish out of draw
order, so a draw can be partly delivered; then only its missing groups are generated again.

The position goes into every checkpoint (per process, `runtime.json` beside orbax's), so a
resumed run continues each worker's stream where the restored version left it.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional, Sequence


class DataPosition:
    def __init__(self, groups: int):
        self.groups = groups
        self._next: dict[int, int] = {}  # worker -> first draw not fully delivered
        self._partial: dict[int, dict[int, set]] = {}  # worker -> {draw > next: groups delivered}
        self._lock = threading.Lock()  # the learner delivers while a worker starts its stream

    def deliver(self, worker: int, draw: int, groups: Optional[Sequence[int]] = None) -> None:
        """Groups `groups` (None: all) of `worker`'s `draw` are done. Delivering one twice is a
        bug upstream (a prompt trained twice) and raises."""
        new = set(range(self.groups) if groups is None else groups)
        with self._lock:
            nxt = self._next.get(worker, 0)
            part = self._partial.setdefault(worker, {})
            done = part.setdefault(draw, set())
            if draw < nxt or done & new:
                raise RuntimeError(f"sampler {worker}'s draw {draw} delivered twice (groups {sorted(new)})")
            done |= new
            while len(part.get(nxt, ())) == self.groups:
                del part[nxt]
                nxt += 1
            self._next[worker] = nxt

    def todo(self, worker: int) -> Iterator[tuple[int, list[int]]]:
        """(draw, its groups not yet delivered) for `worker` to generate, in draw order, from
        the first draw not fully delivered on; endless. A snapshot: what is delivered while it
        runs concerns draws it has already yielded."""
        with self._lock:
            d = self._next.get(worker, 0)
            part = {k: set(v) for k, v in self._partial.get(worker, {}).items()}
        while True:
            missing = [g for g in range(self.groups) if g not in part.get(d, ())]
            if missing:
                yield d, missing
            d += 1

    def delivered(self, worker: int) -> tuple[int, dict[int, list[int]]]:
        """(first draw not fully delivered, {later draw: groups delivered})."""
        with self._lock:
            return self._next.get(worker, 0), {d: sorted(g) for d, g in self._partial.get(worker, {}).items() if g}

    def state(self) -> dict:
        """JSON-able."""
        workers = {}
        for w in sorted(self._next):
            nxt, part = self.delivered(w)
            workers[str(w)] = {"next": nxt, "partial": {str(d): g for d, g in part.items()}}
        return {"groups": self.groups, "workers": workers}

    def load(self, state: dict) -> Optional[str]:
        """Continue from `state()`. Returns a note when it cannot be kept exactly: saved with a
        different number of groups per draw (runtime.prompts_per_batch changed), the partly
        delivered draws are generated again whole."""
        exact = state["groups"] == self.groups
        with self._lock:
            self._next = {int(w): s["next"] for w, s in state["workers"].items()}
            self._partial = {int(w): {int(d): set(g) for d, g in s["partial"].items()} if exact else {}
                             for w, s in state["workers"].items()}
        if not exact and any(s["partial"] for s in state["workers"].values()):
            return (f"the data position was saved with {state['groups']} prompt groups per draw, now "
                    f"{self.groups}: partly trained draws are drawn again whole")
        return None
