"""The per-step control message from rank 0 to the other ranks: compact int64 arrays that
carry everything a follower needs to run the same step (and nothing only rank 0 needs)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray
from engine_utils import make_engine

from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.request import SamplingParams
from tpserve.engine.step import SeqStep, StepBatch
from tpserve.errors import GenerationError
from tpserve.worker.control import STEP, decode_step, encode_step


def test_step_round_trips_through_the_message():
    p = SamplingParams(max_new_tokens=3, top_n_tokens=2)
    batch = StepBatch(7, [
        SeqStep(11, [5, 6, 7], 0, [3, -1, 4], True, p, history=[1, 2], num_generated=1,
                prompt_logprobs=True),
        SeqStep(12, [9], 40, [8], False, p),
        SeqStep(13, [0], 0, [2], True, p, encoder_ids=[4, 4, 5], encoder_len=3,
                cross_block_table=[6, 7]),
    ])
    msg = encode_step(batch)
    assert msg.dtype == np.int64 and msg[0] == STEP
    got = decode_step(msg)
    assert got.step_id == 7 and len(got.seqs) == 3
    for a, b in zip(got.seqs, batch.seqs, strict=True):
        assert (a.token_ids, a.start_pos, a.block_table, a.sample, a.prompt_logprobs) == \
            (b.token_ids, b.start_pos, b.block_table, b.sample, b.prompt_logprobs)
        assert (a.encoder_ids, a.encoder_len, a.cross_block_table) == \
            (b.encoder_ids, b.encoder_len, b.cross_block_table)
        assert a.params is None and a.history is None  # only rank 0 samples


def core_client(path, tp: int):
    """The served path: engine core in rank 0's actor, output processing here."""
    from tpserve.cluster.core_client import CoreClient
    from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    return CoreClient(EngineConfig(
        model=ModelConfig(path=str(path), model_id="tiny", max_model_len=256),
        parallel=ParallelConfig(tp_size=tp, device="cpu", cpus_per_shard=1,
                                dist_timeout_s=60),
        cache=CacheConfig(block_size=4, num_blocks=256)))


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_core_in_rank0_matches_transformers(ray_cluster, llama_dir, tp):
    from tiny_models import PROMPTS, hf_greedy

    backend = AsyncEngine(lambda: core_client(llama_dir, tp), "tiny", 8)
    backend.start()
    backend.wait_ready(180)
    try:
        async def ask(prompt):
            return [e async for e in backend.generate(
                prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))]

        async def all_at_once():
            return await asyncio.gather(*(ask(p) for p in PROMPTS))

        got = asyncio.run(all_at_once())
        assert [[e.token.id for e in evs] for evs in got] == hf_greedy(llama_dir, PROMPTS, 12)
        assert all(evs[-1].generated_text == "".join(e.token.text for e in evs) for evs in got)
        assert backend.stats()["kv_blocks_free"] == backend.engine.num_blocks
        assert len(backend.engine.health()) == tp
    finally:
        backend.stop()


@pytest.mark.parametrize("served", [False, True], ids=["engine-in-driver", "core-in-rank0"])
def test_killing_a_shard_mid_request_fails_it_without_a_hang(ray_cluster, llama_dir, served):
    """Rank 1 dies while its step loop serves an in-flight request: the request fails with
    a clear error well within the collective timeout, and the replica reports dead."""
    build = (lambda: core_client(llama_dir, 2)) if served else (lambda: make_engine(llama_dir, 2))
    backend = AsyncEngine(build, "tiny", 8)
    backend.start()
    backend.wait_ready(180)
    try:
        async def run():
            events = []
            with pytest.raises(GenerationError, match="generation failed.*shard"):
                async for ev in backend.generate("Hello world", SamplingParams(
                        max_new_tokens=200, ignore_eos=True)):
                    events.append(ev)
                    if len(events) == 3:
                        ray.kill(backend.engine.executor.actors[1])
                        killed[0] = time.monotonic()
            return events

        killed = [0.0]
        events = asyncio.run(run())
        assert 3 <= len(events) < 200
        assert time.monotonic() - killed[0] < 60
        assert not backend.ready() and "shard" in backend.dead
    finally:
        backend.stop()
