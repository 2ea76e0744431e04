"""The serving path's garbage-collector policy (tpserve/engine/heap.py): start-up objects
frozen, full collections rare while serving and run once the loop has been idle."""

from __future__ import annotations

import gc

from tpserve.engine import heap


def test_freezing_makes_full_collections_rare_and_keeps_the_young_ones():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        heap.freeze_startup_objects()
        assert gc.get_threshold() == (700, 10, heap.FULL_EVERY)
        assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_idle_collector_runs_one_full_collection_after_work_and_idle_time(monkeypatch):
    clock, full = _Clock(), []
    monkeypatch.setattr(heap.time, "monotonic", clock)
    monkeypatch.setattr(heap.gc, "collect", lambda generation=2: full.append(generation))
    c = heap.IdleCollector(idle_s=1.0)
    for _ in range(5):  # idle from the start: nothing was put off
        c.idle()
        clock.t += 1.0
    assert full == []
    c.busy()
    c.idle()  # the first idle turn starts the clock
    clock.t += 0.5
    c.idle()
    assert full == []  # not idle long enough
    c.busy()  # work again: the idle time starts over
    clock.t += 0.9
    c.idle()
    clock.t += 0.9
    c.idle()
    assert full == []
    clock.t += 0.2
    c.idle()
    assert full == [2] and c.collections == 1
    clock.t += 5.0
    c.idle()  # once per idle spell
    assert full == [2]
