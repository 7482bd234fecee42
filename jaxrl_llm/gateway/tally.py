"""`gateway/*` metrics from sessions' counters and request latencies: the run's own gateway's
(`agents.AgentTask.metrics`), or in remote mode the sum of its sampler nodes' gateways, which
each node's heartbeat reports (`Tally`, on the learner). No I/O.
"""

from __future__ import annotations

import threading

import numpy as np

# Counters, as `gateway/<name>`: sessions by outcome (the gateway's), the rows and checks the
# run's agent task settled (`agents.AgentTask`), and the decode slots' tokens against their
# capacity (slots x decode steps), each a total so far.
COUNTS = ("sessions_opened", "sessions_closed", "sessions_timed_out", "sessions_abandoned", "sessions_branched",
          "refused", "turns_failed", "agent_errors", "branch_rows_dropped", "scored_after_failure", "task_check_failures",
          "sessions_dropped", "slot_tokens", "slot_capacity")
MAX_LATENCIES = 1024  # a node reports at most this many of a heartbeat's request latencies (the newest)
MAX_MS = 1e7  # ... each in [0, MAX_MS] milliseconds


def metrics(counts, ms) -> dict:
    """`gateway/*` from the `COUNTS` totals (in that order) and the request latencies (ms: a
    request's arrival to its answer, decoding included) answered since the last call."""
    out = {f"gateway/{k}": float(v) for k, v in zip(COUNTS, counts)}
    if out["gateway/slot_capacity"] > 0:  # over the run so far (every node's slots in remote mode)
        out["gateway/slot_occupancy"] = out["gateway/slot_tokens"] / out["gateway/slot_capacity"]
    ms = np.asarray(ms, np.float64)
    if ms.size:
        out["gateway/request_p50_ms"], out["gateway/request_p99_ms"] = (float(np.percentile(ms, q)) for q in (50, 99))
    return out


class Tally:
    """The learner's sum of its sampler nodes' gateways (remote mode, `task.name=agent`): their
    counters' increments and their request latencies, as one gateway's metrics."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals, self._ms, self.reported = np.zeros(len(COUNTS)), [], False

    def add(self, report) -> None:
        """A node's (counter increments since its last report, latencies answered meanwhile); None: none."""
        if report is None:
            return
        counts, ms = report
        with self._lock:
            self._totals += counts
            self._ms.extend(ms)
            del self._ms[:-16 * MAX_LATENCIES]  # a learner that logs no step for long keeps the newest
            self.reported = True

    def metrics(self) -> dict:
        """`gateway/*` over every node so far ({} until one reported); latencies since the last call."""
        with self._lock:
            if not self.reported:
                return {}
            totals, ms, self._ms = self._totals.copy(), self._ms, []
        return metrics(totals, ms)
