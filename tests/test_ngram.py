"""Speculative decoding's pure-Python side: the n-gram proposer, which rows speculate, the
draft budget, acceptance, and how the scheduler and block manager carry drafts."""

from __future__ import annotations

import subprocess
import sys
from array import array
from dataclasses import replace

import pytest

from tpserve.config import SpeculativeConfig
from tpserve.engine.block_manager import BlockManager
from tpserve.engine.ngram import propose
from tpserve.engine.prefix_cache import PrefixCachingBlockManager
from tpserve.engine.request import GuidedSpec, SamplingParams
from tpserve.engine.scheduler import Scheduler
from tpserve.engine.sequence import Sequence
from tpserve.engine.speculative import accepted, draft_budget, skip_after, speculates


def test_speculation_imports_no_torch():
    code = ("import sys, tpserve.engine.ngram, tpserve.engine.speculative, tpserve.engine.core; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_proposes_what_followed_the_most_recent_occurrence():
    # The suffix [1, 2] occurs at 0..1 (then 3, 4) and at 5..6 (then 9): the later one wins.
    assert propose([1, 2, 3, 4, 7, 1, 2, 9, 8, 1, 2], 2, 2, 1) == [9, 8]


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    # [5, 1, 2] occurs at 0..2 (then 3); only [1, 2] at 5..6 (then 9).
    tokens = [5, 1, 2, 3, 4, 1, 2, 9, 0, 5, 1, 2]
    assert propose(tokens, 1, 3, 1) == [3]
    assert propose(tokens, 1, 2, 1) == [9]  # window 2: both match [1, 2]; the later wins


def test_no_match_of_ngram_min_tokens_proposes_nothing():
    assert propose([1, 2, 3, 4], 3, 3, 1) == []  # 4 never occurred before
    assert propose([7, 1, 2, 8, 3, 2], 3, 3, 2) == []  # only [2] recurs, and min is 2
    assert propose([7, 1, 2, 8, 3, 2], 3, 3, 1) == [8, 3, 2]
    assert propose([1], 3, 3, 1) == [] and propose([], 3, 3, 1) == []


def test_proposal_has_k_tokens_and_a_match_near_the_end_repeats_as_a_loop():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, 3, 2, 1) == [3, 4, 5]
    # [1, 2] ends 6 tokens before the end: the text is taken to repeat with period 6.
    assert propose(tokens, 9, 2, 1) == [3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert propose([7, 5, 5, 5, 5], 4, 3, 1) == [5, 5, 5, 5]
    assert propose([9, 1, 2, 1, 2], 5, 3, 1) == [1, 2, 1, 2, 1]
    assert propose(tokens, 0, 2, 1) == []


def test_accepted_is_the_agreeing_prefix():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == 1  # a later agreement does not count
    assert accepted([4, 5, 6], [1, 5, 6, 7]) == 0


def test_lookups_back_off_after_misses_in_a_row():
    assert [skip_after(m) for m in range(7)] == [0, 0, 1, 3, 7, 7, 7]


def test_which_rows_speculate():
    g = SamplingParams(max_new_tokens=8)
    assert speculates(g) and speculates(replace(g, temperature=0.0))
    assert speculates(replace(g, logit_bias=((3, 5.0),)))  # the same row sampler applies it
    for p in (replace(g, do_sample=True, temperature=0.7), replace(g, repetition_penalty=1.3),
              replace(g, frequency_penalty=0.5), replace(g, top_n_tokens=2),
              replace(g, prompt_logprobs=True),
              replace(g, guided=GuidedSpec("json", "{}"))):
        assert not speculates(p), p


def _seq(prompt: int, out: int, max_new: int, sid: int = 0) -> Sequence:
    s = Sequence(sid, list(range(prompt)), SamplingParams(max_new_tokens=max_new))
    s.output_ids = [1] * out
    return s


def test_draft_budget_keeps_within_max_new_tokens_and_the_context():
    assert draft_budget(_seq(10, 0, 100), 4, 256, None) == 4
    # 3 generated of 6: this step may yield 3 more, so 2 drafts plus the target's token.
    assert draft_budget(_seq(10, 3, 6), 4, 256, None) == 2
    assert draft_budget(_seq(10, 5, 6), 4, 256, None) == 0
    # 10 + 4 tokens of a 16-token context: 2 more fit, so 1 draft.
    assert draft_budget(_seq(10, 4, 100), 4, 16, None) == 1
    # A longrope sequence on the short factors feeds no position past them.
    assert draft_budget(_seq(10, 4, 100), 4, 256, 16) == 2
    long = _seq(10, 4, 100)
    long.long_rope = True
    assert draft_budget(long, 4, 256, 16) == 4


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="--num-speculative-tokens 17"):
        SpeculativeConfig("ngram", num_tokens=17)
    with pytest.raises(ValueError, match="--ngram-min 4 / --ngram-max 3"):
        SpeculativeConfig("ngram", ngram_min=4, ngram_max=3)
    with pytest.raises(ValueError, match="--speculative 'eagle'"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="--speculative-max-batch 0"):
        SpeculativeConfig("ngram", max_batch=0)


