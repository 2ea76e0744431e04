"""Ctrl-C and SIGTERM for `tpserve launch`: the first signal asks for a drain, a second one
skips it.

Why not threading.Event: Event.set() takes the Event's lock, and a signal handler runs in the
main thread between two bytecodes. When the signal lands while that thread holds the same
lock (inside Event.wait(), re-taking it after a timeout), set() waits for a lock its own
thread holds and the launch hangs for good, deaf to every later signal (seen on `tpserve
launch --tp 2` on the CPU: SIGINT, then SIGTERM, left it serving). Here the handler only
counts, and the waiting side polls.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

POLL_S = 0.05  # how soon a wait() sees a signal; time.sleep is cut short by the handler anyway


class StopSignals:
    """`stop` is set by the first SIGINT/SIGTERM, `force` by the second. Both have the part
    of threading.Event's interface the launch's loops use (is_set, set, wait)."""

    def __init__(self) -> None:
        self.count = 0
        self.stop = SignalFlag(self, 1)
        self.force = SignalFlag(self, 2)

    def handle(self, _signum, _frame) -> None:
        # Nothing here may take a lock (logging included): see the module's docstring.
        self.count += 1

    @contextlib.contextmanager
    def installed(self, signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[StopSignals]:
        """Handle `signums` inside the block and give back the handlers found on the way
        out, so that a program or notebook calling tpserve.cli.main keeps its own Ctrl-C.
        Outside the main thread (where Python allows no handlers) nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in signums}
        for s in signums:
            signal.signal(s, self.handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                # None: a handler installed outside Python; the default is the closest.
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


class SignalFlag:
    """A lock-free stand-in for threading.Event, set when `signals` has counted `at`."""

    def __init__(self, signals: StopSignals, at: int) -> None:
        self._signals, self._at = signals, at

    def is_set(self) -> bool:
        return self._signals.count >= self._at

    def set(self) -> None:
        self._signals.count = max(self._signals.count, self._at)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                break
            time.sleep(left)
        return self.is_set()
