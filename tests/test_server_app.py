"""The real FastAPI app under uvicorn, over the fake backend, driven with plain httpx."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from fake_backend import FAKE_SEED

from tpserve.errors import OverloadedError


@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1], timeout=10) as client:
        yield client


def sse_payloads(text: str) -> list:
    """Parse an SSE body, checking every event is a single `data:` line."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data:") and "\n" not in e for e in events), text
    return [e[len("data:") :].strip() for e in events]


def gen(http: httpx.Client, route: str = "/generate", **body) -> httpx.Response:
    return http.post(route, json=body)


# --- /generate -------------------------------------------------------------------------


def test_generate_with_details(http, backend):
    r = gen(http, inputs="hello big world", parameters={"max_new_tokens": 5, "details": True})
    assert r.status_code == 200
    body = r.json()
    assert body["generated_text"] == " hello big world hello big"
    details = body["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 5
    assert details["seed"] is None  # greedy
    assert details["prefill"] == []
    assert "top_tokens" not in details and "best_of_sequences" not in details
    assert [t["text"] for t in details["tokens"]] == [" hello", " big", " world", " hello", " big"]
    assert details["tokens"][0] == {
        "id": details["tokens"][3]["id"],
        "text": " hello",
        "logprob": -0.1,
        "special": False,
    }
    assert backend.calls[-1].params.greedy


def test_generate_without_details_returns_only_text(http):
    r = gen(http, inputs="one two", parameters={"max_new_tokens": 3})
    assert r.status_code == 200
    assert r.json() == {"generated_text": " one two one"}


def test_parameters_are_optional_and_default_to_20_tokens(http, backend):
    r = gen(http, inputs="a")
    assert r.json() == {"generated_text": " a" * 20}
    assert backend.calls[-1].params.max_new_tokens == 20


def test_return_full_text_prepends_prompt(http):
    r = gen(http, inputs="x y", parameters={"max_new_tokens": 2, "return_full_text": True})
    assert r.json()["generated_text"] == "x y x y"


def test_eos_and_stop_sequence_finish_reasons(http):
    eos = gen(http, inputs="a b </s>", parameters={"max_new_tokens": 10, "details": True}).json()
    assert eos["generated_text"] == " a b"
    assert eos["details"]["finish_reason"] == "eos_token"
    assert eos["details"]["tokens"][-1]["special"] is True
    stop = gen(
        http, inputs="a b c d", parameters={"max_new_tokens": 10, "stop": [" c"], "details": True}
    ).json()
    # Like TGI, the stop sequence stays in generated_text.
    assert stop["generated_text"] == " a b c"
    assert stop["details"]["finish_reason"] == "stop_sequence"


def test_sampling_knobs_turn_sampling_on(http, backend):
    r = gen(
        http,
        inputs="a b",
        parameters={
            "temperature": 0.7,
            "top_k": 5,
            "stop": ["zz"],
            "details": True,
            "max_new_tokens": 2,
        },
    )
    params = backend.calls[-1].params
    assert params.do_sample and not params.greedy
    assert (params.temperature, params.top_k, params.stop) == (0.7, 5, ("zz",))
    assert r.json()["details"]["seed"] == FAKE_SEED
    gen(http, inputs="a", parameters={"seed": 7, "do_sample": True, "max_new_tokens": 1})
    assert backend.calls[-1].params.seed == 7


def test_truncate_top_n_tokens_and_prefill(http, backend):
    r = gen(
        http,
        inputs="drop keep this",
        parameters={
            "truncate": 2,
            "top_n_tokens": 2,
            "decoder_input_details": True,
            "details": True,
            "max_new_tokens": 2,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert backend.calls[-1].truncate == 2
    assert body["generated_text"] == " keep this"
    details = body["details"]
    assert [t["text"] for t in details["prefill"]] == ["keep", "this"]
    assert details["prefill"][0]["logprob"] is None
    assert [len(alts) for alts in details["top_tokens"]] == [2, 2]


def test_decoder_input_details_alone_answers_the_details(http):
    """TGI returns `details` (the prefill lives there) when only decoder_input_details is
    set; the prefill was asked for and silently dropped."""
    r = gen(http, inputs="drop keep", parameters={"decoder_input_details": True,
                                                   "max_new_tokens": 2})
    assert r.status_code == 200, r.text
    assert [t["text"] for t in r.json()["details"]["prefill"]] == ["drop", "keep"]


# --- /generate_stream and / ------------------------------------------------------------


def test_generate_stream_events_concatenate_to_final_text(http):
    r = gen(
        http,
        "/generate_stream",
        inputs="red green </s>",
        parameters={"max_new_tokens": 10, "details": True},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(p) for p in sse_payloads(r.text)]
    assert len(events) == 3
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None
    final = events[-1]
    streamed = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert streamed == final["generated_text"] == " red green"
    # input_length: the prompt's three words (TGI's stream details carry it).
    assert final["details"] == {"finish_reason": "eos_token", "generated_tokens": 3, "seed": None,
                                "input_length": 3}


def test_stream_details_only_when_requested(http):
    r = gen(
        http,
        "/generate_stream",
        inputs="a",
        parameters={"max_new_tokens": 2, "return_full_text": True},
    )
    final = json.loads(sse_payloads(r.text)[-1])
    assert final["generated_text"] == "a a a"
    assert final["details"] is None


def test_compat_route_dispatches_on_stream(http):
    plain = gen(http, "/", inputs="p q", parameters={"max_new_tokens": 2, "details": True})
    assert plain.status_code == 200
    body = plain.json()
    assert isinstance(body, list) and body[0]["generated_text"] == " p q"
    assert body[0]["details"]["generated_tokens"] == 2
    streamed = gen(http, "/", inputs="p q", stream=True, parameters={"max_new_tokens": 2})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert json.loads(sse_payloads(streamed.text)[-1])["generated_text"] == " p q"


# --- errors ----------------------------------------------------------------------------

INVALID = {
    "bad_json": (b"{not json", "invalid JSON"),
    "missing_inputs": ({"parameters": {}}, "`inputs`"),
    "empty_inputs": ({"inputs": ""}, "`inputs`: String should have at least 1 character"),
    "temperature_0": (
        {"inputs": "a", "parameters": {"temperature": 0}},
        "`parameters.temperature`: Input should be greater than 0",
    ),
    "top_p_1.5": ({"inputs": "a", "parameters": {"top_p": 1.5}}, "`parameters.top_p`: Input"),
    "top_p_1": ({"inputs": "a", "parameters": {"top_p": 1.0}}, "`parameters.top_p`"),
    "top_k_0": ({"inputs": "a", "parameters": {"top_k": 0}}, "`parameters.top_k`"),
    "typical_p": ({"inputs": "a", "parameters": {"typical_p": 0}}, "`parameters.typical_p`"),
    "rep_penalty": (
        {"inputs": "a", "parameters": {"repetition_penalty": 0}},
        "`parameters.repetition_penalty`",
    ),
    "max_new_0": (
        {"inputs": "a", "parameters": {"max_new_tokens": 0}},
        "`parameters.max_new_tokens`",
    ),
    "max_new_str": (
        {"inputs": "a", "parameters": {"max_new_tokens": "many"}},
        "`parameters.max_new_tokens`",
    ),
    "too_many_stops": (
        {"inputs": "a", "parameters": {"stop": ["1", "2", "3", "4"]}},
        "`stop` supports up to 3",
    ),
    "best_of_2": ({"inputs": "a", "parameters": {"best_of": 2}}, "`best_of` > 1"),
    "top_n_tokens": ({"inputs": "a", "parameters": {"top_n_tokens": 4}}, "`top_n_tokens`"),
    "truncate_0": ({"inputs": "a", "parameters": {"truncate": 0}}, "`parameters.truncate`"),
    "grammar_type": (
        {"inputs": "a", "parameters": {"grammar": {"type": "xml", "value": "<a/>"}}},
        "`parameters.grammar.type`",
    ),
    "grammar_json_text": (
        {"inputs": "a", "parameters": {"grammar": {"type": "json", "value": "{not json"}}},
        "`grammar.value` is not valid JSON",
    ),
    "grammar_regex_object": (
        {"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": {"a": 1}}}},
        "`grammar.value` of a regex grammar must be a string",
    ),
    "prompt_too_long": ({"inputs": "w " * 65}, "at most 64 tokens"),  # from the backend
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_requests_get_422_with_message(http, backend, case):
    body, fragment = INVALID[case]
    if isinstance(body, bytes):
        r = http.post("/generate", content=body, headers={"content-type": "application/json"})
    else:
        r = http.post("/generate", json=body)
    assert r.status_code == 422
    payload = r.json()
    assert set(payload) == {"error", "error_type"}
    assert payload["error_type"] == "validation"
    assert fragment in payload["error"]
    if case != "prompt_too_long":
        assert backend.calls == []  # rejected before reaching the engine


def test_stream_rejects_decoder_input_details(http):
    r = gen(http, "/generate_stream", inputs="a", parameters={"decoder_input_details": True})
    assert r.status_code == 422
    assert "decoder_input_details" in r.json()["error"]


def test_overloaded_maps_to_429(http, backend):
    backend.raise_on_generate = OverloadedError("queue is full")
    for route in ("/generate", "/generate_stream"):
        r = gen(http, route, inputs="a")
        assert r.status_code == 429
        assert r.json() == {"error": "queue is full", "error_type": "overloaded"}
        assert r.headers["retry-after"] == "1"  # RFC 9110: when a retry may pass
    assert _metric(http, "tpserve_requests_inflight") == 0  # rejected requests are released


def test_unexpected_backend_error_is_500_and_server_keeps_serving(http, backend):
    backend.raise_on_generate = RuntimeError("boom")
    r = gen(http, inputs="a")
    assert r.status_code == 500
    # A bug's message may carry internals: the client gets an id that the log repeats.
    assert r.json()["error_type"] == "generation" and "boom" not in r.json()["error"]
    assert re.fullmatch(r"internal error [0-9a-f]{12}", r.json()["error"])
    backend.raise_on_generate = None
    assert gen(http, inputs="a", parameters={"max_new_tokens": 1}).json() == {
        "generated_text": " a"
    }


def test_failure_before_first_token_of_a_stream_is_an_http_error(http, backend):
    backend.fail_after = 0
    r = gen(http, "/generate_stream", inputs="a")
    assert r.status_code == 500
    assert r.json()["error_type"] == "generation"
    assert re.fullmatch(r"internal error [0-9a-f]{12}: fake engine failure", r.json()["error"])


def test_mid_stream_error_is_a_final_sse_event(http, backend):
    backend.fail_after = 2
    r = gen(http, "/generate_stream", inputs="a b c", parameters={"max_new_tokens": 10})
    assert r.status_code == 200
    events = [json.loads(p) for p in sse_payloads(r.text)]
    assert [e["token"]["text"] for e in events[:2]] == [" a", " b"]
    assert len(events) == 3 and events[2]["error_type"] == "generation"
    assert events[2]["error"].endswith(": fake engine failure")
    backend.fail_after = None
    assert gen(http, inputs="a", parameters={"max_new_tokens": 1}).status_code == 200


def test_stream_client_disconnect_closes_backend_iterator(server, http, backend):
    backend.token_delay = 0.02
    body = {"inputs": "slow", "parameters": {"max_new_tokens": 100}}
    with http.stream("POST", "/generate_stream", json=body) as r:
        first = next(r.iter_lines())
        assert first.startswith("data:")
    assert backend.aborted.wait(5), "the backend stream was not closed after disconnect"
    # The gauge is decremented just after the abort, on the server's thread.
    deadline = time.monotonic() + 5
    while _metric(http, "tpserve_requests_inflight") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metric(http, "tpserve_requests_inflight") == 0


def test_generate_client_disconnect_aborts_request(server, backend):
    backend.token_delay = 0.02
    with (
        httpx.Client(base_url=server[1], timeout=0.3) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post("/generate", json={"inputs": "slow", "parameters": {"max_new_tokens": 100}})
    assert backend.aborted.wait(5)


# --- /health, /info, /metrics ------------------------------------------------------------


def test_health_follows_backend_readiness(http, backend):
    backend.is_ready = False
    r = http.get("/health")
    assert r.status_code == 503
    assert r.json()["error_type"] == "unhealthy"
    refused = gen(http, inputs="a")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    invalid = gen(http, inputs="a", parameters={"top_k": -3})  # retrying will not help
    assert invalid.status_code == 422 and "retry-after" not in invalid.headers
    backend.is_ready = True
    assert http.get("/health").status_code == 200


def test_info(http):
    info = http.get("/info").json()
    assert info["model_id"] == "fake/echo"
    assert info["tp_size"] == 2 and info["attention_backend"] == "torch"
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (64, 128)
    assert info["max_stop_sequences"] == 3 and info["max_best_of"] == 2  # --max-best-of
    for key in (
        "model_dtype",
        "model_device_type",
        "max_concurrent_requests",
        "max_batch_total_tokens",
        "validation_workers",
        "version",
    ):
        assert key in info
    # TGI's newer fields: the sequences one request may fan out to, and who routes.
    assert info["max_client_batch_size"] == info["max_concurrent_requests"]
    assert info["router"] == "tpserve"


@pytest.mark.parametrize("path", ["/health", "/info", "/metrics", "/v1/models",
                                  "/v1/models/fake/echo"])
def test_head_is_answered_wherever_get_is(http, path):
    """HTTP requires HEAD wherever GET is served (uptime probes, `curl -I`): GET's status
    and headers, no body."""
    got, head = http.get(path), http.head(path)
    assert (head.status_code, got.status_code) == (200, 200)
    assert head.headers.get("content-type") == got.headers.get("content-type")
    assert head.content == b""


def test_head_is_counted_under_its_route(http):
    labels = '{route="/info",status="200"}'
    before = _metric(http, "tpserve_http_requests_total", labels)
    http.head("/info")
    assert _metric(http, "tpserve_http_requests_total", labels) == before + 1


def test_head_is_not_added_to_post_routes(http):
    r = http.head("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_unknown_route_and_wrong_method_say_what_to_send(http):
    missing = http.post("/v1/embeddings", json={"input": "a"})
    assert missing.status_code == 404 and missing.json()["error_type"] == "http"
    assert "no route `POST /v1/embeddings`" in missing.json()["error"]
    assert "/v1/chat/completions" in missing.json()["error"]
    wrong = http.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json() == {"error": "`/v1/chat/completions` does not take GET: send POST",
                            "error_type": "http"}
    # A route's own 404 keeps its message.
    other = http.get("/v1/models/not-this-one")
    assert other.status_code == 404 and "not-this-one" in other.json()["error"]


@pytest.mark.parametrize("route", ["/v1/chat/completions/", "/v1/chat/completions//"])
def test_a_trailing_slash_is_served_as_the_route(http, backend, route):
    """Was a 307 with an empty body: httpx, aiohttp and curl without -L do not follow it."""
    r = http.post(route, json={"messages": [{"role": "user", "content": "a"}],
                               "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    assert http.get("/info/").json() == http.get("/info").json()
    labels = '{route="/v1/chat/completions",status="200"}'
    assert _metric(http, "tpserve_http_requests_total", labels) >= 1


def test_openapi_schema_renders(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/generate", "/generate_stream", "/v1/chat/completions"} <= set(paths)


def _metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_requests_tokens_and_latency(http):
    ok = '{route="/generate",status="200"}'
    bad = '{route="/generate",status="422"}'
    before = {
        "ok": _metric(http, "tpserve_http_requests_total", ok),
        "bad": _metric(http, "tpserve_http_requests_total", bad),
        "tokens": _metric(http, "tpserve_generated_tokens_total"),
        "ttft": _metric(http, "tpserve_time_to_first_token_seconds_count"),
    }
    gen(http, inputs="a b", parameters={"max_new_tokens": 3})
    gen(http, inputs="a", parameters={"top_k": -1})
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert _metric(http, "tpserve_http_requests_total", ok) == before["ok"] + 1
    assert _metric(http, "tpserve_http_requests_total", bad) == before["bad"] + 1
    assert _metric(http, "tpserve_generated_tokens_total") == before["tokens"] + 3
    assert _metric(http, "tpserve_time_to_first_token_seconds_count") == before["ttft"] + 1
    assert _metric(http, "tpserve_http_request_duration_seconds_count", '{route="/generate"}') >= 2
    assert _metric(http, "tpserve_requests_inflight") == 0


# --- OpenAI ----------------------------------------------------------------------------


def test_openai_models(http):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake/echo"]


def test_openai_completion(http, backend):
    r = http.post("/v1/completions", json={"prompt": "a b c d", "max_tokens": 5, "stop": " c"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake/echo" and isinstance(body["created"], int)
    # OpenAI leaves the stop sequence out of the text.
    assert body["choices"] == [
        {"index": 0, "text": " a b", "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    params = backend.calls[-1].params
    assert params.do_sample and params.temperature == 1.0  # OpenAI's default


def test_openai_completion_stream_matches_non_stream(http, backend):
    body = {
        "prompt": ["x y z"],
        "max_tokens": 4,
        "stop": [" z x"],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http.post("/v1/completions", json=body)
    payloads = sse_payloads(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " x y"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert backend.calls[-1].params.greedy
    plain = http.post("/v1/completions", json={**body, "stream": False,
                                                "stream_options": None}).json()
    assert plain["choices"][0]["text"] == " x y"


def test_openai_chat(http, backend):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    r = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 3, "temperature": 0, "top_p": 0.5},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    call = backend.calls[-1]
    assert call.prompt == "system: be brief user: hi assistant:"
    assert call.add_special_tokens is False
    assert call.params.greedy and call.params.top_p is None
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " system: be brief"}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}


def test_openai_chat_without_max_tokens_fills_the_window_as_the_prompt_is_submitted(
        http, backend, monkeypatch):
    """OpenAI's chat default for max_tokens: what the context window leaves after the
    prompt, counted as it is submitted (the template already holds its special tokens, so
    none are added): a tokenizer that adds a BOS must not count it, or the answer stops one
    token short of the window."""
    asked = []

    def count(text, add_special_tokens=True):  # a Llama-like tokenizer: BOS when asked
        asked.append(add_special_tokens)
        return len(text.split()) + add_special_tokens

    monkeypatch.setattr(backend, "count_tokens", count)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "one two three"}], "temperature": 0})
    assert r.status_code == 200, r.text
    call = backend.calls[-1]
    assert asked == [False] and call.add_special_tokens is False
    window = backend.info_.max_total_tokens
    assert call.params.max_new_tokens == window - len(call.prompt.split())


def test_openai_chat_stream(http):
    body = {
        "messages": [{"role": "user", "content": "yo </s>"}],
        "max_completion_tokens": 9,
        "stream": True,
    }
    payloads = sse_payloads(http.post("/v1/chat/completions", json=body).text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == " user: yo"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


OPENAI_INVALID = {
    "n_0": ("/v1/completions", {"prompt": "a", "n": 0}, "`n`"),
    # The fake runs 4 requests at once: 2 prompts x 3 choices is more.
    "too_many_choices": ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, "6 sequences"),
    "best_of_over_limit": ("/v1/completions", {"prompt": "a", "best_of": 3},
                           "`best_of` must be <= 2"),
    "best_of_below_n": ("/v1/completions", {"prompt": "a", "best_of": 1, "n": 2},
                        "`best_of` must be >= `n`"),
    "logprobs_over_limit": ("/v1/completions", {"prompt": "a", "logprobs": 4},
                            "`logprobs` must be <= 3"),
    "echo_logprobs_stream": (
        "/v1/completions", {"prompt": "a", "logprobs": 1, "echo": True, "stream": True},
        "`echo` with `logprobs`"),
    "temperature_3": ("/v1/completions", {"prompt": "a", "temperature": 3}, "`temperature`"),
    "no_prompts": ("/v1/completions", {"prompt": []}, "`prompt`"),
    "negative_token_id": ("/v1/completions", {"prompt": [1, -2]}, "`prompt"),
    "empty_token_list": ("/v1/completions", {"prompt": [[1], []]}, "`prompt"),
    "mixed_prompt_list": ("/v1/completions", {"prompt": ["a", [1]]}, "`prompt"),
    "no_messages": ("/v1/chat/completions", {"messages": []}, "`messages`"),
    "top_logprobs_without_logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        "`top_logprobs` needs `logprobs`",
    ),
    "top_logprobs_over_limit": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 4},
        "`top_logprobs` must be <= 3",
    ),
    "stream_options_without_stream": (
        "/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}},
        "`stream_options` needs `stream: true`"),
    "chat_stream_options_with_stream_false": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "stream": False,
         "stream_options": {"include_usage": False}},
        "`stream_options` needs `stream: true`",
    ),
    "responses_stream_options_without_stream": (
        "/v1/responses", {"input": "a", "stream_options": {"include_obfuscation": False}},
        "`stream_options` needs `stream: true`",
    ),
    "chat_best_of": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "best_of": 2, "temperature": 1},
        "`best_of` ranks candidates on /v1/completions only",
    ),
    "stops": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "stop": ["1", "2", "3", "4"]},
        "`stop` supports up to 3",
    ),
}