def _running(s: Scheduler, seq: Sequence) -> None:
    """Admit seq and compute its prompt, with one sampled token pending."""
    s.add(seq)
    sched = s.schedule()
    s.after_step(sched)
    seq.output_ids.append(9)


def test_scheduler_feeds_drafts_after_the_pending_token():
    s = Scheduler(BlockManager(16, 4), 8, 64)
    seq = _seq(6, 0, 100)
    _running(s, seq)
    seq.draft = [3, 4, 5]
    (x,) = s.schedule()
    assert (x.num_new, x.num_draft) == (4, 3) and x.completes_prompt
    assert len(seq.block_table) == 3  # room for positions 0..9
    s.after_step([x])
    assert seq.num_computed == 7  # drafts count only once verified


def test_drafts_are_trimmed_to_the_token_budget():
    s = Scheduler(BlockManager(16, 4), 8, 3)
    seq = _seq(3, 0, 100)
    _running(s, seq)
    seq.draft = [3, 4, 5, 6]
    (x,) = s.schedule()
    assert (x.num_new, x.num_draft) == (3, 2)


def test_drafts_never_preempt_another_sequence():
    s = Scheduler(BlockManager(4, 4), 8, 64)
    a, b = _seq(7, 0, 100, 0), _seq(7, 0, 100, 1)
    _running(s, a)
    _running(s, b)
    assert s.blocks.num_free == 0  # each holds 2 blocks for its 8 tokens' 7 + the next
    a.draft = [1, 2, 3]
    sched = s.schedule()
    assert [(x.seq.seq_id, x.num_draft) for x in sched] == [(0, 0), (1, 0)]
    assert b.num_preemptions == 0


@pytest.mark.parametrize("cls", [BlockManager, PrefixCachingBlockManager])
def test_shrink_frees_the_blocks_of_rejected_drafts(cls):
    bm = cls(8, 4)
    seq = _seq(5, 0, 100)
    bm.grow(seq, 10)  # 5 known + a pending token + 4 drafts
    seq.num_computed = 6  # the prompt and the pending token are cached; every draft rejected
    assert bm.shrink(seq) == 1 and len(seq.block_table) == 2 and bm.num_free == 6
    seq.num_computed = 8
    assert bm.shrink(seq) == 0 and len(seq.block_table) == 2
    bm.free(seq)
    assert bm.num_free == 8


def test_launch_flags_out_of_range_are_refused_before_anything_starts():
    from argparse import Namespace

    from tpserve import preflight
    from tpserve.cli import build_parser

    args = build_parser().parse_args(["launch", "--speculative", "ngram"])
    assert (args.speculative, args.num_speculative_tokens, args.ngram_max,
            args.ngram_min, args.speculative_max_batch) == ("ngram", 4, 3, 1, 4)
    for flag, value, rule in (("num_speculative_tokens", 0, ">= 1 and <= 16"),
                              ("num_speculative_tokens", 17, ">= 1 and <= 16"),
                              ("speculative_max_batch", 0, ">= 1"),
                              ("ngram_min", 0, ">= 1")):
        with pytest.raises(ValueError, match=rule):
            preflight.check_ranges(Namespace(**{flag: value}))


def _naive(tokens: list[int], k: int, hi: int, lo: int) -> list[int]:
    """The rule spelled out: for n from hi down to lo, the most recent earlier window equal
    to the last n tokens; its followers, the loop they close repeated up to k."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        for j in range(size - 2, n - 2, -1):
            if tokens[j - n + 1 : j + 1] == tokens[size - n :]:
                out = tokens[j + 1 : j + 1 + k]
                while len(out) < k:
                    out.append(out[len(out) - (size - 1 - j)])
                return out
    return []


def test_proposer_matches_the_rule_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice((2, 3, 5, 300, 70000, 1 << 30))  # large ids: bytes across tokens
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        hi = rng.randint(1, 5)
        lo = rng.randint(1, hi)
        k = rng.randint(0, 6)
        assert propose(tokens, k, hi, lo) == (_naive(tokens, k, hi, lo) if k else []), \
            (tokens, k, hi, lo)


def test_a_match_across_token_boundaries_is_not_one():
    # As int32 bytes, tokens 2..4 hold the bytes of [0, 1] three bytes off: no match.
    tokens = [256, 0, 65536, 1 << 24, 0, 1]
    packed = array("i", tokens).tobytes()
    assert packed.rfind(array("i", [0, 1]).tobytes(), 0, 20) == 11
    assert propose(tokens, 2, 2, 2) == [] and _naive(tokens, 2, 2, 2) == []
    # [1] alone: its bytes occur twice off the token boundaries (in 256 and 1 << 24), but
    # the token 1 never occurs before the last.
    assert propose(tokens, 2, 2, 1) == [] == _naive(tokens, 2, 2, 1)
