"""TPSERVE_STEP_TRACE: the engine core's step loop and the driver's bridge write a timeline
that serve_bench.py --step-trace splits a burst by. Checked: nothing is written without the
variable; with it, one row per step with the counters' differences, one per admitted batch,
and on the driver's side every request's arrival, submission and last event."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from engine_utils import make_engine

from tpserve.cluster.engine_core_actor import EngineCoreActor
from tpserve.engine import step_trace
from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.engine.step_trace import StepTrace


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(step_trace.ENV, raising=False)
    assert StepTrace.from_env() is None


def test_rows_are_buffered_until_flush_and_filtered_by_time(tmp_path, monkeypatch):
    monkeypatch.setenv(step_trace.ENV, str(tmp_path / "t.jsonl"))
    tr = StepTrace.from_env(".driver")
    assert tr.path == str(tmp_path / "t.jsonl.driver")
    before = {"step_device_wait_seconds": 1.0, "step_tokens": 10.0, "prefill_steps": 2.0}
    after = {"step_device_wait_seconds": 1.25, "step_tokens": 266.0, "prefill_steps": 3.0}
    t0 = time.time()
    tr.event("add", 4)
    tr.step(t0, 0.5, before, after, outputs=7)
    assert not (tmp_path / "t.jsonl.driver").exists()  # nothing written mid-burst
    tr.flush()
    tr.flush()  # nothing new: nothing appended
    rows = step_trace.read(tr.path)
    assert [r["kind"] for r in rows] == ["add", "step"]
    assert rows[0]["n"] == 4
    assert rows[1] == {"kind": "step", "t": t0, "dt": 0.5, "wait": 0.25, "tokens": 256,
                       "prefill": 1, "out": 7}
    assert step_trace.read(tr.path, since=rows[1]["t"] + 1) == []
    assert step_trace.read(str(tmp_path / "missing")) == []


class _Core:
    """Three steps of work once requests come; counters as EngineCore keeps them."""

    def __init__(self) -> None:
        self.left = 0
        self.c = {"steps": 0.0, "step_device_wait_seconds": 0.0, "step_tokens": 0.0,
                  "prefill_steps": 0.0}

    def has_work(self) -> bool:
        return self.left > 0

    def add_requests(self, reqs):
        self.left += 3
        return [SimpleNamespace(seq_id=i, params=None) for i in range(len(reqs))]

    def counters(self) -> dict:
        return dict(self.c)

    def step(self):
        first = self.left == 3
        self.left -= 1
        self.c["steps"] += 1
        self.c["step_tokens"] += 20 if first else 2
        self.c["prefill_steps"] += first
        self.c["step_device_wait_seconds"] += 0.001
        return ["tok", "tok"], None


def test_core_loop_writes_a_row_per_step_and_admission(tmp_path, monkeypatch):
    path = tmp_path / "core.jsonl"
    monkeypatch.setenv(step_trace.ENV, str(path))
    a = EngineCoreActor.__new__(EngineCoreActor)  # no worker: only the step loop runs
    a.core, a._inbox, a._cv, a._out = _Core(), queue.Queue(), threading.Condition(), []
    a._stop, a._error, a._trace = threading.Event(), None, StepTrace.from_env()
    loop = threading.Thread(target=a._loop)
    loop.start()
    try:
        fut: Future = Future()
        a._inbox.put(("add", [([1, 2], None), ([3], None)], None, fut))
        fut.result(timeout=10)
        for _ in range(200):  # the loop writes once it is idle again
            if path.exists() and len(step_trace.read(str(path))) == 4:
                break
            time.sleep(0.02)
    finally:
        a._stop.set()
        a._inbox.put(None)
        loop.join(10)
    rows = step_trace.read(str(path))
    assert [r["kind"] for r in rows] == ["add", "step", "step", "step"]
    assert rows[0]["n"] == 2
    assert [(r["tokens"], r["prefill"], r["out"]) for r in rows[1:]] == [
        (20, 1, 2), (2, 0, 2), (2, 0, 2)]
    assert all(r["wait"] == pytest.approx(0.001) and r["dt"] >= 0 for r in rows[1:])
    assert rows[0]["t"] <= rows[1]["t"] <= rows[2]["t"] <= rows[3]["t"]
    assert len(a._out) == 6  # tracing changed nothing of what the poll hands out


def test_driver_bridge_traces_arrivals_submissions_and_ends(llama_dir, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_trace.ENV, str(path))
    backend = AsyncEngine(lambda: make_engine(llama_dir, 1, local=True, max_model_len=128),
                          "tiny", max_concurrent_requests=8)
    backend.start()
    try:
        backend.wait_ready(120)

        async def one(prompt):
            return [ev async for ev in backend.generate(
                prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))]

        async def run():
            return await asyncio.gather(*(one(p) for p in ("Hello", "The quick", "A b c")))

        outs = asyncio.run(run())
        assert all(len(o) == 4 and o[-1].finished for o in outs)
        rows = []
        for _ in range(100):  # written once the bridge is idle
            rows = step_trace.read(str(path) + ".driver")
            if sum(r["n"] for r in rows if r["kind"] == "done") == 3:
                break
            time.sleep(0.05)
    finally:
        backend.stop()
    total = {k: sum(r["n"] for r in rows if r["kind"] == k)
             for k in ("arrive", "submit", "events", "done")}
    assert total == {"arrive": 3, "submit": 3, "events": 12, "done": 3}
    first = {k: min(r["t"] for r in rows if r["kind"] == k) for k in total}
    assert first["arrive"] <= first["submit"] <= first["events"] <= first["done"]
