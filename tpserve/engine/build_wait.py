"""What a shard-group build is waiting for (a placement the cluster cannot hold yet), so
GET /health can say it while a rebuild, or the first load, waits for resources.

The build runs in the engine thread and placement (cluster/placement.py) reports into the
reporter that thread installed: the engine imports nothing of Ray, and two engines in one
process (tests) do not read each other's waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def reporting_waits(report: Callable[[str | None], None]) -> Iterator[None]:
    """Waits reported in this thread go to `report` (a reason, or None once it ends)."""
    outer = getattr(_local, "report", None)
    _local.report = report
    try:
        yield
    finally:
        _local.report = outer
        report(None)


def report_wait(reason: str | None) -> None:
    """Say what the build in this thread waits for now; None: it waits no more."""
    report = getattr(_local, "report", None)
    if report is not None:
        report(reason)
