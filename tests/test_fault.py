"""A shard actor that dies fails the requests in flight with a clear error and turns the
replica unhealthy (it does not hang); with no rebuild allowed it stays so, saying why.
(Rebuilding: tests/test_rebuild.py.)"""

from __future__ import annotations

import asyncio
import time

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


@pytest.mark.slow
def test_worker_killed_mid_request_is_rebuilt_and_answers_as_before(ray_cluster, llama_dir):
    """ray.kill of a follower while a request streams (the group `tpserve launch` runs:
    CoreClient): the request ends with a retryable 503 `shard_lost` rather than a hang, the
    group is rebuilt, and later requests answer as before and as transformers does."""
    from tiny_models import hf_greedy

    from tpserve.cluster.core_client import CoreClient
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.engine.rebuild import RebuildPolicy

    cfg = EngineConfig(
        model=ModelConfig(path=str(llama_dir), model_id="tiny", max_model_len=256),
        parallel=ParallelConfig(tp_size=2, device="cpu", cpus_per_shard=1),
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_concurrent_requests=8))
    backend = AsyncEngine(lambda: CoreClient(cfg), "tiny", 8, None,
                          RebuildPolicy(max_rebuilds=1, backoff_s=0.1))
    backend.start()
    backend.wait_ready(180)
    prompt = "Hello world"
    try:
        async def ids(n):
            return [e.token.id async for e in backend.generate(
                prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))]

        before = asyncio.run(ids(6))
        assert before == hf_greedy(llama_dir, [prompt], 6)[0]
        old = backend.engine.actors

        async def killed_mid_stream():
            got = 0
            with pytest.raises(ShardLostError) as info:
                async for _ in backend.generate(prompt, SamplingParams(max_new_tokens=200,
                                                                       ignore_eos=True)):
                    got += 1
                    if got == 2:
                        ray.kill(old[1])
            return got, info.value

        got, err = asyncio.run(asyncio.wait_for(killed_mid_stream(), 120))  # no hang
        assert 2 <= got < 200 and err.status_code == 503 and err.retry_after, (got, err)
        assert "retry when GET /health answers 200" in str(err)
        deadline = time.monotonic() + 180
        while not backend.ready():
            assert backend.state == "rebuilding", backend.not_ready_reason()
            assert time.monotonic() < deadline, "not rebuilt in time"
            time.sleep(0.2)
        assert backend.engine.actors[0] is not old[0]
        assert asyncio.run(ids(6)) == before
    finally:
        backend.stop()
