"""The output processor owns text and stop strings: TGI keeps the stop string in the text,
OpenAI cuts it; streamed pieces add up to generated_text either way; tokens that arrive for a
stopped request are dropped. Checked against the tokenizer's own full decode."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tpserve.engine.output_processor import OutputProcessor
from tpserve.engine.outputs import TokenOutput
from tpserve.engine.request import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def run(tok, params: SamplingParams, ids: list[int], core_finish: dict[int, str] | None = None):
    """Feed ids one step at a time; returns (events, stopped ids, steps fed)."""
    proc = OutputProcessor(tok, frozenset(tok.all_special_ids))
    proc.add(7, params)
    events, stopped = [], []
    for i, t in enumerate(ids):
        out = TokenOutput(7, t, -0.5, [], i + 1, 3, (core_finish or {}).get(i))
        evs, stop = proc.process([out])
        events += [e for _, e in evs]
        stopped += stop
    return events, stopped


def test_stop_string_included_for_tgi(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    events, stopped = run(tok, SamplingParams(max_new_tokens=64, stop=("fox",)), ids)
    final = events[-1]
    assert final.finished and final.finish_reason == "stop_sequence" and stopped == [7]
    full = tok.decode(ids[: len(events)], skip_special_tokens=True)
    assert final.generated_text == full and final.generated_text.endswith("fox")
    assert "".join(e.token.text for e in events) == final.generated_text
    # Tokens the core produced after the stop (one step late) are dropped.
    assert len(events) < len(ids)


def test_stop_string_cut_for_openai_and_never_streamed(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    params = SamplingParams(max_new_tokens=64, stop=("fox", "lazy"),
                            include_stop_str_in_output=False)
    events, stopped = run(tok, params, ids)
    final = events[-1]
    assert final.finish_reason == "stop_sequence" and stopped == [7]
    assert final.generated_text == "The quick brown "
    streamed = [e.token.text for e in events]
    assert "".join(streamed) == final.generated_text
    assert not any("f" in s for s in streamed)  # the held-back prefix of "fox" never left


def test_length_finish_without_stop_streams_everything(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    params = SamplingParams(max_new_tokens=len(ids), stop=("zebra",),
                            include_stop_str_in_output=False)
    events, stopped = run(tok, params, ids, {len(ids) - 1: "length"})
    assert stopped == [] and events[-1].finish_reason == "length"
    assert events[-1].generated_text == TEXT == "".join(e.token.text for e in events)


def test_stop_outranks_length_but_not_eos(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    n = next(i for i in range(len(ids)) if "fox" in tok.decode(ids[: i + 1]))
    events, stopped = run(tok, SamplingParams(stop=("fox",)), ids[: n + 1], {n: "length"})
    assert events[-1].finish_reason == "stop_sequence" and stopped == []  # core already done
    events, _ = run(tok, SamplingParams(stop=("fox",)), ids[: n + 1], {n: "eos_token"})
    assert events[-1].finish_reason == "eos_token"


def test_outputs_survive_packing_for_the_trip_to_the_driver():
    from tpserve.engine.outputs import pack_outputs, unpack_outputs

    outs = [TokenOutput(3, 17, -0.25, [(17, -0.25), (4, -2.0)], 5, 12, "length",
                        [(1, None, []), (9, -1.5, [(9, -1.5), (2, -3.0)])]),
            TokenOutput(8, 2, -3.0, [], 1, 300, None),
            TokenOutput(9, 1, -0.5, [], 2, 7, "eos_token")]
    assert unpack_outputs(pack_outputs(outs)) == outs
    assert unpack_outputs(pack_outputs([])) == []
