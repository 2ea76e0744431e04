"""Speculative decoding (--speculative ngram) end to end on the CPU: greedy outputs are
token-identical to transformers' float32 greedy generate on the same tiny checkpoint, with
drafts both accepted and rejected (the counters say so), at tp 1 and on Ray at tp 2; EOS,
max_new_tokens and stop strings inside an accepted run; sampled rows beside speculating
ones; prefix caching; preemption. An oracle guard shows a verification that accepted every
draft would fail the comparison."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

import pytest
from engine_utils import make_engine
from tiny_models import PROMPTS, hf_greedy_ids

import tpserve.engine.core as core_module
from tpserve.config import SpeculativeConfig
from tpserve.engine.request import SamplingParams
from tpserve.engine.step import PENDING_TOKEN

N = 40
# max_batch above the prompts' count: every row of these batches speculates.
SPEC = SpeculativeConfig("ngram", num_tokens=4, ngram_max=3, ngram_min=1, max_batch=64)
GREEDY = SamplingParams(max_new_tokens=N, ignore_eos=True)


def _prompts(engine, path) -> list[list[int]]:
    """The shared prompts (a random model's greedy continuations fall into loops, so drafts
    from its own output are accepted), random token ids (early drafts miss: rejected), and
    prompts built to repeat: two of them followed by their own first 16 greedy tokens, so
    the continuation copies runs of the prompt from its first step."""
    r = random.Random(0)
    plain = [engine.tokenize(p) for p in PROMPTS]
    rand = [[r.randrange(3, 300) for _ in range(n)] for n in (30, 12)]
    heads = hf_greedy_ids(path, [plain[0], plain[2]], [16, 16])
    return plain + rand + [plain[0] + heads[0], plain[2] + heads[1]]


# In-process engines share the process's tensor-parallel state, which shutting one down
# resets: every engine of this module lives until the module ends.
@pytest.fixture(scope="module")
def engines(llama_dir):
    made = {
        "spec": make_engine(llama_dir, 1, local=True, speculative=SPEC),
        "spec-sync": make_engine(llama_dir, 1, local=True, async_scheduling=False,
                                 speculative=SPEC),
        "base": make_engine(llama_dir, 1, local=True),
        "prefix": make_engine(llama_dir, 1, local=True, prefix_caching=True, speculative=SPEC),
        "small": make_engine(llama_dir, 1, local=True, num_blocks=30, speculative=SPEC),
        "busy": make_engine(llama_dir, 1, local=True, speculative=replace(SPEC, max_batch=3)),
    }
    yield made
    for e in made.values():
        e.shutdown()


@pytest.fixture(scope="module")
def engine(engines):
    return engines["spec"]


@pytest.fixture(scope="module")
def prompts(engine, llama_dir):
    return _prompts(engine, llama_dir)


@pytest.fixture(scope="module")
def ref(llama_dir, prompts):
    return hf_greedy_ids(llama_dir, prompts, [N] * len(prompts))


def run(engine, prompts, params):
    """Every request to the end. Returns each one's (ids, finish reason), and per sequence
    the tokens each step output for it (a list of runs). run.seqs: the Sequences;
    run.overlapped: steps that returned with a step still in flight."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    done, runs, steps = {}, defaultdict(list), 0
    run.overlapped = 0
    while len(done) < len(seqs):
        events, _ = engine.step()
        run.overlapped += engine._inflight is not None
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        per_step = defaultdict(list)
        for sid, ev in events:
            assert sid not in done, "a token came after the request finished"
            per_step[sid].append(ev.token.id)
            if ev.finished:
                done[sid] = ev.finish_reason
        for sid, toks in per_step.items():
            runs[sid].append(toks)
    for s in seqs:
        assert PENDING_TOKEN not in s.output_ids
    assert engine.scheduler.blocks.num_free == engine.num_blocks
    assert not engine.has_work()
    run.seqs = seqs
    return [(s.output_ids, done[s.seq_id]) for s in seqs], [runs[s.seq_id] for s in seqs]


def _counted(engine, fn):
    before = engine.counters()
    out = fn()
    after = engine.counters()
    return out, {k: after[k] - before[k] for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                                    "steps")}


@pytest.mark.parametrize("name", ["spec", "spec-sync"], ids=["overlap", "one-at-a-time"])
def test_greedy_matches_transformers_with_accepts_and_rejects(engines, prompts, ref, name):
    e = engines[name]
    assert e.overlap is (name == "spec")
    (got, runs), c = _counted(e, lambda: run(e, prompts, GREEDY))
    assert [ids for ids, _ in got] == ref
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"], c
    assert any(len(r) > 1 for seq_runs in runs for r in seq_runs)  # steps of several tokens
    assert c["steps"] < N  # fewer steps than one token per step would take


