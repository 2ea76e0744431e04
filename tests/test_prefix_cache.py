"""Prefix caching: shared prompt prefixes reuse KV blocks, with outputs unchanged."""

from __future__ import annotations

from engine_utils import greedy, make_engine
from tiny_models import hf_greedy

from tpserve.engine.prefix_cache import PrefixCachingBlockManager
from tpserve.engine.request import SamplingParams
from tpserve.engine.scheduler import Scheduler
from tpserve.engine.sequence import Sequence

SYSTEM = ("Ray actors hold one shard each and all-reduce after row parallel layers, and a "
          "paged cache stores keys and values in fixed size blocks.")


def _seq(i: int, ids: list[int]) -> Sequence:
    return Sequence(i, list(ids), SamplingParams(max_new_tokens=4))


def _run(s: Scheduler) -> None:
    sched = s.schedule()
    s.after_step(sched)
    for x in sched:
        if x.seq.num_computed == x.seq.num_tokens:
            x.seq.output_ids.append(9)


def test_longrope_factor_sets_name_blocks_apart():
    """longrope (original 12): a short and a long sequence with the same first 8 tokens
    share no block (their keys were rotated with different factors); two long ones do."""
    bm = PrefixCachingBlockManager(32, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, longrope_original=12)
    short = _seq(0, list(range(100, 110)))
    s.add(short)
    _run(s)
    long = _seq(1, list(range(100, 108)) + [7] * 8)  # 16 tokens: long
    s.add(long)
    _run(s)
    assert long.long_rope and bm.hits == 0
    assert not set(long.block_table) & set(short.block_table)
    again = _seq(2, list(range(100, 108)) + [8] * 6)
    s.add(again)
    _run(s)
    assert again.long_rope and again.block_table[:2] == long.block_table[:2] and bm.hits == 2


def test_shared_prefix_blocks_are_reused_and_refcounted():
    bm = PrefixCachingBlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = _seq(0, list(range(100, 110)))  # 10 tokens: 2 full blocks + 2
    s.add(a)
    _run(s)
    b = _seq(1, list(range(100, 108)) + [7, 7, 7])  # shares the first 2 blocks
    s.add(b)
    sched = s.schedule()
    mine = next(x for x in sched if x.seq is b)
    assert b.block_table[:2] == a.block_table[:2] and bm.hits == 2
    assert mine.num_new == 3 and b.num_computed == 8
    s.after_step(sched)
    s.finish(a)
    assert bm.num_free == 16 - len(b.block_table)  # shared blocks still held by b
    s.finish(b)
    assert bm.num_free == 16


def test_whole_prompt_cached_still_computes_one_token():
    bm = PrefixCachingBlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = _seq(0, list(range(8)))
    s.add(a)
    _run(s)
    s.finish(a)
    b = _seq(1, list(range(8)))
    s.add(b)
    sched = s.schedule()
    assert sched[0].num_new == 4 and sched[0].completes_prompt  # last block recomputed


def test_cached_blocks_are_evicted_oldest_first_when_needed():
    bm = PrefixCachingBlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):  # each leaves one cached full block behind
        q = _seq(i, [50 * (i + 1) + j for j in range(5)])
        s.add(q)
        _run(s)
        s.finish(q)
    assert bm.num_free == 4
    big = _seq(9, list(range(200, 216)))  # needs all 4 blocks: evicts every cached one
    s.add(big)
    _run(s)
    assert len(big.block_table) == 4 and bm.num_free == 0


def test_engine_with_prefix_caching_matches_transformers(llama_dir):
    prompts = [SYSTEM + " The quick brown fox", SYSTEM + " Hello world", SYSTEM + " A"]
    ref = hf_greedy(llama_dir, prompts, 16)
    engine = make_engine(llama_dir, 1, local=True, prefix_caching=True)
    assert isinstance(engine.scheduler.blocks, PrefixCachingBlockManager)
    first = greedy(engine, prompts[:1], 16)
    hits = engine.scheduler.blocks.hits
    rest = greedy(engine, prompts[1:], 16)
    assert first + rest == ref
    assert engine.scheduler.blocks.hits > hits  # the shared system prompt was reused
    # Preempted sequences come back through the cache too; outputs stay identical.
    small = make_engine(llama_dir, 1, local=True, prefix_caching=True, num_blocks=32)
    seqs = [small.add_request(small.tokenize(p), SamplingParams(max_new_tokens=16,
                                                                ignore_eos=True))
            for p in prompts]
    while small.has_work():
        small.step()
    assert [s.output_ids for s in seqs] == ref
    assert any(s.num_preemptions for s in seqs)
    assert small.scheduler.blocks.num_free == 32
