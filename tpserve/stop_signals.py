"""Ctrl-C and SIGTERM for `tpserve launch`, lent by the process rather than taken from it:
a program or notebook that calls tpserve.cli.main gets its own handlers back on return."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


def stop_on_signals(stop: threading.Event, force: threading.Event) -> bool:
    """The first SIGINT or SIGTERM sets `stop` (drain, then exit); a second sets `force`
    (skip the drain). False, and nothing installed, off the main thread: there the launch
    runs until its process ends."""
    if not _in_main_thread():
        return False

    def on_signal(_signum, _frame) -> None:
        # No logging here: a handler may interrupt a log call holding the logging lock.
        if stop.is_set():
            force.set()
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    return True


def hear_interrupts() -> None:
    """The command line hears Ctrl-C from its start, as its server does once up (its handler
    replaces whatever was there). A shell without job control (a script's `tpserve launch &`,
    `bash -c '... &'`) starts a background command with SIGINT ignored, and Python keeps it
    so: a SIGINT during the checks or a download was lost, then heard once serving."""
    if _in_main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