def test_oracle_guard_accepting_every_draft_changes_the_output(engine, prompts, ref,
                                                               monkeypatch):
    monkeypatch.setattr(core_module, "accepted", lambda drafts, target: len(drafts))
    got, _ = run(engine, prompts, GREEDY)
    assert [ids for ids, _ in got] != ref


def test_accepted_tokens_report_the_logprobs_of_decoding_one_at_a_time(engines, prompts):
    """details / logprobs: an accepted token's log-probability comes from the verification
    row's logits at its position, the same distribution plain decoding samples from."""
    lps = []
    for name in ("spec", "base"):
        got, _ = run(engines[name], prompts, GREEDY)
        lps.append([lp for s in run.seqs for lp in s.output_logprobs])
    assert len(lps[0]) == len(lps[1]) == N * len(prompts)
    assert max(abs(a - b) for a, b in zip(*lps, strict=True)) < 1e-4
    assert all(lp <= 0 for lp in lps[0]) and len(set(lps[0])) > 1


def test_rows_that_keep_missing_give_the_overlap_back(engine, prompts, ref, monkeypatch):
    """After misses in a row a sequence skips lookups for a while (speculative.skip_after),
    and those steps overlap again; without the back-off every step holding a greedy row
    would be collected at once."""
    got, _ = run(engine, prompts, GREEDY)
    assert [ids for ids, _ in got] == ref
    assert run.overlapped > 0
    monkeypatch.setattr(core_module, "skip_after", lambda misses: 0)
    got, _ = run(engine, prompts, GREEDY)
    assert [ids for ids, _ in got] == ref
    assert run.overlapped == 0


def test_a_batch_above_max_batch_decodes_plainly(engines, prompts, ref, monkeypatch):
    """--speculative-max-batch 3: no sequence drafts while more than three run; once the
    short requests finish, the long ones draft again. Outputs stay transformers' tokens."""
    engine = engines["busy"]
    running_at_lookup = []
    real_draft = core_module.draft

    def counted(*a, **kw):
        running_at_lookup.append(len(engine.scheduler.running))
        return real_draft(*a, **kw)

    monkeypatch.setattr(core_module, "draft", counted)
    lengths = [N if i < 2 else 6 for i in range(len(prompts))]
    params = [replace(GREEDY, max_new_tokens=n) for n in lengths]
    (got, _), counts = _counted(engine, lambda: run(engine, prompts, params))
    assert [ids for ids, _ in got] == [r[:n] for r, n in zip(ref, lengths, strict=True)]
    assert len(prompts) > 3 and running_at_lookup, "the long requests never drafted"
    assert max(running_at_lookup) <= 3, running_at_lookup
    assert counts["spec_draft_tokens"] > 0


def test_a_busy_batch_overlaps_its_steps_as_without_speculation(engines, prompts, ref):
    """More sequences than max_batch: none drafts, and no step waits to be collected for a
    lookup that will not come; the steps overlap as the engine without --speculative's do."""
    (got, _), counts = _counted(engines["busy"], lambda: run(engines["busy"], prompts, GREEDY))
    busy_overlapped = run.overlapped
    assert [ids for ids, _ in got] == ref and counts["spec_draft_tokens"] == 0
    base, _ = run(engines["base"], prompts, GREEDY)
    assert [ids for ids, _ in base] == ref
    assert busy_overlapped == run.overlapped > 0


def test_tp2_on_ray_matches_transformers(ray_cluster, llama_dir, prompts, ref):
    e = make_engine(llama_dir, 2, speculative=SPEC)
    try:
        (got, _), c = _counted(e, lambda: run(e, prompts, GREEDY))
    finally:
        e.shutdown()
    assert [ids for ids, _ in got] == ref
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"], c


def _inside_a_run(runs: list[list[int]]) -> list[int]:
    """Indices of tokens that a verification step output with more tokens after them."""
    at, out = 0, []
    for r in runs:
        out += range(at, at + len(r) - 1)
        at += len(r)
    return out


def test_eos_inside_an_accepted_run_ends_there(engine, prompts, ref):
    _, runs = run(engine, prompts, GREEDY)
    # A token output mid-run whose id did not occur earlier in the output: as EOS, it ends
    # the request there, and the tokens verified after it never leave.
    i, j = next((i, j) for i in range(len(prompts)) for j in _inside_a_run(runs[i])
                if j > 0 and ref[i][j] not in ref[i][:j])
    saved = engine.eos_ids
    engine.eos_ids = frozenset({ref[i][j]})
    try:
        got, _ = run(engine, [prompts[i]], SamplingParams(max_new_tokens=N))
    finally:
        engine.eos_ids = saved
    assert got == [(ref[i][: j + 1], "eos_token")]


