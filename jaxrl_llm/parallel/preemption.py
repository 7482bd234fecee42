"""Preemption: SIGTERM (and Ctrl-C) end a run cleanly within a grace period.

TPU pods and cloud GPUs preempt with SIGTERM and a short grace period. The experiment runner
installs `Grace` around its training loop; see `Grace` for what happens and the exit codes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

import numpy as np

from jaxrl_llm.parallel import distributed


_installed: Optional["Grace"] = None  # the running experiment's, from install to uninstall
PREEMPTED = 2  # the status bit `agree` adds; callers' own codes use bit 1 (or < 0: failed)


def agree(code: int) -> np.ndarray:
    """`distributed.agree(code)` for the runtime modes' waits for data, with this process's
    preemption signal folded in: once any process got one, every process raises `Preempted` at
    the same call (unless one failed, `code` < 0, which the caller reports), so a run waiting
    for data still saves within its grace period."""
    signum = _installed.signum if _installed is not None else None
    status = distributed.agree(code if code < 0 else code | (PREEMPTED if signum else 0))
    if (status >= 0).all() and (status & PREEMPTED).any():
        raise Preempted(signum or signal.SIGTERM)
    return status


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived: take the Ctrl-C path once the step in flight is recorded."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Grace:
    """Preemption. SIGTERM only sets a flag: the run stops after the step in flight has been
    trained and logged (`check`, from the metrics callback), so the checkpoint and
    metrics.jsonl agree. From the first signal (or Ctrl-C) the run has `seconds` to save and
    clean up; past that the process exits anyway (code 1, saying so), so a preempted run never
    outlives its grace period. Exit codes (main.py): 128 + signal number, i.e. 143 / 130."""

    def __init__(self, seconds: float):
        self.seconds, self.previous, self.timer, self.signum = seconds, None, None, None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def install(self):
        global _installed
        _installed = self
        if threading.current_thread() is threading.main_thread():
            self.previous = {signal.SIGINT: signal.getsignal(signal.SIGINT),
                             signal.SIGTERM: signal.signal(signal.SIGTERM, self._requested)}

    def _requested(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            self._start_timer()

    def check(self):
        """Raise `Preempted` once a signal came. On many processes (called at the same step on
        each) they first agree with one tiny collective, so every process stops, and saves, at
        the step where the first of them saw a signal, even one that never got it itself."""
        signum = self.signum
        if distributed.count() > 1:
            signum = int(distributed.agree(signum or 0).max()) or None
        if signum is not None:
            if self.signum is None:
                self.signum = signum
                self._start_timer()
            raise Preempted(signum)

    def start(self, exc):
        """In the interrupt handler: the save begins; further signals must not break it."""
        if self.signum is None:
            self.signum = getattr(exc, "signum", signal.SIGINT)
            self._start_timer()
        if self.previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _start_timer(self):
        def expire():
            sys.stderr.write(f"{self.signal_name}: the run did not save and exit within {self.seconds:g} s "
                             "(train.preempt_grace_s); exiting without a final checkpoint\n")
            sys.stderr.flush()
            os._exit(1)

        self.timer = threading.Timer(self.seconds, expire)
        self.timer.daemon = True
        self.timer.start()

    def uninstall(self):
        global _installed
        _installed = None
        if self.previous is not None:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = None

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()
