"""Overlapped steps (async scheduling): step n+1 is scheduled and launched before step n's
tokens reach the host. Outputs must be exactly those of one step at a time, and both must
equal transformers (greedy, float32, CPU) at tp 1, 2 and 4."""

from __future__ import annotations

import pytest
from engine_utils import greedy, make_engine
from tiny_models import PROMPTS, hf_greedy

from tpserve.engine.request import SamplingParams
from tpserve.engine.step import PENDING_TOKEN

N = 16


@pytest.fixture(scope="module")
def reference(llama_dir):
    return hf_greedy(llama_dir, PROMPTS, N)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one-at-a-time"])
# tp = 4 broadcasts the sampled ids as tp = 2 does, to more ranks: slow job (~10 s each).
@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_matches_transformers(ray_cluster, llama_dir, reference, tp, overlap):
    # tp = 1 runs in this process (the executor whose launch returns before the tokens are
    # read); tp > 1 on Ray shard actors, where the other ranks get the sampled ids by a
    # broadcast and fill them in themselves.
    engine = make_engine(llama_dir, tp, local=tp == 1, async_scheduling=overlap)
    try:
        assert engine.overlap is overlap
        assert greedy(engine, PROMPTS, N) == reference
        assert engine.scheduler.blocks.num_free == engine.num_blocks
        assert not engine.has_work()
    finally:
        engine.shutdown()


def _run(engine, prompts, params_list):
    """Every request to the end; (token ids, finish reason) of each, in order."""
    seqs = [engine.add_request(engine.tokenize(p), q) for p, q in zip(prompts, params_list)]
    done = {}
    steps = 0
    while len(done) < len(seqs):
        events, _ = engine.step()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        for sid, ev in events:
            if ev.finished:
                done[sid] = ev.finish_reason
    for s in seqs:
        assert PENDING_TOKEN not in s.output_ids
    return [(s.output_ids, done[s.seq_id]) for s in seqs]


@pytest.fixture(scope="module")
def engines(llama_dir):
    """The same in-process engine with the overlap on and off (tp = 1)."""
    on = make_engine(llama_dir, 1, local=True, async_scheduling=True)
    off = make_engine(llama_dir, 1, local=True, async_scheduling=False)
    yield on, off
    on.shutdown()
    off.shutdown()


def test_eos_seen_one_step_late_drops_the_extra_token(engines, reference):
    """A sequence that ends by EOS at step n was already scheduled in step n+1: that extra
    token is computed but never output, and its blocks come back."""
    on, off = engines
    eos = reference[0][5]  # the 6th greedy token of the first prompt ends it
    got = []
    for engine in engines:
        saved = engine.eos_ids
        engine.eos_ids = frozenset({eos})
        try:
            got.append(_run(engine, PROMPTS, [SamplingParams(max_new_tokens=N)] * len(PROMPTS)))
        finally:
            engine.eos_ids = saved
        assert engine.scheduler.blocks.num_free == engine.num_blocks
    assert got[0] == got[1]
    ids, reason = got[0][0]
    assert reason == "eos_token" and ids == reference[0][: reference[0].index(eos) + 1]
    # The others run on unaffected unless they meet the same token.
    for (ids, reason), ref in zip(got[0][1:], reference[1:], strict=True):
        cut = ref.index(eos) + 1 if eos in ref else N
        assert ids == ref[:cut]
        assert reason == ("eos_token" if eos in ref else "length")


def test_lengths_sampling_and_penalties_match_one_at_a_time(engines):
    """Different lengths (1 token: held at its prefill), seeded sampling, and rows with
    penalties (their step is collected at once: sampling reads the token history on the
    host) in one batch: identical with the overlap on and off."""
    params = [SamplingParams(max_new_tokens=1, ignore_eos=True),
              SamplingParams(max_new_tokens=7, ignore_eos=True, do_sample=True, seed=11,
                             temperature=0.9, top_k=20),
              SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=9, ignore_eos=True, do_sample=True, seed=5,
                             top_p=0.8, frequency_penalty=0.5)]
    prompts = PROMPTS[: len(params)]
    on, off = (_run(e, prompts, params) for e in engines)
    assert on == off
    assert [len(ids) for ids, _ in on] == [1, 7, 12, 9]
    assert all(reason == "length" for _, reason in on)


def test_abort_and_stop_while_a_step_is_in_flight(engines, reference):
    """A request aborted (client gone) or ended by a stop string in the driver while its
    next token is on the device: its late tokens are dropped, its blocks come back, and the
    requests beside it produce what they would alone."""
    on, _ = engines
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    seqs = [on.add_request(on.tokenize(p), params) for p in PROMPTS]
    victim, stopped = seqs[0], seqs[1]
    steps = 0
    while on.has_work():
        events, _ = on.step()
        steps += 1
        assert steps < 2000
        if steps == 4:
            assert on._inflight is not None, "a step should be in flight between calls"
            on.abort(victim.seq_id)
            on.finish(stopped.seq_id, "stop_sequence")
            cut_victim, cut_stopped = len(victim.output_ids), len(stopped.output_ids)
        for sid, _ev in events:
            assert steps <= 4 or sid not in (victim.seq_id, stopped.seq_id), \
                "a token of an ended request was output"
    assert [s.output_ids for s in seqs[2:]] == reference[2:]
    # Only the tokens collected before the end remain (the one in flight then is dropped).
    for seq, ref, cut in ((victim, reference[0], cut_victim), (stopped, reference[1],
                                                              cut_stopped)):
        assert 1 <= cut <= 5 and seq.output_ids == ref[:cut]
    assert on.scheduler.blocks.num_free == on.num_blocks


# Last: its in-process engine's shutdown resets this process's tensor-parallel info, which
# the module's shared engines above still use.
def test_preemption_and_prefix_caching_under_overlap(ray_cluster, llama_dir, reference):
    """A cache too small for every sequence at once: sequences are preempted (their last
    token may still be on the device) and recomputed; shared prefixes are reused. Greedy
    output stays that of transformers."""
    engine = make_engine(llama_dir, 1, local=True, num_blocks=24, prefix_caching=True)
    try:
        prompts = PROMPTS + PROMPTS[:2]  # repeats hit the prefix cache
        params = SamplingParams(max_new_tokens=N, ignore_eos=True)
        seqs = [engine.add_request(engine.tokenize(p), params) for p in prompts]
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            assert steps < 2000
        assert [s.output_ids for s in seqs] == reference + reference[:2]
        assert any(s.num_preemptions for s in seqs), "the cache was meant to run out"
        assert engine.scheduler.blocks.hits > 0
        assert engine.scheduler.blocks.num_free == engine.num_blocks
    finally:
        engine.shutdown()
