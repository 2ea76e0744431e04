"""The output processor's incremental stop-string search and hold-back, on random token
streams and stop strings taken from the decoded text itself, checked against the tokenizer's
full decode: the request ends at the first token whose text completes the earliest stop,
generated_text is the full text up to that stop (kept for TGI, cut for OpenAI), and the
streamed pieces add up to generated_text."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tpserve.engine.output_processor import OutputProcessor
from tpserve.engine.outputs import TokenOutput
from tpserve.engine.request import SamplingParams


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def _expected(tok, ids: list[int], stops: tuple[str, ...], include: bool):
    """(tokens consumed, finish reason, generated_text) from full decodes only."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, s = min(hits)
            return n, "stop_sequence", text if include else text[:at]
    return len(ids), "length", tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [True, False])
def test_random_streams_stop_where_a_full_decode_says(tok, include):
    rng = random.Random(11 if include else 12)
    special = frozenset(tok.all_special_ids)
    # Tokens that are whole characters: a full decode of random bytes would show U+FFFD
    # where the incremental decoder (rightly) waits for the rest of a character.
    vocab = [i for i in range(len(tok)) if i not in special
             and "\ufffd" not in tok.decode([i], skip_special_tokens=True)]
    for case in range(40):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(4, 30))]
        full = tok.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(1, 4)):  # pieces of the text (some hit) and misses
            if rng.random() < 0.7 and len(full) > 2:
                a = rng.randrange(len(full) - 1)
                stops.append(full[a : a + rng.randrange(1, 6)])
            else:
                stops.append("@@" + str(case))
        stops = tuple(s for s in stops if s.strip()) or ("@@",)
        proc = OutputProcessor(tok, special)
        proc.add(1, SamplingParams(max_new_tokens=len(ids), stop=stops,
                                   include_stop_str_in_output=include))
        events = []
        for i, t in enumerate(ids):
            reason = "length" if i == len(ids) - 1 else None
            evs, _ = proc.process([TokenOutput(1, t, -1.0, [], i + 1, 5, reason)])
            events += [e for _, e in evs]
        n, reason, text = _expected(tok, ids, stops, include)
        final = events[-1]
        assert (len(events), final.finish_reason) == (n, reason), (ids, stops)
        assert final.generated_text == text, (ids, stops)
        assert "".join(e.token.text for e in events) == text, (ids, stops)
        assert not any(e.finished for e in events[:-1])


def test_packed_outputs_give_the_same_events_as_token_outputs(tok):
    from tpserve.engine.outputs import pack_outputs

    ids = tok("The quick brown fox jumps over the lazy dog", add_special_tokens=False).input_ids
    params = [SamplingParams(max_new_tokens=8, top_n_tokens=2, prompt_logprobs=True),
              SamplingParams(max_new_tokens=8, stop=("fox",), include_stop_str_in_output=False),
              SamplingParams(max_new_tokens=8)]
    procs = [OutputProcessor(tok, frozenset(tok.all_special_ids)) for _ in range(2)]
    for proc in procs:
        for sid, p in enumerate(params):
            proc.add(sid, p)
    # (id, log p, alternatives) of each prompt token, the first with neither
    prefill = [(ids[0], None, []), (ids[1], -1.25, [(ids[1], -1.25), (ids[0], -2.5)])]
    finals = []
    for step in range(len(ids) - 2):
        outs = [TokenOutput(sid, ids[step + sid], -0.5 * sid, [(ids[0], -0.1), (ids[1], -2.0)],
                            step + 1, 9, "length" if step == len(ids) - 3 else None,
                            prefill if step == 0 and sid == 0 else None)
                for sid in range(3)]
        got = procs[1].process_packed(pack_outputs(outs))
        assert got == procs[0].process(outs)
        finals += [ev for sid, ev in got[0] if sid == 0 and ev.finished]
    (final,) = finals
    assert [t.logprob for t in final.prefill] == [None, -1.25]
    assert [[t.id for t in top] for top in final.prefill_top] == [[], [ids[1], ids[0]]]
