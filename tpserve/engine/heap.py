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


def freeze_startup_objects() -> None:
    """Collect start-up garbage, then exempt every object alive now from later collections.
    Call once a replica is built (again after a rebuild: the new objects join the frozen)."""
    gc.collect()
    gc.freeze()