def test_max_new_tokens_is_never_overshot(engine, prompts, ref):
    news = list(range(1, 13))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    (got, runs), c = _counted(engine, lambda: run(engine, [prompts[1]] * len(news), params))
    assert got == [(ref[1][:n], "length") for n in news]
    assert c["spec_accepted_tokens"] > 0
    assert any(len(r) > 1 for r in runs[-1])


def test_stop_string_inside_an_accepted_run(engines, engine, prompts, ref):
    _, runs = run(engine, prompts, GREEDY)
    tok = engine.tokenizer

    def text(i, j):
        return tok.decode(ref[i][:j], skip_special_tokens=True)

    def stable(i, j):  # the text of tokens ..j is final: later tokens only append to it
        return text(i, j + 2).startswith(text(i, j + 1))

    # A stop string that first completes at a token output mid-run.
    found = next(((i, j, stop) for i in range(len(prompts)) for j in _inside_a_run(runs[i])
                  if stable(i, j) for n in (3, 2, 1) if (stop := text(i, j + 1)[-n:]).strip()
                  and "\ufffd" not in stop and stop not in text(i, j)), None)
    assert found is not None, "no stop string completes inside a run"
    i, j, stop = found
    params = SamplingParams(max_new_tokens=N, ignore_eos=True, stop=(stop,))
    want = engines["base"].generate([prompts[i]], params)[0]
    seq = engine.add_request(prompts[i], params)
    streamed, final = [], None
    while final is None:
        events, _ = engine.step()
        for sid, ev in events:
            if sid == seq.seq_id:
                assert final is None, "a token streamed after the stop string"
                streamed.append(ev.token.text)
                final = ev if ev.finished else None
    while engine.has_work():
        assert all(sid != seq.seq_id for sid, _ in engine.step()[0])
    assert final.finish_reason == "stop_sequence" == want.finish_reason
    assert final.generated_text == want.generated_text and final.generated_tokens == j + 1
    assert "".join(streamed) == final.generated_text
    assert final.generated_text.endswith(stop)


def test_sampled_rows_beside_speculating_ones_are_unchanged(engines, engine, prompts, ref):
    sampled = SamplingParams(max_new_tokens=N, do_sample=True, temperature=0.9, top_k=40,
                             ignore_eos=True)
    params = [GREEDY if i % 2 == 0 else replace(sampled, seed=100 + i)
              for i in range(len(prompts))]
    (got, _), c = _counted(engine, lambda: run(engine, prompts, params))
    want, _ = run(engines["base"], prompts, params)
    assert got == want
    assert [got[i][0] for i in range(0, len(prompts), 2)] == ref[0::2]
    assert c["spec_accepted_tokens"] > 0


def test_prefix_cache_never_names_a_block_of_rejected_drafts(engines, llama_dir, prompts, ref):
    """Round 2's prompts run into round 1's outputs, so they reuse blocks whose tokens were
    verified drafts; a block that kept a rejected draft's keys would change the answer."""
    e = engines["prefix"]
    (got, _), c = _counted(e, lambda: run(e, prompts, GREEDY))
    assert [ids for ids, _ in got] == ref
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"]
    longer = [p + r[:24] for p, r in zip(prompts, ref, strict=True)]
    hits = e.scheduler.blocks.hits
    got2, _ = run(e, longer, SamplingParams(max_new_tokens=16, ignore_eos=True))
    # Each longer prompt reuses at least the full blocks of its first 24 generated tokens.
    assert e.scheduler.blocks.hits - hits >= 5 * len(longer)
    assert [ids for ids, _ in got2] == hf_greedy_ids(llama_dir, longer, [16] * len(longer))


def test_preemption_loses_nothing(engines, prompts, ref):
    e = engines["small"]
    (got, _), c = _counted(e, lambda: run(e, prompts, GREEDY))
    assert sum(s.num_preemptions for s in run.seqs) > 0
    assert [ids for ids, _ in got] == ref
    assert c["spec_accepted_tokens"] > 0


def test_encoder_decoder_models_are_refused():
    """Refused before any shard starts, by the launcher and by the engine core."""
    from argparse import Namespace

    from transformers import T5Config

    from tpserve.cli import _speculative
    from tpserve.config import EngineConfig, ModelConfig
    from tpserve.engine.core import EngineCore

    hf = T5Config(vocab_size=64, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32)
    args = Namespace(speculative="ngram", num_speculative_tokens=4, ngram_max=3, ngram_min=1)
    with pytest.raises(ValueError, match="--speculative ngram serves decoder-only models"):
        _speculative(args, hf)
    assert _speculative(Namespace(speculative=None), hf).method is None

    class Unstarted:
        shut = False

        def shutdown(self):
            Unstarted.shut = True

    cfg = EngineConfig(ModelConfig(path="/nonexistent", model_id="t5"), speculative=SPEC)
    with pytest.raises(ValueError, match="encoder-decoder model \\(t5\\)"):
        EngineCore(cfg, Unstarted(), hf, set())
    assert Unstarted.shut
