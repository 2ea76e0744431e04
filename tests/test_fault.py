"""A shard actor that dies fails the requests in flight with a clear error and turns the
replica unhealthy (it does not hang); with no rebuild allowed it stays so, saying why.
(Rebuilding: tests/test_rebuild.py.)"""

from __future__ import annotations

import asyncio

import pytest
import ray
from engine_utils import make_engine

from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.errors import NotReadyError, ShardLostError


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
        with pytest.raises(ShardLostError, match=r"a shard (of the model )?was lost"):
            asyncio.run(ask(4))
        assert not backend.ready() and "a shard was lost" in backend.dead
        with pytest.raises(NotReadyError, match="--max-rebuilds 0 attempts spent"):
            asyncio.run(ask(4))
    finally:
        backend.stop()


def test_failed_start_leaves_no_actors_or_reservations(ray_cluster, llama_dir):
    """An engine whose shards fail to start (no Triton on the CPU) releases its placement
    group and actors, so the cluster's CPUs are free for the next replica."""
    import time

    from tpserve.errors import KernelUnavailableError

    before = ray.available_resources().get("CPU", 0)
    with pytest.raises(Exception) as info:
        make_engine(llama_dir, 2, kernel="triton")
    assert isinstance(info.value, KernelUnavailableError) or "triton" in str(info.value)
    for _ in range(50):  # resource release is asynchronous in Ray
        if ray.available_resources().get("CPU", 0) >= before:
            break
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before


def test_too_few_resources_fail_at_once_with_what_is_missing(ray_cluster, llama_dir):
    """4 CPUs in the test cluster; 2 shards of 3 CPUs can never be placed."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"--tp 2 needs 6 CPU \(the cluster has 4\)"):
        make_engine(llama_dir, 2, cpus_per_shard=3)
    assert time.monotonic() - t0 < 30
