"""A hostile client against the real app over the fake backend: booleans where numbers are
expected, and a huge chat request that must not stall everyone else's requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tpserve.server.app import build_app

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "a b"}]

# JSON `true` is not a number: pydantic's lax mode read it as 1 (max_new_tokens=true ran a
# one-token generation, n=true one choice, prompt=[true] token id 1).
BOOL_CASES = {
    "tgi_max_new_tokens": ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": True}},
                           "max_new_tokens"),
    "tgi_temperature": ("/generate", {"inputs": "a", "parameters": {"temperature": True}},
                        "temperature"),
    "tgi_top_k": ("/generate", {"inputs": "a", "parameters": {"top_k": True}}, "top_k"),
    "tgi_top_p": ("/generate", {"inputs": "a", "parameters": {"top_p": False}}, "top_p"),
    "tgi_seed": ("/generate", {"inputs": "a", "parameters": {"seed": True}}, "seed"),
    "tgi_truncate": ("/generate", {"inputs": "a", "parameters": {"truncate": True}},
                     "truncate"),
    "tgi_top_n_tokens": ("/generate", {"inputs": "a", "parameters": {"top_n_tokens": True}},
                         "top_n_tokens"),
    "tgi_best_of": ("/generate", {"inputs": "a", "parameters": {"best_of": True}}, "best_of"),
    "tgi_repetition_penalty": ("/generate",
                               {"inputs": "a", "parameters": {"repetition_penalty": True}},
                               "repetition_penalty"),
    "oa_max_tokens": ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    "oa_n": ("/v1/completions", {"prompt": "a", "n": True}, "n"),
    "oa_best_of": ("/v1/completions", {"prompt": "a", "best_of": True}, "best_of"),
    "oa_logprobs": ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    "oa_temperature": ("/v1/completions", {"prompt": "a", "temperature": False},
                       "temperature"),
    "oa_seed": ("/v1/completions", {"prompt": "a", "seed": False}, "seed"),
    "oa_token_prompt": ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    "oa_logit_bias": ("/v1/completions", {"prompt": "a", "logit_bias": {"5": True}},
                      "logit_bias"),
    "chat_n": (CHAT, {"messages": MSG, "n": True}, "n"),
    "chat_max_completion_tokens": (CHAT, {"messages": MSG, "max_completion_tokens": True},
                                   "max_completion_tokens"),
    "chat_top_logprobs": (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": True},
                          "top_logprobs"),
    "chat_presence_penalty": (CHAT, {"messages": MSG, "presence_penalty": True},
                              "presence_penalty"),
}


@pytest.mark.parametrize("case", list(BOOL_CASES), ids=list(BOOL_CASES))
def test_booleans_are_not_numbers(server, backend, case):
    _, url = server
    route, body, field = BOOL_CASES[case]
    r = httpx.post(url + route, json=body, timeout=10)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"
    assert field in r.json()["error"]
    assert not backend.calls  # nothing reached the engine
    ok = httpx.post(url + "/generate", json={"inputs": "a b", "parameters": {"max_new_tokens": 2}},
                    timeout=10)
    assert ok.status_code == 200 and ok.json()["generated_text"] == " a b"


def test_numbers_still_accepted_where_booleans_were_refused(server, backend):
    _, url = server
    r = httpx.post(url + "/v1/completions", timeout=10, json={
        "prompt": [5, 6], "max_tokens": 2, "n": 1, "temperature": 0, "seed": 0,
        "logit_bias": {"5": 1}, "logprobs": 0})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/generate", timeout=10, json={"inputs": "a b", "parameters": {
        "max_new_tokens": 2, "temperature": 1, "top_k": 1, "seed": 0, "top_n_tokens": 0}})
    assert r.status_code == 200, r.text


class SlowTemplate:
    """A backend whose chat template and token count take real CPU time, as a tokenizer
    does on a 4 MB conversation (seconds), without yielding to the event loop."""

    def __init__(self, backend, seconds: float) -> None:
        self._backend, self._seconds = backend, seconds

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def apply_chat_template(self, messages):
        time.sleep(self._seconds)
        return self._backend.apply_chat_template(messages)

    def count_tokens(self, text, add_special_tokens=True):
        time.sleep(self._seconds)
        return self._backend.count_tokens(text, add_special_tokens)


@pytest.fixture(scope="module")
def slow_server():
    from fake_backend import FakeBackend, serve

    fake = FakeBackend()
    with serve(build_app(SlowTemplate(fake, 1.0))) as url:
        yield fake, url


def test_huge_chat_request_does_not_stall_other_clients(slow_server):
    """Rendering and counting a huge conversation ran on the event loop: while one 3 MB
    chat request was being templated (seconds on a real tokenizer), /health and every other
    request of the server waited."""
    fake, url = slow_server
    fake.reset()
    big = [{"role": "user", "content": "w " * 1_500_000}]
    result = {}

    def chat():
        result["r"] = httpx.post(url + CHAT, json={"messages": big}, timeout=30)

    t = threading.Thread(target=chat)
    t.start()
    time.sleep(0.3)  # the chat request is being rendered now
    latencies = []
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert result["r"].status_code == 422  # far past the fake's 64 input tokens
    assert result["r"].json()["error_type"] == "validation"
    assert latencies and max(latencies) < 0.5, latencies


# --- DNS rebinding --------------------------------------------------------------------------
# A web page on evil.example whose name is re-pointed to 127.0.0.1 becomes same-origin with
# an open server on the loopback address: the browser then sends JSON and reads the answers
# (the model, /info). Its requests carry `Host: evil.example`, which no local client sends;
# an address (127.0.0.1, 10.1.2.3) cannot be rebound, so any IP literal is served.


def _raw_get(url: str, path: str, host: bytes) -> tuple[int, bytes]:
    import socket

    addr = url.split("//")[1]
    ip, port = addr.rsplit(":", 1)
    with socket.create_connection((ip, int(port)), timeout=10) as s:
        s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host
                  + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.mark.parametrize("host", [b"evil.example", b"evil.example:8080", b"127.0.0.1.evil.example",
                                  b"localhost.evil.example", b"evil.example."])
def test_open_loopback_server_refuses_foreign_host_names(server, backend, host):
    import json

    _, url = server
    status, body = _raw_get(url, "/info", host)
    assert status == 403, body
    error = json.loads(body)
    assert error["error_type"] == "forbidden" and "Host" in error["error"]


@pytest.mark.parametrize("host", [b"127.0.0.1", b"localhost:8080", b"LOCALHOST", b"[::1]:80",
                                  b"api.localhost", b"127.0.0.2:1", b"0.0.0.0:9",
                                  b"10.1.2.3"])
def test_open_loopback_server_serves_loopback_host_names(server, backend, host):
    _, url = server
    status, body = _raw_get(url, "/info", host)
    assert status == 200, body


def test_host_names_allowed_by_environment(monkeypatch):
    from fake_backend import FakeBackend, serve

    monkeypatch.setenv("TPSERVE_ALLOWED_HOSTS", "llm.internal, other.example")
    with serve(build_app(FakeBackend())) as url:
        assert _raw_get(url, "/info", b"llm.internal:8080")[0] == 200
        assert _raw_get(url, "/info", b"evil.example")[0] == 403
    monkeypatch.setenv("TPSERVE_ALLOWED_HOSTS", "*")
    with serve(build_app(FakeBackend())) as url:
        assert _raw_get(url, "/info", b"evil.example")[0] == 200


def test_server_with_api_key_does_not_check_host():
    """A key already defeats rebinding (the page does not know it); reverse proxies that
    forward the public name keep working."""
    from fake_backend import FakeBackend, serve

    from tpserve.config import ServerConfig

    with serve(build_app(FakeBackend(), ServerConfig(api_keys=("k",)))) as url:
        assert _raw_get(url, "/health", b"public.example")[0] == 200


# --- stop sequences ---------------------------------------------------------------------
# The engine looks for the start of each stop string at the end of the text after every
# token, in time that grows with the square of the shorter of the two: a 1 MB stop string
# against 30,000 characters of output took 13 ms per token, in the step every other request
# of the batch waits for.


@pytest.mark.parametrize("route,body", [
    ("/generate", {"inputs": "a", "parameters": {"stop": ["x" * 513]}}),
    ("/generate_stream", {"inputs": "a", "parameters": {"stop": ["ok", "x" * 100_000]}}),
    ("/v1/completions", {"prompt": "a", "stop": "x" * 513}),
    (CHAT, {"messages": MSG, "stop": ["ok", "x" * 1_000_000]}),
], ids=["tgi", "tgi_stream", "completions", "chat"])
def test_stop_sequences_longer_than_512_characters_are_422(server, backend, route, body):
    _, url = server
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 422, r.text[:200]
    assert r.json()["error_type"] == "validation"
    assert "stop" in r.json()["error"] and "512" in r.json()["error"]
    assert not backend.calls


def test_stop_sequence_of_512_characters_is_accepted(server, backend):
    _, url = server
    stop = "x" * 512
    r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "stop": [stop]}, timeout=10)
    assert r.status_code == 200, r.text
    assert backend.calls[-1].params.stop == (stop,)


# --- logit_bias --------------------------------------------------------------------------
# The sampler walks every entry of every request's map in Python on every step: a 4 MB body
# holds a 300,000-entry map (the whole vocabulary of most models, so it passes the engine's
# vocabulary check), which the whole batch would wait for on each token.


def test_logit_bias_with_more_than_1024_entries_is_422(server, backend):
    _, url = server
    bias = {str(i): -1 for i in range(1025)}
    for route, body in (("/v1/completions", {"prompt": "a", "logit_bias": bias}),
                        (CHAT, {"messages": MSG, "logit_bias": bias})):
        r = httpx.post(url + route, json=body, timeout=10)
        assert r.status_code == 422, r.text[:200]
        assert "logit_bias" in r.json()["error"] and "1024" in r.json()["error"]
    assert not backend.calls


def test_logit_bias_with_1024_entries_is_accepted(server, backend):
    _, url = server
    bias = {str(i): -1 for i in range(1024)}
    r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "logit_bias": bias},
                   timeout=10)
    assert r.status_code == 200, r.text[:200]
    assert len(backend.calls[-1].params.logit_bias) == 1024


# --- token-id prompts ----------------------------------------------------------------------


class CountingDecode:
    def __init__(self, backend) -> None:
        self._backend, self.decoded = backend, 0

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def decode(self, ids):
        self.decoded += len(ids)
        return self._backend.decode(ids)


def test_over_long_token_id_prompt_is_refused_before_any_work():
    """A 4 MB body holds 1.9 million token ids; with `echo` each prompt was decoded to text
    on the event loop (0.3 s) before the engine found it too long."""
    from fake_backend import FakeBackend, serve

    fake = FakeBackend()
    counting = CountingDecode(fake)
    limit = fake.info_.max_input_tokens
    with serve(build_app(counting)) as url:
        for prompt in ([7] * (limit + 1), [[7] * 3, [7] * (limit + 1)]):
            r = httpx.post(url + "/v1/completions", timeout=10,
                           json={"prompt": prompt, "echo": True, "max_tokens": 1})
            assert r.status_code == 422, r.text
            assert r.json()["error"].startswith(f"`prompt` must have at most {limit} tokens")
        assert counting.decoded == 0 and not fake.calls
        ok = httpx.post(url + "/v1/completions", timeout=10,
                        json={"prompt": [7] * limit, "echo": True, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        assert counting.decoded == limit


# --- many invalid items ----------------------------------------------------------------------
# pydantic reports every bad item of a list (once per member of a union), and FastAPI and the
# error handler then walk those errors on the event loop: 800,000 nulls as `prompt` (4 MB) held
# the server, /health included, for 46 s and 440 MB; 200,000 take seconds. Validation now
# stops at a list's or map's first bad item.

BAD_ITEMS = 200_000
MANY_BAD = {
    "prompt_nulls": ("/v1/completions", {"prompt": [None] * BAD_ITEMS}),
    "prompt_negative_ids": ("/v1/completions", {"prompt": [-1] * BAD_ITEMS}),
    "prompt_lists_of_nulls": ("/v1/completions", {"prompt": [[None]] * BAD_ITEMS}),
    "stop_nulls": ("/generate", {"inputs": "a", "parameters": {"stop": [None] * BAD_ITEMS}}),
    "oa_stop_nulls": ("/v1/completions", {"prompt": "a", "stop": [None] * BAD_ITEMS}),
    "messages_ints": (CHAT, {"messages": [1] * BAD_ITEMS}),
    "message_parts_ints": (CHAT, {"messages": [{"role": "u", "content": [1] * BAD_ITEMS}]}),
    "logit_bias_bad_keys": ("/v1/completions",
                            {"prompt": "a", "logit_bias": {f"x{i}": "y" for i in range(BAD_ITEMS)}}),
}


@pytest.mark.parametrize("case", list(MANY_BAD), ids=list(MANY_BAD))
def test_many_invalid_items_are_422_at_once(server, backend, case):
    import json

    _, url = server
    route, body = MANY_BAD[case]
    raw = json.dumps(body, separators=(",", ":")).encode()
    t0 = time.monotonic()
    r = httpx.post(url + route, content=raw, timeout=120,
                   headers={"content-type": "application/json"})
    elapsed = time.monotonic() - t0
    assert r.status_code == 422, r.text[:200]
    assert r.json()["error_type"] == "validation" and len(r.json()["error"]) < 2000
    assert elapsed < 2.0, elapsed  # parsing the JSON itself takes ~0.1 s
    assert not backend.calls


def test_number_past_pythons_digit_limit_says_so(server, backend):
    """Python refuses to parse integers of more than 4,300 digits; the 422 said only that the
    body must be UTF-8 and not nested too deep, neither of which was wrong."""
    _, url = server
    raw = b'{"inputs": "a", "parameters": {"max_new_tokens": ' + b"9" * 5000 + b"}}"
    r = httpx.post(url + "/generate", content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "4,300 digits" in r.json()["error"]