@pytest.mark.parametrize("case", sorted(OPENAI_INVALID))
def test_openai_invalid_requests_get_422(http, backend, case):
    route, body, fragment = OPENAI_INVALID[case]
    r = http.post(route, json=body)
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation"
    assert fragment in r.json()["error"]
    assert backend.calls == []


def test_openai_chat_without_template_is_422(http, backend):
    backend.has_chat_template = False
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 422
    assert r.json() == {"error": "this model has no chat template", "error_type": "validation"}


def test_openai_mid_stream_error_then_no_done(http, backend):
    backend.fail_after = 1
    r = http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 5, "stream": True})
    payloads = sse_payloads(r.text)
    last = json.loads(payloads[-1])
    assert last["error_type"] == "generation" and last["error"].endswith("fake engine failure")
    assert "[DONE]" not in payloads


def test_server_keeps_serving_after_errors(http, backend):
    backend.raise_on_generate = RuntimeError("bad")
    assert gen(http, inputs="a").status_code == 500
    assert http.post("/generate", content=b"]").status_code == 422
    backend.raise_on_generate = None
    for _ in range(3):
        assert gen(http, inputs="ok", parameters={"max_new_tokens": 1}).status_code == 200


def test_null_parameters_mean_defaults(http, backend):
    r = http.post("/generate", json={"inputs": "one two", "parameters": None})
    assert r.status_code == 200
    assert backend.calls[-1].params.max_new_tokens == 20


