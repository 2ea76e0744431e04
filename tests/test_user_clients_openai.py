"""The `openai` client against the app over a real engine (the embedded default model, tp = 1
in-process): what its users read back, held to OpenAI's documented shapes and to
transformers' tokenizer and greedy output."""

from __future__ import annotations

import re

import pytest
from engine_utils import served_engine
from tiny_models import hf_greedy
from transformers import AutoTokenizer

from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")

MODEL_ID = "tpserve/default-model"
PROMPT = "The default value of"


@pytest.fixture(scope="module")
def url():
    with served_engine(DEFAULT_MODEL_DIR, MODEL_ID, max_model_len=256, max_concurrent_requests=16,
                       block_size=16, num_blocks=256) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy():
    """transformers' greedy continuation of PROMPT: (ids, each token's own text)."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = hf_greedy(DEFAULT_MODEL_DIR, [PROMPT], 8)[0]
    return ids, [tok.decode([i]) for i in ids]


def _completion_logprobs(client, stream: bool, kw: dict
                         ) -> tuple[str, list[str], list[dict], list[int]]:
    """One choice's text, logprob tokens, top_logprobs and text offsets, whole or streamed
    (the streamed chunks joined)."""
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        lp = choice.logprobs
        return choice.text, lp.tokens, lp.top_logprobs, lp.text_offset
    text, tokens, tops, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    return text, tokens, tops, offsets


def _stop_inside(texts: list[str]) -> str:
    """A stop string that starts inside the second token and ends inside the fourth, so
    that the server holds text back while it could still be forming."""
    joined = "".join(texts)
    start = len(texts[0]) + len(texts[1]) - 1
    end = len(texts[0]) + len(texts[1]) + len(texts[2]) + 1
    return joined[start:end]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_name_the_tokens_when_a_stop_string_holds_text(
        client, greedy, stream):
    """OpenAI's `logprobs.tokens` are the generated tokens, and the chosen token appears once
    in its `top_logprobs` under the same text; a stop string in the request must not turn
    them into the pieces of text the server released."""
    ids, texts = greedy
    stop = _stop_inside(texts)
    kw = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
              stop=[stop])
    text, tokens, tops, _ = _completion_logprobs(client, stream, kw)
    assert text == "".join(texts).split(stop)[0]
    assert tokens == texts[:len(tokens)] and len(tokens) >= 4
    # Greedy: the chosen token is the likeliest, so it is the only entry of a top-1 list.
    assert tops == [{t: tops[i][t]} for i, t in enumerate(tokens)]


def test_chat_logprobs_name_the_tokens_when_a_stop_string_holds_text(client):
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "What is a list?"}],
              max_tokens=8, temperature=0, logprobs=True, top_logprobs=1)
    plain = client.chat.completions.create(**kw).choices[0]
    texts = [e.token for e in plain.logprobs.content]
    prompt = tok.apply_chat_template(kw["messages"], tokenize=False, add_generation_prompt=True)
    ids = hf_greedy(DEFAULT_MODEL_DIR, [prompt], 8)[0]
    assert texts == [tok.decode([i]) for i in ids]
    stop = _stop_inside(texts)
    held = client.chat.completions.create(stop=stop, **kw).choices[0]
    entries = held.logprobs.content
    assert held.message.content == "".join(texts).split(stop)[0]
    assert [e.token for e in entries] == texts[:len(entries)] and len(entries) >= 4
    for e in entries:
        assert e.bytes == list(e.token.encode("utf-8"))
        assert [t.token for t in e.top_logprobs] == [e.token]


def test_models_retrieve_answers_the_served_model_and_404s_others(client, url):
    """openai's `models.retrieve` (GET /v1/models/{model}; the served id has a slash)."""
    import httpx

    card = client.models.retrieve(MODEL_ID)
    assert (card.id, card.object) == (MODEL_ID, "model")
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    body = httpx.get(url + "/v1/models/gpt-4o").json()
    assert set(body) == {"error", "error_type"} and "gpt-4o" in body["error"]


@pytest.mark.parametrize("route,body,names,not_named", [
    ("/v1/completions", {"prompt": "word " * 400, "max_tokens": 3}, ["`prompt`"],
     ["`inputs`", "`truncate`"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 255}, ["`prompt`", "`max_tokens`"],
     ["`inputs`", "`max_new_tokens`"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]},
     ["`messages`"], ["`inputs`", "`truncate`"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 255},
     ["`messages`", "`max_completion_tokens`"], ["`inputs`", "`max_new_tokens`"]),
])
def test_context_errors_name_the_openai_fields(url, client, route, body, names, not_named):
    """A prompt (or prompt + max_tokens) beyond the context is a 422 with the error body,
    never a silent truncation, and its message speaks of the fields the client sent, not
    TGI's (`inputs`, `max_new_tokens`, `truncate` do not exist in OpenAI's API)."""
    import httpx

    r = httpx.post(url + route, json={"model": MODEL_ID, **body}, timeout=60)
    assert r.status_code == 422
    got = r.json()
    assert set(got) == {"error", "error_type"} and got["error_type"] == "validation"
    for name in names:
        assert name in got["error"], got["error"]
    for name in not_named:
        assert name not in got["error"], got["error"]
    # The server keeps serving.
    assert client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2).choices


