"""A shard that stops answering (its process stopped or wedged: alive, so Ray reports
nothing) while requests run: the driver notices within seconds and fails the in-flight
requests with a clear error instead of waiting out --collective-timeout (600 s)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
from test_control_channel import core_client

import tpserve.cluster.core_client as core_client_module
from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.errors import ShardLostError


@pytest.fixture
def quick_stall_check(monkeypatch):
    monkeypatch.setattr(core_client_module, "STALL_S", 2.0)
    monkeypatch.setattr(core_client_module, "STALL_HEALTH_TIMEOUT_S", 3.0)


def test_stopped_follower_fails_in_flight_requests_within_seconds(ray_cluster, llama_dir,
                                                                  quick_stall_check):
    backend = AsyncEngine(lambda: core_client(llama_dir, 2), "tiny", 8)
    backend.start()
    backend.wait_ready(120)
    stopped = None
    try:
        pid = ray.get(backend.engine.followers[0].health.remote())["pid"]

        async def scenario():
            nonlocal stopped
            stream = backend.generate("one two three", SamplingParams(max_new_tokens=240,
                                                                      ignore_eos=True))
            await stream.__anext__()
            os.kill(pid, signal.SIGSTOP)  # alive but silent: Ray sees no death
            stopped = pid
            t0 = time.monotonic()
            with pytest.raises(ShardLostError, match="shard 1"):
                async for _ in stream:
                    pass
            return time.monotonic() - t0

        took = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert took < 20, took  # not the 60 s collective timeout of this config
        assert not backend.ready()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        backend.stop()