@pytest.mark.parametrize("params", [
    {},
    {"details": True},
    {"details": True, "decoder_input_details": True, "top_n_tokens": 2, "seed": 7},
    {"details": True, "return_full_text": True},
])
@pytest.mark.parametrize("encoder", ["orjson", "json"])
def test_generate_body_has_the_wire_models_shape(params, encoder, monkeypatch):
    """/generate builds its body as plain data for speed: it must be exactly what the
    documented wire.Response model gives for the same values, with orjson and with the
    standard encoder it falls back to."""
    if encoder == "json":
        monkeypatch.setattr("tpserve.server.streaming.orjson", None)
    from tpserve import protocol as wire
    from tpserve.engine.request import GenerationEvent, TokenInfo
    from tpserve.server.app import TGIRoutes
    from tpserve.server.streaming import AnswerResponse

    req = wire.GenerateRequest(inputs="Hello", parameters=params)
    top = [TokenInfo(5, " a", -0.5), TokenInfo(6, " b", -1.5)]
    events = [GenerationEvent(TokenInfo(1, " x", -0.25), top_tokens=top),
              GenerationEvent(TokenInfo(2, "</s>", -0.75, special=True), top_tokens=top,
                              finished=True, generated_text=" x", finish_reason="eos_token",
                              generated_tokens=2, seed=7, prompt_tokens=1,
                              prefill=[TokenInfo(9, "Hello", None)])]
    body = json.loads(AnswerResponse(TGIRoutes.response(req, events)).body)
    assert wire.Response.model_validate(body).model_dump(mode="json") == body
    assert body["generated_text"] == ("Hello x" if params.get("return_full_text") else " x")
    if params.get("details"):
        assert [t["id"] for t in body["details"]["tokens"]] == [1, 2]
        assert ("top_tokens" in body["details"]) == bool(params.get("top_n_tokens"))
        assert len(body["details"]["prefill"]) == (1 if params.get("decoder_input_details")
                                                   else 0)
    else:
        assert "details" not in body
