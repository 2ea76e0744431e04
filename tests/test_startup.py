"""The start-up split (tpserve/startup.py): phases from wall-clock marks, in order."""

from __future__ import annotations

import time

from tpserve.startup import describe, phases, process_started_at, shard_startup


def test_phases_are_the_gaps_between_marks_and_a_missing_mark_folds_into_the_next():
    got = phases(100.0, [("a", 101.5), ("b", None), ("c", 104.0), ("d", 104.25)])
    assert got == [("a", 1.5), ("c", 2.5), ("d", 0.25)]
    assert describe(got) == "a 1.5s, c 2.5s, d 0.2s"


def test_a_mark_before_the_start_counts_as_zero_not_negative():
    # A process Ray started before the actor was requested (a prestarted worker).
    got = phases(100.0, [("process", 90.0), ("imports", 103.0)])
    assert got == [("process", 0.0), ("imports", 3.0)]


def test_shard_phases_sum_to_the_last_mark():
    marks = {"process": 10.5, "init": 12.0, "config": 12.5, "prepare": 13.0, "device": 14.0,
             "weights": 20.0, "cache": 20.5, "kernels": 22.0, "graphs": 23.0, "start": 24.0,
             "loop": 24.25}
    got = shard_startup(10.0, marks)
    assert [name for name, _ in got] == ["shard process", "imports", "config", "set-up call",
                                         "device", "weights", "KV cache", "kernel warmup",
                                         "graphs", "waiting for the driver", "step loop"]
    assert abs(sum(s for _, s in got) - 14.25) < 1e-9
    assert dict(got)["weights"] == 6.0
    assert dict(got)["waiting for the driver"] == 1.0


def test_this_process_started_in_the_past():
    started = process_started_at()
    if started is None:  # not Linux: the phase folds into the next, which the test above covers
        return
    assert time.time() - 3600 * 24 < started <= time.time() + 1


def test_the_driver_places_a_shard_before_importing_torch():
    """Everything the driver imports up to placing a single shard is free of torch and
    transformers (seconds each: they would delay every launch; they load afterwards)."""
    import subprocess
    import sys

    code = ("import sys, tpserve.cluster.driver, tpserve.cluster.core_client, "
            "tpserve.engine.async_engine, tpserve.server.app, tpserve.cluster.ray_metrics; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
