"""The prefix cache names blocks incrementally (O(new blocks) per step): checked against a
brute-force oracle that rehashes every computed block of every sequence from its tokens;
a chunked prefill names only what it computed; a placeholder token (-1, in flight with
overlapped steps) is never hashed, and the block is named once it is resolved."""

from __future__ import annotations

import random

from tpserve.engine.prefix_cache import PrefixCachingBlockManager
from tpserve.engine.request import SamplingParams
from tpserve.engine.scheduler import Scheduler
from tpserve.engine.sequence import Sequence


def _seq(i: int, ids: list[int], new: int = 8) -> Sequence:
    return Sequence(i, list(ids), SamplingParams(max_new_tokens=new))


def _oracle_hashes(tokens: list[int], bs: int, n: int) -> list[int]:
    out, prev = [], 0
    for i in range(n):
        prev = hash((prev, tuple(tokens[i * bs : (i + 1) * bs])))
        out.append(prev)
    return out


def _check_named(bm: PrefixCachingBlockManager, seqs: list[Sequence]) -> None:
    """Every computed full block of a live sequence is findable by its hash: named itself,
    or its hash held by another block with the same tokens."""
    bs = bm.block_size
    for q in seqs:
        if q.finished or not q.block_table:
            continue
        full = min(q.num_computed // bs, len(q.block_table))
        for i, h in enumerate(_oracle_hashes(q.prompt_ids + q.output_ids, bs, full)):
            assert h in bm._by_hash, (q.seq_id, i)
            assert bm._hash_of.get(q.block_table[i], h) == h


def test_incremental_naming_matches_a_full_rehash_under_eviction_and_duplicates():
    rng = random.Random(3)
    bm = PrefixCachingBlockManager(20, 4)
    s = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=48)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(5, 20))] for _ in range(6)]
    seqs, next_id = [], 0
    for _ in range(300):
        if rng.random() < 0.3:  # pairs admitted together compute the same blocks twice
            p = rng.choice(prompts)[: rng.randrange(4, 20)] + [rng.randrange(50)]
            for _ in range(rng.choice((1, 2))):
                seqs.append(_seq(next_id, p, new=rng.randrange(1, 12)))
                s.add(seqs[-1])
                next_id += 1
        sched = s.schedule()
        s.after_step(sched)
        for x in sched:
            q = x.seq
            if q.num_computed == q.num_tokens:
                q.output_ids.append(rng.randrange(3))  # few distinct: duplicate blocks
                if len(q.output_ids) >= q.params.max_new_tokens:
                    s.finish(q)
        _check_named(bm, seqs)
    assert bm.hits > 0 and bm._epoch > 0  # reuse and shadowed evictions both happened


def test_chunked_prefill_names_only_computed_blocks():
    bm = PrefixCachingBlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6)
    prompt = list(range(100, 120))  # 5 blocks; the first step computes 6 tokens
    a = _seq(0, prompt)
    s.add(a)
    s.after_step(s.schedule())
    assert a.num_computed == 6
    block0 = a.block_table[0]
    s.finish(a)  # its blocks stay cached; only the computed full one is named
    b = _seq(1, prompt)
    s.add(b)
    s.schedule()
    assert bm.hits == 1 and b.block_table[0] == block0 and b.num_computed == 4


def test_placeholder_token_is_not_hashed_until_resolved():
    bm = PrefixCachingBlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = _seq(0, [1, 2, 3, 4, 5, 6])
    s.add(a)
    s.after_step(s.schedule())
    a.output_ids += [7, -1]  # 8 tokens: the second block ends in a token still in flight
    sched = s.schedule()
    s.after_step(sched)  # computes 7 and the placeholder: block 1 is full
    assert a.num_computed == 8
    assert len(a.block_hashes) == 1  # block 1 (5, 6, 7, -1) was not hashed
    assert len(bm._by_hash) == 1
    a.output_ids[-1] = 8  # resolved
    a.output_ids.append(9)
    s.after_step(s.schedule())
    assert a.block_hashes == _oracle_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = _seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    s.add(b)
    s.schedule()
    assert b.block_table[:2] == a.block_table[:2]  # found through the resolved hash
