"""The gauges a replica reports (running sequences, KV blocks, work tokens: what the
replica router weighs) follow an abort at once, even when nothing else runs afterwards."""

from __future__ import annotations

import asyncio
import time

from test_control_channel import core_client

from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams


async def _settles(backend: AsyncEngine, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = backend.stats()
        if (s.get("running_sequences") == 0 and s.get("work_tokens") == 0
                and s.get("kv_blocks_free") == s.get("kv_blocks_total")):
            return s
        if time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


def test_abort_on_an_idle_replica_shows_in_its_stats_without_a_next_step(ray_cluster,
                                                                         llama_dir):
    backend = AsyncEngine(lambda: core_client(llama_dir, 1), "tiny", 8)
    backend.start()
    backend.wait_ready(120)
    try:
        async def start_then_abort():
            stream = backend.generate("one two three", SamplingParams(max_new_tokens=200,
                                                                      ignore_eos=True))
            got = [await stream.__anext__() for _ in range(3)]
            busy = backend.stats()
            await stream.aclose()  # the client went away: the engine aborts the request
            # (Waited for on the same event loop: the engine may still deliver events of
            # the step in flight to it.)
            return got, busy, await _settles(backend, 3.0)

        got, busy, s = asyncio.run(start_then_abort())
        assert len(got) == 3 and not got[-1].finished
        assert busy["running_sequences"] == 1 and busy["work_tokens"] > 0
        assert busy["kv_blocks_free"] < busy["kv_blocks_total"]
        assert s["running_sequences"] == 0, s
        assert s["work_tokens"] == 0, s
        assert s["kv_blocks_free"] == s["kv_blocks_total"], s
        # And the replica still serves.
        async def one():
            return [e async for e in backend.generate("one", SamplingParams(
                max_new_tokens=3, ignore_eos=True))]
        assert len(asyncio.run(one())) == 3
    finally:
        backend.stop()
