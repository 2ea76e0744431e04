"""The engine-core actor's poll recomputes the gauges (which walk every sequence) at most
every STATS_PERIOD_S while the core is busy, and always once it is idle, so the last poll of
a burst reports settled values. work_tokens is checked against its definition, and serving
starts with the start-up heap frozen (no full garbage collection walks it mid-step)."""

from __future__ import annotations

from types import SimpleNamespace

import tpserve.cluster.engine_core_actor as actor_mod
from tpserve.cluster.engine_core_actor import EngineCoreActor
from tpserve.engine.core import work_tokens
from tpserve.engine.request import SamplingParams
from tpserve.engine.sequence import Sequence


class _Core:
    def __init__(self) -> None:
        self.requests = {1: object()}
        self.calls = 0
        self.steps = 0

    def counters(self) -> dict:
        return {"steps": float(self.steps)}

    def stats(self) -> dict:
        self.calls += 1
        return {"running_sequences": float(len(self.requests)), "calls": float(self.calls),
                **self.counters()}


def _actor(core) -> EngineCoreActor:
    a = EngineCoreActor.__new__(EngineCoreActor)  # no worker: only the poll path is used
    a.core, a._stats, a._stats_at = core, {}, float("-inf")
    return a


def test_gauges_are_throttled_while_busy_and_fresh_when_idle(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(actor_mod.time, "monotonic", lambda: now[0])
    core = _Core()
    a = _actor(core)
    assert a._gauges()["calls"] == 1
    now[0] += actor_mod.STATS_PERIOD_S / 2
    core.steps = 7
    g = a._gauges()
    assert g["calls"] == 1 and core.calls == 1  # within the period: cached
    assert g["steps"] == 7  # but the step counters are read on every poll
    now[0] += actor_mod.STATS_PERIOD_S
    assert a._gauges()["calls"] == 2  # the period passed
    core.requests.clear()  # the last request finished: settled values at once
    assert a._gauges() == {"running_sequences": 0.0, "calls": 3.0, "steps": 7.0}


def test_work_tokens_counts_pending_and_still_to_generate():
    a = Sequence(0, [1] * 10, SamplingParams(max_new_tokens=5))
    a.num_computed = 4  # 6 prompt tokens to go, 5 to generate
    b = Sequence(1, [1] * 3, SamplingParams(max_new_tokens=2))
    b.output_ids = [5, 6, 7]  # past its limit (ignored): only the last token is pending
    b.num_computed = 5
    expected = sum(q.num_pending + max(0, q.params.max_new_tokens - len(q.output_ids))
                   for q in (a, b))
    assert work_tokens([a, b]) == expected == 6 + 5 + 1


def test_serving_starts_with_the_startup_heap_frozen():
    import gc

    from tpserve.engine.async_engine import AsyncEngine

    gc.unfreeze()
    engine = AsyncEngine(lambda: SimpleNamespace(has_work=lambda: False, shutdown=lambda: None),
                         "stub", 1)
    engine.start()
    try:
        engine.wait_ready(timeout=10)
        # Objects alive at start-up no longer cost a full collection mid-step.
        assert gc.get_freeze_count() > 0
    finally:
        engine.stop()
        gc.unfreeze()
