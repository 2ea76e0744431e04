"""OpenAI routes: several choices (`n`, a list of prompts) and log-probabilities, through the
real app over the fake backend, read with plain httpx and with the official `openai` client.

The fake's tokens: each prompt word in turn, " word", with log-probability -0.1 * (i + 1)
for the i-th generated token; its ranked alternatives are " alt0", " alt1", ... with the
same log-probability; a `</s>` word is the special end-of-sequence token; the prefill
(prompt log-probabilities) gives the prompt's words, None for the first and -1.0 after.
"""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1], timeout=10) as client:
        yield client


def chunks(text: str) -> list[dict]:
    payloads = [e[len("data:"):].strip() for e in text.split("\n\n") if e]
    assert payloads[-1] == "[DONE]", payloads[-1]
    return [json.loads(p) for p in payloads[:-1]]


def test_completions_take_a_list_of_prompts_with_n_choices_each(http, backend):
    r = http.post("/v1/completions", json={"prompt": ["a b", "c"], "n": 2, "max_tokens": 3,
                                           "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # choices n * p .. n * p + n - 1 belong to prompt p
    assert [c["text"] for c in body["choices"]] == [" a b a", " a b a", " c c c", " c c c"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 4
    # each prompt counted once, every choice's tokens
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    # one engine request per choice; a seeded request's choices get seed, seed + 1, ...
    assert [(c.prompt, c.params.seed) for c in backend.calls] == [
        ("a b", 7), ("a b", 8), ("c", 7), ("c", 8)]


def test_seeded_choices_wrap_at_the_largest_seed(http, backend):
    top = 2**64 - 1
    r = http.post("/v1/completions", json={"prompt": "a", "n": 2, "max_tokens": 1, "seed": top})
    assert r.status_code == 200, r.text
    assert [c.params.seed for c in backend.calls] == [top, 0]


def test_token_id_prompts_are_used_as_they_are(http, backend):
    """lm-eval's completions requests send token ids, one list or a batch of them."""
    r = http.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 2,
                                           "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert [c.prompt for c in backend.calls] == [[5, 6], [7]]
    # echo gives the prompt as text (the backend's decode of the ids)
    assert [c["text"] for c in r.json()["choices"]] == ["t5 t6 t5 t6", "t7 t7 t7"]
    one = http.post("/v1/completions", json={"prompt": [9, 9, 3], "max_tokens": 1})
    assert one.status_code == 200 and backend.calls[-1].prompt == [9, 9, 3]


def test_best_of_equal_to_n_is_accepted(http, backend):
    r = http.post("/v1/completions", json={"prompt": "a", "n": 2, "best_of": 2, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_completion_logprobs_in_the_legacy_format(http, backend):
    r = http.post("/v1/completions", json={"prompt": "x y", "max_tokens": 3, "logprobs": 2,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [" x", " y", " x"]
    assert lp["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    # the k likeliest alternatives and the chosen token, as OpenAI returns them
    assert lp["top_logprobs"][1] == pytest.approx({" alt0": -0.2, " alt1": -0.2, " y": -0.2})
    assert lp["text_offset"] == [0, 2, 4]
    assert backend.calls[-1].params.top_n_tokens == 2
    assert not backend.calls[-1].params.prompt_logprobs


def test_completion_logprobs_zero_reports_the_chosen_tokens(http, backend):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [pytest.approx({" x": -0.1}), pytest.approx({" x": -0.2})]


def test_echo_with_logprobs_puts_the_prompt_tokens_first(http, backend):
    r = http.post("/v1/completions", json={"prompt": "p q", "max_tokens": 2, "logprobs": 1,
                                           "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "p q p q"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["p", "q", " p", " q"]
    assert lp["token_logprobs"][:2] == [None, -1.0]  # the first prompt token has none
    # the first prompt token has no alternatives either; the others are ranked as generated
    # tokens are (the k likeliest and the token itself)
    assert lp["top_logprobs"][:2] == [None, {" p0": -2.0, "q": -1.0}]
    # offsets into the returned text: the generated tokens start after the prompt
    assert lp["text_offset"] == [0, 1, 3, 5]
    assert backend.calls[-1].params.prompt_logprobs


def test_no_logprobs_unless_asked(http, backend):
    body = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()
    assert body["choices"][0]["logprobs"] is None
    assert backend.calls[-1].params.top_n_tokens == 0
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).json()
    assert chat["choices"][0]["logprobs"] is None


def test_chat_logprobs_and_top_logprobs(http, backend):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hé </s>"}], "max_tokens": 9,
        "logprobs": True, "top_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == " user: hé"
    content = choice["logprobs"]["content"]
    # the end-of-sequence token is not part of the content, nor of its log-probabilities
    assert [e["token"] for e in content] == [" user:", " hé"]
    assert content[1]["logprob"] == pytest.approx(-0.2)
    assert content[1]["bytes"] == list(" hé".encode())
    assert [t["token"] for t in content[1]["top_logprobs"]] == [" alt0", " alt1"]
    assert backend.calls[-1].params.top_n_tokens == 2


def test_chat_logprobs_without_top_logprobs_ranks_nothing(http, backend):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in content] == [[], []]
    assert backend.calls[-1].params.top_n_tokens == 0


def test_streamed_choices_add_up_to_the_answer(http, backend):
    body = {"messages": [{"role": "user", "content": "u v"}], "n": 3, "max_tokens": 4,
            "temperature": 0, "logprobs": True, "stream": True,
            "stream_options": {"include_usage": True}}
    got = chunks(http.post("/v1/chat/completions", json=body).text)
    usage = got[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    texts, tokens, finishes = ["", "", ""], [[], [], []], [None] * 3
    for c in got[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        texts[i] += choice["delta"]["content"]
        # Each choice opens with a chunk naming the role, with no log-probabilities (OpenAI's).
        tokens[i] += [e["token"] for e in (choice["logprobs"] or {"content": []})["content"]]
        finishes[i] = choice["finish_reason"] or finishes[i]
    plain = http.post("/v1/chat/completions",
                      json={**body, "stream": False, "stream_options": None}).json()
    assert texts == [c["message"]["content"] for c in plain["choices"]]
    assert tokens == [[e["token"] for e in c["logprobs"]["content"]] for c in plain["choices"]]
    assert finishes == ["length"] * 3


def test_streamed_completion_logprobs_cover_every_token(http, backend):
    # " y z" is held back while it could still be the stop sequence " y z w"; its tokens'
    # log-probabilities still come, in chunks with no text yet.
    body = {"prompt": "x y z", "max_tokens": 5, "logprobs": 1, "stop": " y z w",
            "temperature": 0, "stream": True}
    got = chunks(http.post("/v1/completions", json=body).text)
    toks = [t for c in got for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    lps = [t for c in got for t in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert len(toks) == 5
    assert lps == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert "".join(c["choices"][0]["text"] for c in got) == " x y z x y"


def test_one_failing_choice_fails_the_request_and_frees_the_others(http, backend):
    backend.fail_after = 1
    r = http.post("/v1/completions", json={"prompt": "a b", "n": 2, "max_tokens": 4})
    assert r.status_code == 500
    assert r.json()["error_type"] == "generation"
    assert backend.active == 0
    backend.fail_after = None
    assert http.post("/v1/completions", json={"prompt": "a", "n": 2}).status_code == 200


def test_a_refused_choice_closes_the_ones_already_started(http, backend):
    # The second prompt is over the fake's input limit: the backend refuses its choices
    # while the first prompt's have started; the error is the request's, nothing leaks.
    r = http.post("/v1/completions", json={"prompt": ["a", "b " * 70], "n": 2})
    assert r.status_code == 422
    assert "at most 64 tokens" in r.json()["error"]
    assert backend.active == 0


def test_the_openai_client_reads_choices_and_logprobs(server, backend):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0)
    done = client.completions.create(model="fake/echo", prompt=["a b", "c"], n=2, max_tokens=2,
                                     logprobs=1, temperature=0)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.choices[2].text == " c c"
    assert done.choices[0].logprobs.tokens == [" a", " b"]
    assert done.choices[0].logprobs.token_logprobs == pytest.approx([-0.1, -0.2])
    chat = client.chat.completions.create(
        model="fake/echo", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=2,
        logprobs=True, top_logprobs=1, temperature=0)
    assert len(chat.choices) == 2
    entry = chat.choices[1].logprobs.content[0]
    assert (entry.token, entry.top_logprobs[0].token) == (" user:", " alt0")
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model="fake/echo", messages=[{"role": "user", "content": "hi"}], n=2,
            max_tokens=3, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {0: " user: hi assistant:", 1: " user: hi assistant:"}


def test_text_offsets_of_an_echoed_prompt_follow_its_text():
    """A BOS takes room in the echoed text only where the text spells it (a decoded
    token-id prompt); a prompt sent as text has none."""
    from tpserve.engine.request import TokenInfo
    from tpserve.server.openai_logprobs import CompletionLogprobs

    prompt = [TokenInfo(1, "<s>", None, True), TokenInfo(5, "bu", -1.0),
              TokenInfo(6, "ra", -2.0)]
    decoded = CompletionLogprobs(1)
    decoded.add_prompt(prompt, "<s>bura")
    decoded.add(TokenInfo(7, "!", -0.5), [])
    assert decoded.text_offset == [0, 3, 5, 7]
    as_text = CompletionLogprobs(1)
    as_text.add_prompt(prompt, "bura")
    as_text.add(TokenInfo(7, "!", -0.5), [])
    assert as_text.text_offset == [0, 0, 2, 4]


def test_alternatives_of_the_same_name_keep_one_entry_each():
    """Ids that decode alike (a byte-fallback piece and the character, or two added tokens)
    were one `top_logprobs` key, the least likely value overwriting the others, so the
    chosen token could read another id's log-probability. The chosen token keeps its name,
    then the likelier alternative; the others are named by id."""
    from tpserve.engine.request import TokenInfo
    from tpserve.server.openai_logprobs import CompletionLogprobs

    log = CompletionLogprobs(3)
    log.add(TokenInfo(7, "A", -0.5), [TokenInfo(9, "A", -0.1), TokenInfo(7, "A", -0.5),
                                      TokenInfo(8, "A", -0.7)])
    log.add(TokenInfo(4, "b", -0.2), [TokenInfo(5, "c", -0.1), TokenInfo(6, "c", -0.3)])
    assert log.tokens == ["A", "b"]
    assert log.top_logprobs == [{"token_id:9": -0.1, "A": -0.5, "token_id:8": -0.7},
                                {"c": -0.1, "token_id:6": -0.3, "b": -0.2}]
    assert log.text_offset == [0, 1]

def _settled(backend, deadline_s: float = 5.0) -> bool:
    """Every fake generation ended (the server's thread closes them just after)."""
    import time

    end = time.monotonic() + deadline_s
    while backend.active and time.monotonic() < end:
        time.sleep(0.02)
    return backend.active == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_aborts_every_choice(server, backend, stream):
    backend.token_delay = 0.02
    body = {"prompt": ["slow a", "slow b"], "n": 2, "max_tokens": 100, "stream": stream}
    if stream:
        with httpx.Client(base_url=server[1], timeout=10) as client, \
                client.stream("POST", "/v1/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data:")
    else:
        with httpx.Client(base_url=server[1], timeout=0.3) as impatient, \
                pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=body)
    assert backend.aborted.wait(5)
    assert _settled(backend), backend.active
    assert len(backend.calls) == 4


def test_stream_chunks_stay_json_with_infinite_log_probabilities():
    from tpserve.server.streaming import sse

    event = sse({"logprobs": {"token_logprobs": [float("-inf")], "x": [float("nan")]}})
    assert json.loads(event[len("data:"):]) == {"logprobs": {"token_logprobs": [None],
                                                              "x": [None]}}
    assert "Infinity" not in event and "NaN" not in event


def test_presence_penalty_and_logit_bias_reach_the_engine(http, backend):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
        "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "logit_bias": {"50": 100, "7": -3.5, "9": 0}})
    assert r.status_code == 200, r.text
    p = backend.calls[-1].params
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.25)
    assert sorted(p.logit_bias) == [(7, -3.5), (50, 100.0)]  # a zero bias is no bias
    plain = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert plain.status_code == 200
    assert backend.calls[-1].params.logit_bias == ()
    assert backend.calls[-1].params.presence_penalty is None


@pytest.mark.parametrize("extra,field", [
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"), ({"logit_bias": [1.0]}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty")])
def test_bad_biases_and_penalties_are_422_naming_the_field(http, backend, extra, field):
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, **extra})
    assert r.status_code == 422, r.text
    assert field in r.json()["error"] and r.json()["error_type"] == "validation"
    assert backend.calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_reads_our_error_text_in_its_body(server, backend, stream):
    """What an `openai` user reads of an error. The body's `error` is a string (TGI's shape,
    which text_generation and tpserve.Client read), and the SDK hands `error` over as the
    exception's `body`; `str(exc)` is only "Error code: 422" in openai 3.x, which takes the
    text from OpenAI's object form (`error.message`) alone. The same holds for a 422 of a
    streamed request (before its first chunk) and, as `APIError.body`, for an error sent
    in the stream after it started."""
    import openai

    from tpserve.errors import ValidationError

    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0)
    kw = dict(model="fake/echo", prompt="a b c", max_tokens=3, stream=stream)
    backend.raise_on_generate = ValidationError("`prompt` is not welcome here")
    with pytest.raises(openai.UnprocessableEntityError) as err:
        out = client.completions.create(**kw)
        list(out) if stream else None
    assert err.value.status_code == 422
    assert err.value.body == "`prompt` is not welcome here"
    assert err.value.response.json() == {"error": "`prompt` is not welcome here",
                                         "error_type": "validation"}
    if not stream:
        return
    backend.raise_on_generate = None
    backend.fail_after, backend.fail_exception = 1, ValidationError("too late for this")
    with pytest.raises(openai.APIError) as err:
        list(client.completions.create(**kw))
    assert err.value.body == "too late for this"
