"""The garbage collector on the serving path.

Every step allocates a few objects per token (outputs, events); Python's generational
collector answers with a full collection now and then, which walks every tracked object of
the process: the hundreds of thousands that importing torch, transformers and Ray and
loading a model leave behind. At batch 256 those pauses doubled the mean host time of a
step (benchmarks/host_step.py). Freezing what start-up built moves it out of the collector's
sight for good (it lives as long as the process anyway), so a collection walks only what
serving allocated since.
"""

from __future__ import annotations

import gc
import time

# Serving keeps what it allocates until a request ends (the driver holds an event per
# generated token of every non-streamed answer: 65k of them at the end of a 256 x 256
# burst), so the automatic full collections it triggers grow with the load: 40-160 ms
# each, three per such burst, with the GIL held, one of them usually among the burst's
# last steps (measured in benchmarks/driver_burst.py's driver, 2026-12-03). After start-up
# a full collection runs when the engine has sat idle for IDLE_FULL_COLLECT_S, and
# automatically only after FULL_EVERY young-generation passes (Python's default is 10).
# The young generations are collected as usual, so short-lived cycles still go at once.
FULL_EVERY = 1000
IDLE_FULL_COLLECT_S = 1.0


def freeze_startup_objects() -> None:
    """Collect start-up garbage, then exempt every object alive now from later collections,
    and make later full collections rare (IdleCollector runs them while idle). Call once a
    replica is built (again after a rebuild: the new objects join the frozen)."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)


class IdleCollector:
    """The full collection that serving put off, run once the loop that owns this has
    been idle for `idle_s` after doing work (`busy()` marks work, `idle()` is called on
    every idle turn)."""

    def __init__(self, idle_s: float = IDLE_FULL_COLLECT_S) -> None:
        self.idle_s = idle_s
        self.owed = False
        self._idle_since: float | None = None
        self.collections = 0

    def busy(self) -> None:
        self.owed, self._idle_since = True, None

    def idle(self) -> None:
        if not self.owed:
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.idle_s:
            gc.collect()
            self.owed, self._idle_since = False, None
            self.collections += 1
