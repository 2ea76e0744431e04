"""A shard actor that dies fails the requests in flight with a clear error and turns the
replica unhealthy (it does not hang)."""

from __future__ import annotations

import asyncio

import pytest
import ray
from engine_utils import make_engine

from tpserve.cluster.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.errors import GenerationError, NotReadyError


def test_dead_shard_fails_requests_and_health(ray_cluster, llama_dir):
    backend = AsyncEngine(lambda: make_engine(llama_dir, 2), "tiny", 8)
    backend.start()
    backend.wait_ready(180)
    try:
        async def ask(n):
            return [e async for e in backend.generate(
                "Hello world", SamplingParams(max_new_tokens=n, ignore_eos=True))]

        assert len(asyncio.run(ask(4))) == 4
        ray.kill(backend.engine.executor.actors[1])
        with pytest.raises(GenerationError, match="generation failed"):
            asyncio.run(ask(4))
        assert not backend.ready() and "shard actor died" in backend.dead
        with pytest.raises(NotReadyError):
            asyncio.run(ask(4))
    finally:
        backend.stop()
