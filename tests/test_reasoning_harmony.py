"""--reasoning-parser harmony (gpt-oss): the analysis channel is the reasoning, the final
channel the content. Oracles: literal splits of answers written as harmony writes them
(streamed in pieces of 1, 2 and 5 characters, which must add up to the whole); the engine's
text of a token sequence built here with the markers as special tokens, kept, against the
text it was built from; auto's choice against a tokenizer with harmony's tokens."""

from __future__ import annotations

import pytest
from reasoning_split import split_streamed
from tokenizers import AddedToken
from transformers import AutoTokenizer

from tpserve.engine.engine import vocab_id
from tpserve.engine.output_processor import OutputProcessor
from tpserve.engine.outputs import TokenOutput
from tpserve.engine.request import SamplingParams
from tpserve.server.reasoning import FORMATS, HARMONY, split_reasoning
from tpserve.server.reasoning_format import ReasoningFormat, ReasoningParser
from tpserve.weights import DEFAULT_MODEL_DIR

MARKERS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>")
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
# (answer, reasoning, content): the prompt ends with "<|start|>assistant" (the template's
# generation prompt), so the answer starts with a channel.
CASES = [
    (f"{ANALYSIS}User greets. Reply.<|end|>{FINAL}Hello!", "User greets. Reply.", "Hello!"),
    (f"{ANALYSIS}cut short<|end|><|start|>assi", "cut short<|end|><|start|>assi", ""),
    (f"{ANALYSIS}<|end|>{FINAL}No thinking.", "", "No thinking."),
    # Only the final channel: no reasoning block, the channel's header dropped.
    ("<|channel|>final<|message|>Hi", None, "Hi"),
    ("<|channel|>fin", None, "<|channel|>fin"),  # cut short: as written
    ("<|channel|>commentary<|message|>x", None, "<|channel|>commentary<|message|>x"),
    (f"{ANALYSIS}a <|end|> b<|end|>{FINAL}c", "a <|end|> b", "c"),
]


class _Vocab:
    """A backend's optional token_id over a tokenizer."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def token_id(self, piece: str) -> int | None:
        return vocab_id(self.tok, piece)


def _engine_text(tok, ids: list[int], keep: tuple[int, ...]) -> tuple[str, str]:
    """(generated_text, the streamed pieces joined) as the engine makes them; the last id
    ends the sequence as an eos would."""
    proc = OutputProcessor(tok, frozenset(tok.all_special_ids))
    proc.add(1, SamplingParams(max_new_tokens=64, keep_special_ids=keep))
    events = []
    for i, t in enumerate(ids):
        out = TokenOutput(1, t, -0.5, [], i + 1, 3, "eos_token" if i == len(ids) - 1 else None)
        events += [e for _, e in proc.process([out])[0]]
    return events[-1].generated_text, "".join(e.token.text for e in events
                                              if not e.token.special)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_harmony_splitter_streamed_in_pieces_equals_whole(text, reasoning, content):
    assert split_reasoning(text, HARMONY, inside=False) == (reasoning, content)
    for size in (1, 2, 5):
        assert split_streamed(text, HARMONY, False, size) == (reasoning, content), size


@pytest.fixture(scope="module")
def harmony_tok():
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tok.add_tokens([AddedToken(t, special=True) for t in MARKERS])
    return tok


def test_engine_keeps_harmonys_markers_and_the_split_reads_them(harmony_tok):
    """The markers are special tokens: kept (only those the format names) they spell the
    channels, and the split gives the analysis as reasoning; skipped, the channel names run
    into the text, which is what --reasoning-parser none returns."""
    tok = harmony_tok
    ids_of = {t: vocab_id(tok, t) for t in MARKERS}
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    ids = [ids_of["<|channel|>"], *enc("analysis"), ids_of["<|message|>"], *enc("Add 2 and 2."),
           ids_of["<|end|>"], ids_of["<|start|>"], *enc("assistant"), ids_of["<|channel|>"],
           *enc("final"), ids_of["<|message|>"], *enc("It is 4."), ids_of["<|return|>"]]
    fmt = ReasoningParser("harmony", _Vocab(tok)).format()
    text, streamed = _engine_text(tok, ids, fmt.keep_ids)
    assert text == streamed == f"{ANALYSIS}Add 2 and 2.<|end|>{FINAL}It is 4."
    assert split_reasoning(text, HARMONY, inside=False) == ("Add 2 and 2.", "It is 4.")
    plain, _ = _engine_text(tok, ids, ())
    assert plain == "analysisAdd 2 and 2.assistantfinalIt is 4."


def test_auto_reads_harmony_where_its_tokens_are_the_vocabularys(harmony_tok):
    fmt = ReasoningParser("auto", _Vocab(harmony_tok)).format()
    names = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
    assert fmt == ReasoningFormat(HARMONY, tuple(vocab_id(harmony_tok, t) for t in names))
    assert FORMATS["harmony"] is HARMONY
    # Without them (the plain tokenizer spells the markers in pieces) auto reads none.
    plain = _Vocab(AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR))
    assert ReasoningParser("auto", plain).format() is None
