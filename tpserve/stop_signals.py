"""Ctrl-C and SIGTERM for `tpserve launch`, lent by the process rather than taken from it: the
first signal asks for a drain, a second one skips it, and a program or notebook that calls
tpserve.cli.main gets its own handlers back on return.

Why the handler only counts (no threading.Event): Event.set() takes the Event's lock, and a
signal handler runs in the main thread between two bytecodes. When a second signal lands
while the first handler is inside set() (Ctrl-C twice, or `timeout`/a supervisor forwarding
a signal the terminal also sent), the nested handler waits for a lock its own thread holds
and the launch hangs for good, deaf to every later signal (seen on `tpserve launch --tp 2` on
the CPU: py-spy showed four nested handlers in Event.set, the launch still serving).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.05  # how soon a wait() sees a signal; the handler cuts time.sleep short anyway


def _in_main_thread() -> bool:
    # Python lets only the main thread set handlers, and delivers signals only to it.
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def handlers_restored() -> Iterator[None]:
    """SIGINT's and SIGTERM's handlers as the block found them, whoever replaced them inside
    (tpserve's stop handlers, and ray.init, which sets a SIGTERM handler of its own)."""
    if not _in_main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                signal.signal(sig, handler)


def leaves_handlers_as_found(func: Callable[..., int]) -> Callable[..., int]:
    """`func` runs inside handlers_restored()."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs) -> int:
        with handlers_restored():
            return func(*args, **kwargs)

    return wrapper


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

    def install(self) -> bool:
        """Handle STOP_SIGNALS from now on (leaves_handlers_as_found gives the previous ones
        back). False, and nothing installed, off the main thread: there the launch runs
        until its process ends."""
        if not _in_main_thread():
            return False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
        return True


class SignalFlag:
    """A lock-free stand-in for threading.Event, set once `signals` has counted `at`."""

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


def hear_interrupts() -> None:
    """The command line hears Ctrl-C from its start, as its server does once up (its handler
    replaces whatever was there). A shell without job control (a script's `tpserve launch &`,
    `bash -c '... &'`) starts a background command with SIGINT ignored, and Python keeps it
    so: a SIGINT during the checks or a download was lost, then heard once serving."""
    if _in_main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
