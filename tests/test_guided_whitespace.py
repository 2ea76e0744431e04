"""The whitespace JSON grammars allow between tokens (tpserve/engine/guided.py): one space,
or a line break and at most 32 blanks. Compact, `", "`-separated and indented JSON stay
reachable; longer runs, which a weak model emits until its budget runs out, are refused,
also under a schema carrying its own llguidance options. Checked on the grammar itself,
token by token through the embedded default model's tokenizer (byte-level BPE)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tpserve.engine.guided import GuidedVocab, grammar_text
from tpserve.engine.request import GuidedSpec
from tpserve.weights import DEFAULT_MODEL_DIR

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "integer"}},
                         "inner": {"type": "object", "properties": {"deep": {"type": "object"}}}},
          "required": ["name", "tags"]}
VALUE = {"name": "x y", "tags": [1, 2], "inner": {"deep": {"a": [True, None]}}}
# The same schema with llguidance options of its own that say nothing of whitespace.
LENIENT = {**SCHEMA, "x-guidance": {"lenient": True}}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def lltok(tok):
    return GuidedVocab.from_tokenizer(tok, None, [tok.eos_token_id]).lltokenizer()


def _accepts(tok, lltok, schema, text: str) -> bool:
    """Whether the grammar takes `text` whole, as one complete JSON document."""
    spec = GuidedSpec("json_schema", json.dumps(schema))
    m = llguidance.LLMatcher(lltok, grammar_text(spec), log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok(text, add_special_tokens=False).input_ids
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("schema", [SCHEMA, LENIENT], ids=["plain", "own-options"])
@pytest.mark.parametrize("text", [
    json.dumps(VALUE, separators=(",", ":")),
    json.dumps(VALUE),  # Python's ", " and ": "
    json.dumps(VALUE, indent=2),
    json.dumps(VALUE, indent=4),
    json.dumps(VALUE, indent="\t"),
    json.dumps(VALUE, indent=2).replace("\n", "\r\n"),
    '{ "name" : "x" , "tags" : [ ] }',
], ids=["compact", "python", "indent-2", "indent-4", "tabs", "crlf", "spaced"])
def test_compact_and_indented_json_is_reachable(tok, lltok, schema, text):
    assert _accepts(tok, lltok, schema, text)


@pytest.mark.parametrize("schema", [SCHEMA, LENIENT], ids=["plain", "own-options"])
@pytest.mark.parametrize("text", [
    '{"name":  "x", "tags": []}',  # two spaces
    '{"name": "x",\n\n"tags": []}',  # two line breaks
    '{\n' + " " * 33 + '"name": "x", "tags": []}',  # indentation past 32
    '{"name": "x", "tags": [' + " " * 200 + ']}',
    '{"name": "x", "tags": []} ',  # after the document
], ids=["two-spaces", "two-breaks", "deep-indent", "long-run", "trailing"])
def test_longer_whitespace_runs_are_refused(tok, lltok, schema, text):
    """A schema with its own `x-guidance` options got llguidance's unbounded whitespace."""
    assert not _accepts(tok, lltok, schema, text)


def test_options_that_set_the_whitespace_replace_the_bound(tok, lltok):
    compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    assert _accepts(tok, lltok, compact, json.dumps(VALUE, separators=(",", ":")))
    assert not _accepts(tok, lltok, compact, json.dumps(VALUE))
    loose = {**SCHEMA, "x-guidance": {"whitespace_pattern": "[ ]{0,40}"}}
    assert _accepts(tok, lltok, loose, '{"name":' + " " * 40 + '"x","tags":[]}')


def test_the_schema_true_is_any_json_value(tok, lltok):
    """`true` (any value) compiled to an error: llguidance takes options on objects only."""
    for text in ('[1, {"a": "b"}]', '"text"', "{}"):
        assert _accepts(tok, lltok, True, text)
    assert not _accepts(tok, lltok, True, "[1,   2]")
