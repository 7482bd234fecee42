"""Where a run's numbers go: WORKDIR/metrics.jsonl (one JSON object per record, the source of
truth that `jaxrl_llm.research.report` reads), TensorBoard event files under WORKDIR/tb, and a
progress bar on the terminal."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import numpy as np


class MetricsWriter:
    """Appends records (dicts with a "step") to metrics.jsonl and, unless `tensorboard=False`,
    writes every scalar and the staleness histogram as TensorBoard events.

    `resume_at=v` (a run restored from its checkpoint at version v): records past step v were
    written after that checkpoint by a run that died, and the resumed run writes those steps
    again, so they are dropped first (the TensorBoard events are rebuilt from what is kept):
    the log of a resumed run equals an uninterrupted one. `enabled=False` (every process but 0
    of a many-process run) writes nothing. `also` (`tracking.Trackers`) gets every record too."""

    def __init__(self, workdir: str, tensorboard: bool = True, enabled: bool = True, resume_at=None, also=None):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._f, self._tb, self._also = None, None, also
        if not enabled:
            return
        kept = truncate(self.path, resume_at) if resume_at is not None else None
        self._f = open(self.path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: only runs that log need it

            tb_dir = os.path.join(workdir, "tb")
            if kept is not None:
                shutil.rmtree(tb_dir, ignore_errors=True)
            self._tb = SummaryWriter(logdir=tb_dir, flush_secs=10)
            for record in kept or ():
                self._write_tb(record)

    def write(self, record: dict) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None:
            self._write_tb(record)
        if self._also is not None:
            self._also.log(record)

    def _write_tb(self, record: dict) -> None:
        step = int(record["step"])
        for name, value in record.items():
            if name == "step":
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(name, value, step)
            elif name.endswith("/hist") and value:
                _add_counts_histogram(self._tb, name, np.asarray(value, np.float64), step)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._also is not None:
            self._also.close()


def truncate(path: str, step: int) -> list:
    """Keep the records of `path` with step <= `step` (rewritten atomically); returns them."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        kept = [r for r in (json.loads(line) for line in f if line.strip()) if r.get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return kept


def _add_counts_histogram(tb, name: str, counts, step: int) -> None:
    """counts[i] = number of tokens with integer value i (e.g. staleness in steps)."""
    values = np.arange(len(counts), dtype=np.float64)
    n = counts.sum()
    if n == 0:
        return
    tb.add_histogram_raw(name, min=float(values[counts > 0].min()), max=float(values[counts > 0].max()),
                         num=int(n), sum=float((counts * values).sum()),
                         sum_squares=float((counts * values**2).sum()),
                         bucket_limits=(values + 0.5).tolist(), bucket_counts=counts.tolist(), global_step=step)


class Progress:
    """A tqdm bar over learner steps showing reward, staleness and throughput. Off when stderr
    is not a terminal (CI logs get the plain per-step lines instead)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def update(self, step: int, m: dict) -> None:
        if self._bar is None:
            return
        self._bar.n = step
        self._bar.set_postfix(reward=f"{m.get('reward/mean', float('nan')):.3f}",
                              stale=f"{m.get('staleness/mean', float('nan')):.2f}",
                              tok_s=f"{m.get('tokens_per_s', 0.0):.0f}", refresh=True)

    def write(self, line: str) -> None:
        """Print without breaking the bar."""
        if self._bar is None:
            print(line)
        else:
            self._bar.write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
