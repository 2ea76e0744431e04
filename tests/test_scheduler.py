"""The pure-Python side: block manager, continuous batching, chunked prefill, preemption."""

from __future__ import annotations

import sys

from tpserve.engine.block_manager import BlockManager
from tpserve.engine.request import SamplingParams
from tpserve.engine.scheduler import Scheduler
from tpserve.engine.sequence import SeqStatus, Sequence


def seq(i: int, n: int) -> Sequence:
    return Sequence(i, list(range(n)), SamplingParams(max_new_tokens=100))


def run_step(s: Scheduler, sample_token: int = 7):
    sched = s.schedule()
    s.after_step(sched)
    for x in sched:
        if x.seq.num_computed == x.seq.num_tokens:
            x.seq.output_ids.append(sample_token)
    return sched


def test_engine_package_imports_no_torch():
    import subprocess

    code = ("import sys, tpserve.engine.scheduler, tpserve.engine.detokenizer, "
            "tpserve.engine.step; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_manager_allocates_and_frees():
    bm = BlockManager(8, 4)
    s = seq(0, 10)
    bm.grow(s, 10)
    assert len(s.block_table) == 3 and bm.num_free == 5
    bm.grow(s, 12)
    assert len(s.block_table) == 3
    bm.grow(s, 13)
    assert len(s.block_table) == 4 and len(set(s.block_table)) == 4
    bm.free(s)
    assert bm.num_free == 8 and s.block_table == []


def test_new_requests_join_running_batch_between_steps():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq(0, 5)
    s.add(a)
    first = run_step(s)
    assert [(x.seq.seq_id, x.num_new) for x in first] == [(0, 5)]
    b = seq(1, 6)
    s.add(b)
    second = run_step(s)
    # a decodes one token while b's prompt is prefilled in the same step.
    assert [(x.seq.seq_id, x.num_new) for x in second] == [(0, 1), (1, 6)]


def test_long_prompt_is_prefilled_in_chunks():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = seq(0, 20)
    s.add(a)
    chunks = [run_step(s)[0].num_new for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert a.output_ids == [7]  # sampled only after the last chunk


def test_preemption_by_recompute_when_cache_is_full():
    s = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(0, 8), seq(1, 8)  # two blocks each
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.status is b.status is SeqStatus.RUNNING
    for _ in range(8):  # each grows to a third block, then a fourth: 8 > 6 blocks
        run_step(s)
    assert b.num_preemptions >= 1 and b.status is SeqStatus.WAITING and b.num_computed == 0
    assert a.status is SeqStatus.RUNNING
    total = sum(len([x for x in q.block_table if x >= 0]) for q in (a, b))
    assert total + s.blocks.num_free == 6
    # Once a finishes, b is recomputed from all its tokens (prompt + what it generated).
    s.finish(a)
    known = b.num_tokens
    sched = run_step(s)
    assert known > 8 and sched[0].seq is b and sched[0].num_new == known


def test_max_num_seqs_limits_admission():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add(seq(i, 3))
    assert len(run_step(s)) == 2
    assert len(s.waiting) == 1


def test_sliding_window_releases_blocks():
    bm = BlockManager(100, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, sliding_window=8)
    a = seq(0, 20)
    s.add(a)
    for _ in range(40):
        run_step(s)
    live = [b for b in a.block_table if b >= 0]
    assert len(live) <= 8 // 4 + 2
    assert bm.num_free == 100 - len(live)
    # Never frees a block a future query could still see (the last `window` positions).
    first_live = next(i for i, b in enumerate(a.block_table) if b >= 0)
    assert (first_live + 1) * 4 - 1 > a.num_computed - 8


def test_longrope_sequence_growing_past_the_original_context_is_recomputed_long():
    """longrope (original 8): a 6-token prompt decodes with the short factors until it holds
    9 tokens; that step recomputes all 9 with the long factors (fresh blocks, the old ones
    freed) instead of decoding one. A 10-token prompt is long from its first chunk."""
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64,
                  longrope_original=8)
    a, b = seq(0, 6), seq(1, 10)
    s.add(a)
    s.add(b)
    first = run_step(s)
    assert [(x.seq.seq_id, x.num_new) for x in first] == [(0, 6), (1, 10)]
    assert not a.long_rope and b.long_rope
    run_step(s)
    run_step(s)  # decodes a's 8th token (8 tokens: still short), samples a 9th
    assert a.num_tokens == 9 and a.num_computed == 8 and not a.long_rope
    short_table = list(a.block_table)
    fourth = run_step(s)  # a holds 9 tokens: recomputed whole
    assert [(x.seq.seq_id, x.num_new) for x in fourth] == [(1, 1), (0, 9)]
    assert a.long_rope and a.num_computed == 9 and a.status is SeqStatus.RUNNING
    assert a.block_table != short_table and s.blocks.num_free == 16 - 3 - 4
    fifth = run_step(s)
    assert [(x.seq.seq_id, x.num_new) for x in fifth] == [(1, 1), (0, 1)]


def test_models_without_longrope_never_recompute():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq(0, 6)
    s.add(a)
    for _ in range(6):
        assert [x.num_new for x in run_step(s)] in ([6], [1])
    assert not a.long_rope and a.num_preemptions == 0


class _ByteTok:
    """decode() as a byte-level tokenizer would: ids are bytes, joined then UTF-8 decoded."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_split_characters():
    from tpserve.engine.detokenizer import IncrementalDetokenizer

    text = "héllo → wörld"
    d = IncrementalDetokenizer(_ByteTok())
    pieces = [d.add(b) for b in text.encode()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the first byte of a two-byte character emitted nothing


def test_detokenizer_native_stream_matches_full_decode():
    """Fast tokenizers use tokenizers' DecodeStream; pieces add up to decode(all)."""
    from tiny_models import build_tokenizer

    from tpserve.engine.detokenizer import IncrementalDetokenizer

    tok = build_tokenizer(300)
    text = "Hello world, héllo → wörld and   spaces\n  indented 漢字"
    ids = tok(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, frozenset(tok.all_special_ids))
    assert d._stream is not None
    assert "".join(d.add(i) for i in ids) == tok.decode(ids, skip_special_tokens=True)