def test_nullable_flags_sent_as_null_take_their_defaults(url, client):
    """OpenAI's schema has `stream` and `echo` as "boolean or null" (default false), and
    clients that write every field send null: that is a plain answer, not a 422."""
    import httpx

    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0, "stream": None, "stream_options": None})
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    cmpl = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
        "stream": None, "echo": None})
    assert cmpl.status_code == 200, cmpl.text
    plain = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2,
                                      temperature=0)
    assert cmpl.json()["choices"][0]["text"] == plain.choices[0].text
    assert client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        stream=None).object == "chat.completion"


def test_openai_seed_and_top_p_ranges_are_openais(client, greedy):
    """OpenAI's schema: `seed` is any int64 (clients send -1), `top_p` is 0 to 1 (0 keeps
    only the likeliest token, i.e. greedy). Both were 422s."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids, _ = greedy
    kw = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=8)
    assert client.completions.create(top_p=0, **kw).choices[0].text == tok.decode(ids)
    a = client.completions.create(seed=-1, n=2, **kw).choices
    b = client.completions.create(seed=-1, n=2, **kw).choices
    assert [c.text for c in a] == [c.text for c in b]
    assert client.completions.create(seed=-2**63, **kw).choices
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(seed=-2**63 - 1, **kw)


def test_stream_helper_reads_each_choice_as_it_was_sent(client, url):
    """openai's `chat.completions.stream` adds up every string of the deltas (a role sent in
    every chunk came back as "assistantassistant..."), and counts a later choice's first
    chunk's log-probabilities twice. OpenAI opens each choice with a chunk naming the role,
    `content` "" and no log-probabilities; the rest never name it. Text and tokens are
    transformers' greedy continuation."""
    import json

    import httpx

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    messages = [{"role": "user", "content": "What is a list?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_greedy(DEFAULT_MODEL_DIR, [prompt], 6)[0]
    tokens = [tok.decode([i]) for i in ids]
    kw = dict(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0, n=2,
              logprobs=True, top_logprobs=1)
    with client.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
    final = s.current_completion_snapshot
    assert [(c.index, c.message.role, c.message.content, [e.token for e in c.logprobs.content])
            for c in final.choices] == [(i, "assistant", tok.decode(ids), tokens) for i in (0, 1)]
    raw = httpx.post(url + "/v1/chat/completions", json={**kw, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in raw.text.splitlines()
              if line.startswith("data: {")]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[0]["logprobs"] is None
        assert all("role" not in c["delta"] for c in mine[1:])
        assert [e["token"] for c in mine[1:] for e in c["logprobs"]["content"]] == tokens


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_of_a_character_split_across_tokens_add_up_to_it(client, stream):
    """OpenAI's `bytes` are there so that the tokens of a character split across several
    (an emoji over four byte tokens) can be joined back: each entry's bytes are its own
    piece of the UTF-8, not those of U+FFFD, which its text alone reads."""
    from engine_utils import chat_choice

    word = "😀é中"
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert len(tok(word, add_special_tokens=False).input_ids) > len(word)  # split bytes
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"enum": [word]}}}
    try:
        choice = chat_choice(client, stream, model=MODEL_ID, response_format=fmt,
                             messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                             temperature=0, logprobs=True, top_logprobs=1)
    except openai.LengthFinishReasonError as exc:  # not reached: the enum ends the answer
        raise AssertionError(exc.completion) from None
    assert choice.message.content == f'"{word}"'
    entries = choice.logprobs.content
    assert any(e.token == "\ufffd" for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == f'"{word}"'
    # Greedy: each token's one alternative is itself, with the same bytes.
    assert [t.bytes for e in entries for t in e.top_logprobs] == [e.bytes for e in entries]


def _bytes_of_ids(tok) -> dict[int, bytes]:
    """Each id's bytes, read from the byte-level vocabulary (GPT-2's alphabet: bytes that
    print stand for themselves, the others for U+0100 onwards in order)."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in shown}
    alphabet.update({chr(0x100 + i): b for i, b in
                     enumerate(b for b in range(256) if b not in shown)})
    return {i: bytes(alphabet[ch] for ch in piece)
            for piece, i in tok.get_vocab().items() if all(ch in alphabet for ch in piece)}


def _legacy_name(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _unescaped(name: str) -> bytes:
    """A legacy token name's bytes: its `\\xNN` escapes as the bytes they name."""
    parts = re.split(r"\\x([0-9a-f]{2})", name)
    return b"".join(bytes.fromhex(p) if i % 2 else p.encode("utf-8")
                    for i, p in enumerate(parts))


def _offsets(pieces: list[bytes]) -> list[int]:
    """Where each token starts in the text: the characters its bytes before complete."""
    return [len(b"".join(pieces[:i]).decode("utf-8", "ignore")) for i in range(len(pieces))]


def test_echoed_logprobs_name_pieces_of_a_character_by_their_bytes(client):
    """The legacy format has no `bytes`: tokens that hold part of a character all read
    U+FFFD, so `tokens` lost them, `text_offset` counted a character per piece (past the
    text's end), and the alternatives of one position that were such pieces overwrote each
    other in the `top_logprobs` dict. They are named by their bytes ("\\xe4\\xb8"), as
    OpenAI names them; checked against transformers' log-softmax of the prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, k = "naïve 中文字", 5
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    raw = _bytes_of_ids(tok)
    ids = tok(prompt).input_ids
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1]
    top = logp.topk(k, -1)
    pieces = [raw[i] for i in ids]
    # Two alternatives of one position are pieces of characters: one key each now.
    assert max(sum("\ufffd" == tok.decode([a]) for a in row)
               for row in top.indices.tolist()) >= 2

    lp = client.completions.create(model=MODEL_ID, prompt=prompt, echo=True, logprobs=k,
                                   max_tokens=1, temperature=0).choices[0].logprobs
    n = len(ids)
    assert lp.tokens[:n] == [_legacy_name(p) for p in pieces]
    assert b"".join(_unescaped(t) for t in lp.tokens[:n]) == prompt.encode("utf-8")
    assert lp.text_offset[:n] == _offsets(pieces)
    assert lp.text_offset[n] == len(prompt)  # the generated token starts after the prompt
    for i in range(1, n):
        want = {_legacy_name(raw[a]): v for a, v in
                zip(top.indices[i - 1].tolist(), top.values[i - 1].tolist(), strict=True)}
        want.setdefault(lp.tokens[i], logp[i - 1, ids[i]].item())
        got = lp.top_logprobs[i]
        assert list(got) == list(want)
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_generated_logprobs_name_pieces_of_a_character_by_their_bytes(client, stream):
    """A generated character split across tokens (a grammar forces it): each token is named
    by its own bytes, the names join back to the text, and each offset is where its
    character starts (streamed chunks continue the count)."""
    word = "😀é中"
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    raw = _bytes_of_ids(tok)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"enum": [word]}}}
    kw = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2,
              extra_body={"response_format": fmt})
    text, tokens, tops, offsets = _completion_logprobs(client, stream, kw)
    assert text == f'"{word}"'
    pieces = [_unescaped(t) for t in tokens]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any("\\x" in t for t in tokens) and all("\ufffd" not in t for t in tokens)
    assert set(pieces) <= set(raw.values())
    assert offsets == _offsets(pieces)
    for t, alts in zip(tokens, tops, strict=True):
        assert t in alts and all("\ufffd" not in a for a in alts)


def test_max_tokens_0_with_echo_returns_the_prompt_and_its_logprobs(client, url):
    """OpenAI's scoring request (lm-eval's loglikelihood sends it): `max_tokens: 0` with
    `echo` answers the prompt, with its log-probabilities (transformers' log-softmax), and
    generates nothing. It was a 422 (`max_tokens` >= 1)."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = tok(PROMPT).input_ids
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1]
    want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    def counted(name):  # the served /metrics counter
        found = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    sent, prompts = counted("tpserve_generated_tokens_total"), counted("tpserve_prompt_tokens_total")
    c = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=1, n=2, temperature=1.0, seed=3)
    # The engine's one token per choice is dropped, so the tokens-sent counter stays put.
    assert counted("tpserve_generated_tokens_total") == sent
    assert counted("tpserve_prompt_tokens_total") == prompts + 2 * len(ids)
    assert [(ch.text, ch.finish_reason) for ch in c.choices] == [(PROMPT, "length")] * 2
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ids), 0)
    lp = c.choices[0].logprobs
    assert lp.tokens == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]

    chunks = list(client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=0, echo=True, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == PROMPT
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0

    # Without `echo` there is nothing to answer: a 422 that says what 0 is for.
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation" and "`echo`" in r.json()["error"]
    assert httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL_ID, "prompt": PROMPT, "max_tokens": -1, "echo": True}).status_code == 422
