"""--reasoning-parser mistral ([THINK]...[/THINK], Magistral's special tokens) and auto.

Oracles: literal splits of written answers (streamed in pieces of 1, 2 and 5 characters, which
must add up to the whole); the engine's text of a token sequence built here, tags kept, against
the text it was built from; auto's choice against tokenizers with and without the tags.
Served, through the real `openai` client, whole equal to streamed: the embedded random model
under `mistral`, its answers steered by a regex into the tags' text; and a copy of it with the
tags as two more special tokens under `auto`, its answers made of the tag tokens themselves
(logit_bias: a grammar cannot steer into them, as llguidance reads their text in a regex as
the special token, which it then refuses)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
from engine_utils import served_engine
from reasoning_split import split_streamed
from tokenizers import AddedToken
from transformers import AutoTokenizer

from tpserve.config import ServerConfig
from tpserve.engine.engine import vocab_id
from tpserve.engine.output_processor import OutputProcessor
from tpserve.engine.outputs import TokenOutput
from tpserve.engine.request import GuidedSpec, SamplingParams
from tpserve.server.reasoning import FORMATS, split_reasoning
from tpserve.server.reasoning_format import ReasoningFormat, ReasoningParser
from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")

MISTRAL = FORMATS["mistral"]
TAGS = ("[THINK]", "[/THINK]")
# (answer, whether the prompt opened the reasoning, reasoning, content)
CASES = [
    ("[THINK]\nLet me see: 2 + 2.\n[/THINK]\n\nIt is 4.", False, "Let me see: 2 + 2.",
     "It is 4."),
    ("  [THINK]a[/THINK]b", False, "a", "b"),
    ("Let me see. [/THINK]It is 4.", True, "Let me see.", "It is 4."),
    ("[THINK]cut short [/THI", False, "cut short [/THI", ""),
    ("[THINK][/THINK]No thinking.", False, "", "No thinking."),
    ("[THI", False, None, "[THI"),
    ("It is 4. [/THINK] x", False, None, "It is 4. [/THINK] x"),
    ("<think>a</think>b", False, None, "<think>a</think>b"),  # the other format's tags
    ("[THINK]a [/THINKER] b[/THINK]c [/THINK] d", False, "a [/THINKER] b", "c [/THINK] d"),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_mistral_splitter_streamed_in_pieces_equals_whole(text, inside, reasoning, content):
    assert split_reasoning(text, MISTRAL, inside) == (reasoning, content)
    for size in (1, 2, 5):
        assert split_streamed(text, MISTRAL, inside, size) == (reasoning, content), size


# --- the engine keeps special-token tags ------------------------------------------------------

def _tagged_tokenizer(path=DEFAULT_MODEL_DIR, special: bool = True):
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([AddedToken(t, special=special) for t in TAGS])
    return tok


@pytest.fixture(scope="module")
def tagged_tok():
    return _tagged_tokenizer()


def _engine_text(tok, ids: list[int], keep: tuple[int, ...]) -> tuple[str, str, list]:
    """(generated_text, the streamed pieces joined, the events) as the engine makes them."""
    proc = OutputProcessor(tok, frozenset(tok.all_special_ids))
    proc.add(1, SamplingParams(max_new_tokens=64, keep_special_ids=keep))
    events = []
    for i, t in enumerate(ids):
        out = TokenOutput(1, t, -0.5, [], i + 1, 3, "eos_token" if i == len(ids) - 1 else None)
        events += [e for _, e in proc.process([out])[0]]
    streamed = "".join(e.token.text for e in events if not e.token.special)
    return events[-1].generated_text, streamed, events


def test_engine_keeps_the_text_of_the_special_tags_a_request_names(tagged_tok):
    tok = tagged_tok
    open_id, close_id = (vocab_id(tok, t) for t in TAGS)
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    # "→" is three byte tokens: the detokenizer holds the first two back until the third.
    ids = [open_id, *enc("Let me see →"), close_id, *enc(" It is 4."), tok.eos_token_id]
    text, streamed, events = _engine_text(tok, ids, (open_id, close_id))
    assert text == streamed == "[THINK]Let me see →[/THINK] It is 4."
    assert [e.token.special for e in events] == [False] * (len(ids) - 1) + [True]
    assert split_reasoning(text, MISTRAL, inside=False) == ("Let me see →", "It is 4.")
    # Without keep_special_ids they are left out, as every other special token.
    plain, streamed, _ = _engine_text(tok, ids, ())
    assert plain == streamed == "Let me see → It is 4."
    # An id that decoding keeps anyway changes nothing.
    space = enc(" ")[0]
    assert _engine_text(tok, ids, (space,))[0] == plain
    # A tag that cuts a character short: the bytes held back go out before it, as a whole
    # decode of the stretch before the tag spells them.
    cut = enc("→")[:2]
    ids = [open_id, *cut, close_id, *enc("ok")]
    text, streamed, _ = _engine_text(tok, ids, (open_id, close_id))
    assert text == streamed == f"[THINK]{tok.decode(cut)}[/THINK]ok"


# --- auto --------------------------------------------------------------------------------------

class _Vocab:
    """A backend's optional token_id over a tokenizer."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def token_id(self, piece: str) -> int | None:
        return vocab_id(self.tok, piece)


