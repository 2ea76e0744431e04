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
from tpserve.errors import ShardLostError
from tpserve.worker.control import STEP, decode_step, encode_step


def test_step_round_trips_through_the_message():
    p = SamplingParams(max_new_tokens=3, top_n_tokens=2)
    batch = StepBatch(7, [
        SeqStep(11, [5, 6, 7], 0, [3, -1, 4], True, p, history=[1, 2], num_generated=1,
                prompt_logprobs=True),
        SeqStep(12, [9], 40, [8], False, p, blocks_from=10, long_rope=True),
        SeqStep(13, [0], 0, [2], True, p, encoder_ids=[4, 4, 5], encoder_len=3,
                cross_block_table=[6, 7]),
    ], released=[3, 5])
    msg = encode_step(batch)
    assert msg.dtype == np.int64 and msg[0] == STEP
    got = decode_step(msg)
    assert got.step_id == 7 and len(got.seqs) == 3 and got.released == [3, 5]
    for a, b in zip(got.seqs, batch.seqs, strict=True):
        assert (a.seq_id, a.token_ids, a.start_pos, a.block_table, a.blocks_from) == \
            (b.seq_id, b.token_ids, b.start_pos, b.block_table, b.blocks_from)
        assert (a.sample, a.prompt_logprobs, a.long_rope) == \
            (b.sample, b.prompt_logprobs, b.long_rope)
        assert (a.encoder_ids, a.encoder_len, a.cross_block_table) == \
            (b.encoder_ids, b.encoder_len, b.cross_block_table)
        assert a.params is None and a.history is None  # only rank 0 samples


def test_worker_block_tables_apply_deltas_like_full_tables():
    """The persistent tables a worker builds from deltas equal the full tables the engine
    holds, through growth, release, row reuse and a preemption's replaced table."""
    from tpserve.worker.block_tables import BlockTables

    store = BlockTables(rows=2, width=2)
    full = {1: [4, 5], 2: [7]}
    rows = store.update([SeqStep(1, [0], 0, [4, 5], True), SeqStep(2, [0], 0, [7], True)])
    assert store.gather(rows, 2).tolist() == [[4, 5], [7, 0]]
    full[1] += [8, 9, 10]  # grows past the store's width
    rows = store.update([SeqStep(1, [0], 9, [8, 9, 10], True, blocks_from=2),
                         SeqStep(2, [0], 3, [], True, blocks_from=1)])
    assert store.gather(rows, 5)[0].tolist() == full[1]
    store.release([2])
    rows = store.update([SeqStep(3, [0], 0, [11, -1], True)])  # reuses row of 2; -1 reads 0
    assert store.gather(rows, 2).tolist() == [[11, 0]]
    rows = store.update([SeqStep(1, [0], 0, [12], True)])  # preempted: replaced whole
    assert store.gather(rows, 1).tolist() == [[12]]
    for i in range(4, 8):  # more sequences than rows: the store grows
        store.update([SeqStep(i, [0], 0, [i], True)])
    with pytest.raises(RuntimeError, match="never got"):
        store.update([SeqStep(99, [0], 4, [1], True, blocks_from=1)])


def core_client(path, tp: int, kernel: str = "auto"):
    """The served path: engine core in rank 0's actor, output processing here."""
    from tpserve.cluster.core_client import CoreClient
    from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    return CoreClient(EngineConfig(
        model=ModelConfig(path=str(path), model_id="tiny", max_model_len=256),
        parallel=ParallelConfig(tp_size=tp, device="cpu", cpus_per_shard=1,
                                dist_timeout_s=60),
        cache=CacheConfig(block_size=4, num_blocks=256), kernel=kernel))


def test_failed_core_start_says_why_and_releases_the_cluster(ray_cluster, llama_dir):
    before = ray.available_resources().get("CPU", 0)
    with pytest.raises(Exception, match="triton"):
        core_client(llama_dir, 2, kernel="triton")
    for _ in range(50):  # resource release is asynchronous in Ray
        if ray.available_resources().get("CPU", 0) >= before:
            break
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before


def test_missing_tokenizer_says_so_and_releases_the_cluster(ray_cluster, llama_dir, tmp_path):
    """The shard actors start while the tokenizer loads: when it cannot load, they go too."""
    import shutil

    from tpserve.errors import CheckpointError

    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in llama_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and "token" not in f.name:
            shutil.copy(f, bare / f.name)
    before = ray.available_resources().get("CPU", 0)
    with pytest.raises(CheckpointError, match="cannot load a tokenizer"):
        core_client(bare, 2)
    for _ in range(50):  # resource release is asynchronous in Ray
        if ray.available_resources().get("CPU", 0) >= before:
            break
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("served", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["engine-in-driver", "core-in-rank0"])
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
            with pytest.raises(ShardLostError, match="shard of the model was lost.*shard 1"):
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
        assert not backend.ready() and "shard" in backend.dead and backend.state == "failed"
    finally:
        backend.stop()