def test_auto_reads_the_format_whose_tags_are_tokens(tagged_tok, caplog):
    caplog.set_level(logging.INFO, logger="tpserve.server.reasoning_format")
    fmt = ReasoningParser("auto", _Vocab(tagged_tok)).format()
    assert fmt.tags == MISTRAL and fmt.keep_ids == (2048, 2049)
    assert "reading mistral" in caplog.text
    think = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    think.add_tokens(["<think>", "</think>"])  # Qwen3's: added, not special
    fmt = ReasoningParser("auto", _Vocab(think)).format()
    assert fmt.tags == FORMATS["think"] and fmt.keep_ids == (2048, 2049)
    plain = _Vocab(AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR))  # spells them in pieces
    caplog.clear()
    assert ReasoningParser("auto", plain).format() is None
    assert "--reasoning-parser auto: none" in caplog.text
    assert ReasoningParser("auto", object()).format() is None  # a backend without token_id
    # A named format is read whatever the vocabulary; only tags that are tokens are kept.
    assert ReasoningParser("mistral", plain).format() == ReasoningFormat(MISTRAL, ())
    assert ReasoningParser("mistral", _Vocab(tagged_tok)).format() == \
        ReasoningFormat(MISTRAL, (2048, 2049))
    assert ReasoningParser("none", _Vocab(tagged_tok)).format() is None
    with pytest.raises(ValueError):
        ReasoningParser("magistral", plain)


# --- served ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tagged_model(tmp_path_factory):
    """The embedded model with [THINK] and [/THINK] as special tokens 2048 and 2049 (random
    embedding rows; the embeddings are tied, so the model can write them)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tagged")
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, path / f.name)
    weights = load_file(DEFAULT_MODEL_DIR / "model.safetensors")
    emb = weights["model.embed_tokens.weight"]
    rows = torch.randn(2, emb.shape[1], generator=torch.Generator().manual_seed(0))
    weights["model.embed_tokens.weight"] = torch.cat([emb, (rows * emb.float().std()).to(emb.dtype)])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 2050}))
    _tagged_tokenizer().save_pretrained(path)
    return path


def _serve(path, parser: str):
    return served_engine(path, "m", max_model_len=512, max_concurrent_requests=8,
                         block_size=16, num_blocks=128,
                         server=ServerConfig(reasoning_parser=parser))


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def served():
    """The embedded model under --reasoning-parser mistral."""
    with _serve(DEFAULT_MODEL_DIR, "mistral") as (backend, base):
        yield backend, base


@pytest.fixture(scope="module")
def oai(served):
    return _client(served[1])


@pytest.fixture(scope="module")
def tagged(tagged_model):
    """The tagged copy under --reasoning-parser auto."""
    with _serve(tagged_model, "auto") as (backend, base):
        yield backend, _client(base)


ASK = [{"role": "user", "content": "What is 2 + 2?"}]
# The tags as text: a regex steers the random model into them one character piece at a time.
THINKING = "\\[THINK\\]I add (two|2) and (two|2)\\.\\[/THINK\\]\\n\\nIt is (4|four)\\."


def _chat(oai, stream: bool, **kw) -> tuple[str | None, str | None, str]:
    """(reasoning_content, content, finish_reason), whole or joined from the stream."""
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        return choice.message.reasoning_content, choice.message.content, choice.finish_reason
    deltas, finish = [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            deltas.append(c.delta)
            finish = c.finish_reason or finish
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning or None, content or None, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_splits_the_mistral_tags(oai, stream):
    reasoning, content, finish = _chat(oai, stream, model="m", messages=ASK, max_tokens=80,
                                       seed=1, response_format={"type": "regex",
                                                                "value": THINKING})
    assert reasoning in ("I add 2 and 2.", "I add two and 2.", "I add 2 and two.",
                         "I add two and two.")
    assert content in ("It is 4.", "It is four.") and finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tags_the_model_writes_as_special_tokens_are_read(tagged, stream):
    oai = tagged[1]
    # Every token [THINK]: the first opens the reasoning, the others are its text; the
    # length limit cuts it. Decoded as other special tokens, none of it would be seen.
    kw = {"model": "m", "messages": ASK, "max_tokens": 5, "temperature": 0}
    reasoning, content, finish = _chat(oai, stream, logit_bias={"2048": 100}, **kw)
    assert (reasoning, content, finish) == ("[THINK]" * 4, None, "length")
    res = oai.chat.completions.create(logit_bias={"2048": 100}, logprobs=True, **kw)
    assert [t.token for t in res.choices[0].logprobs.content] == ["[THINK]"] * 5


def test_a_prompt_that_opens_the_reasoning_and_special_close_tags(tagged, monkeypatch):
    backend, oai = tagged
    render = backend.apply_chat_template
    monkeypatch.setattr(backend, "apply_chat_template",
                        lambda *a, **kw: render(*a, **kw) + "[THINK]")
    kw = {"model": "m", "messages": ASK, "max_tokens": 4, "temperature": 0,
          "logit_bias": {"2049": 100}}
    for stream in (False, True):
        # The first [/THINK] ends an empty reasoning; the later ones are the answer's text.
        assert _chat(oai, stream, **kw) == (None, "[/THINK]" * 3, "length")


@pytest.fixture
def steered(served, monkeypatch):
    """The Responses API takes no regex: its requests are steered into THINKING here."""
    backend, _ = served
    generate = backend.generate

    def steer(prompt, params, **kw):
        regex = GuidedSpec("regex", THINKING, "response_format")
        return generate(prompt, dataclasses.replace(params, guided=regex), **kw)

    monkeypatch.setattr(backend, "generate", steer)


def test_responses_api_reasoning_item_whole_and_streamed(oai, steered):
    ask = {"model": "m", "input": "What is 2 + 2?", "max_output_tokens": 80,
           "extra_body": {"seed": 6}}
    whole = oai.responses.create(**ask)
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    thought = whole.output[0].content[0].text
    assert thought.startswith("I add ") and whole.output_text in ("It is 4.", "It is four.")
    events = list(oai.responses.create(stream=True, **ask))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == whole.output_text
    assert events[-1].type == "response.completed" and events[-1].response.usage == whole.usage
