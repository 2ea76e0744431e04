"""API keys, the body limit, deadlines, numeric/Unicode validation and error bodies that leak
nothing: the real app under uvicorn over the fake backend."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from fake_backend import FakeBackend, serve

import tpserve
from tpserve.config import ServerConfig
from tpserve.errors import GenerationError, NotReadyError, UnauthorizedError, ValidationError
from tpserve.server.app import build_app

KEYS = ("first-key", "second-key")
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def secured():
    backend = FakeBackend()
    cfg = ServerConfig(api_keys=KEYS, max_body_bytes=LIMIT, request_timeout_s=0.5)
    with serve(build_app(backend, cfg)) as url:
        yield backend, url


@pytest.fixture
def backend(secured) -> FakeBackend:
    return secured[0].reset()


@pytest.fixture
def url(secured, backend) -> str:
    return secured[1]


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "content-type": "application/json"}


BODY = {"inputs": "a b", "parameters": {"max_new_tokens": 2}}


# --- API keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, auth("wrong"), {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"},
     auth(KEYS[0] + "x"), auth(KEYS[0][:-1])],
    ids=["none", "wrong", "no_scheme", "basic", "longer", "prefix"],
)
@pytest.mark.parametrize(
    "method,route",
    [("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"),
     ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
     ("GET", "/info"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"),
     ("GET", "/no/such/route")],
)
def test_routes_need_a_valid_key(url, backend, headers, method, route):
    r = httpx.request(method, url + route, headers=headers, json=BODY, timeout=10)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error_type"] == "unauthorized"
    assert backend.calls == []


def test_every_key_works_and_health_is_public(url, backend):
    assert httpx.get(url + "/health").status_code == 200
    for key in KEYS:
        r = httpx.post(url + "/generate", json=BODY, headers=auth(key))
        assert r.json() == {"generated_text": " a b"}
    assert httpx.get(url + "/openapi.json", headers=auth()).status_code == 200


def test_client_sends_the_key(url):
    assert tpserve.Client(url, api_key=KEYS[1]).generate("x", max_new_tokens=1).generated_text == " x"
    with pytest.raises(UnauthorizedError):
        tpserve.Client(url, api_key="nope").generate("x", max_new_tokens=1)


def test_metrics_public_flag():
    backend = FakeBackend()
    cfg = ServerConfig(api_keys=KEYS, metrics_public=True)
    with serve(build_app(backend, cfg)) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/info").status_code == 401


# --- body limit --------------------------------------------------------------------------


def test_declared_oversize_body_is_413_before_it_is_sent(url):
    """Only the headers go out: the 413 must come back without the body being read."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: {64 * 2**20}\r\n\r\n".encode()
        )
        reply = b""
        while not reply.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "--max-body-bytes" in reply and '"error_type": "validation"' in reply


def test_64_mib_body_is_413_and_the_server_serves_the_next_request(url, backend):
    big = b'{"inputs": "' + b"a " * (32 * 2**20) + b'"}'
    try:
        r = httpx.post(url + "/generate", content=big, headers=auth(), timeout=30)
        assert r.status_code == 413
        assert r.json()["error_type"] == "validation"
    except httpx.TransportError:
        pass  # the server may close the socket on a client still sending: that is fine too
    assert backend.calls == []
    assert httpx.post(url + "/generate", json=BODY, headers=auth()).status_code == 200


def test_chunked_body_is_counted_as_it_streams(url, backend):
    sent = 0

    def chunks():
        nonlocal sent
        yield b'{"inputs": "'
        for _ in range(64):  # 64 x 16 KiB = 1 MiB, far past the limit
            sent += 1
            yield b"a" * 16384
        yield b'"}'

    r = httpx.post(url + "/generate", content=chunks(), headers=auth(), timeout=10)
    assert r.status_code == 413, r.text
    assert r.json()["error_type"] == "validation"
    assert backend.calls == []
    assert httpx.post(url + "/generate", json=BODY, headers=auth()).status_code == 200


# --- deadlines ---------------------------------------------------------------------------


def test_request_timeout_aborts_and_answers_504(url, backend):
    backend.token_delay = 0.05
    body = {"inputs": "slow", "parameters": {"max_new_tokens": 100}}
    r = httpx.post(url + "/generate", json=body, headers=auth(), timeout=10)
    assert r.status_code == 504
    assert r.json()["error_type"] == "timeout" and "--request-timeout" in r.json()["error"]
    assert backend.aborted.wait(5)
    backend.aborted.clear()
    r = httpx.post(url + "/generate_stream", json=body, headers=auth(), timeout=10)
    assert r.status_code == 200
    last = json.loads(r.text.strip().split("\n\n")[-1].removeprefix("data:"))
    assert last["error_type"] == "timeout"
    assert backend.aborted.wait(5)


# --- numbers and text --------------------------------------------------------------------

NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e999"]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(
    "field", ["temperature", "repetition_penalty", "frequency_penalty", "top_p", "typical_p"]
)
def test_tgi_rejects_non_finite_numbers_naming_the_field(url, backend, field, value):
    body = b'{"inputs": "a", "parameters": {"%s": %s}}' % (field.encode(), value)
    r = httpx.post(url + "/generate", content=body, headers=auth())
    assert r.status_code == 422, r.text
    assert f"`parameters.{field}`" in r.json()["error"]
    assert backend.calls == []


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "frequency_penalty", "repetition_penalty", "presence_penalty"]
)
def test_openai_rejects_non_finite_numbers_naming_the_field(url, backend, field, value):
    body = b'{"prompt": "a", "%s": %s}' % (field.encode(), value)
    r = httpx.post(url + "/v1/completions", content=body, headers=auth())
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]
    assert backend.calls == []


@pytest.mark.parametrize(
    "parameters,field",
    [({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"top_k": 2**40}, "top_k"),
     ({"max_new_tokens": 10**30}, "max_new_tokens"), ({"truncate": -5}, "truncate"),
     ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"repetition_penalty": -1}, "rep")],
)
def test_out_of_range_integers_and_floats_are_422(url, backend, parameters, field):
    r = httpx.post(url + "/generate", json={"inputs": "a", "parameters": parameters},
                   headers=auth())
    assert r.status_code == 422 and field in r.json()["error"]
    assert backend.calls == []


@pytest.mark.parametrize(
    "route,body,named",
    [("/generate", {"inputs": "a", "parameters": {"seed": 2**64}}, str(2**64 - 1)),
     ("/v1/completions", {"prompt": "a", "logit_bias": {str(10**19): 1}},
      f"`logit_bias.{10**19}`")],
    ids=["seed-bound", "logit-bias-key"],
)
def test_422s_keep_the_long_numbers_they_name(url, backend, route, body, named):
    """The scrub of Ray's hex ids read a number of 16 digits or more as one: the seed's
    bound came back as "less than or equal to <id>", a logit_bias key as `logit_bias.<id>`."""
    r = httpx.post(url + route, json=body, headers=auth())
    assert r.status_code == 422 and named in r.json()["error"], r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/tokenize"])
def test_messages_naming_a_route_keep_it(url, backend, route):
    """The scrub of local paths took the server's own routes for paths: a model without a
    chat template was told to "use <path> or /generate", /tokenize's refusal of
    `add_generation_prompt: false` said a chat is counted "as <path> renders it"."""
    if route == "/tokenize":
        body = {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}
        named = "/v1/chat/completions"
    else:  # the engine's wording (tpserve/engine/async_engine.py)
        backend.raise_on_generate = ValidationError(
            "this model has no chat template; use /v1/completions or /generate with a plain "
            "prompt")
        body, named = {"prompt": "a"}, "use /v1/completions or /generate"
    r = httpx.post(url + route, json=body, headers=auth())
    assert r.status_code == 422 and named in r.json()["error"], r.text


def test_tiny_positive_temperature_passes_validation(url, backend):
    """TGI clients may send any positive temperature; the sampler must cope (see the
    poison test), so validation does not reject 5e-324."""
    body = {"inputs": "a", "parameters": {"temperature": 5e-324, "max_new_tokens": 1}}
    assert httpx.post(url + "/generate", json=body, headers=auth()).status_code == 200
    assert backend.calls[-1].params.temperature == 5e-324


@pytest.mark.parametrize(
    "route,body,field",
    [("/generate", b'{"inputs": "a\\ud800b"}', "`inputs`"),
     ("/generate", b'{"inputs": "a", "parameters": {"stop": ["\\udfff"]}}', "stop"),
     ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
     ("/v1/completions", b'{"prompt": ["\\ud800"]}', "prompt"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
      "messages.0.content"),
     ("/v1/chat/completions",
      b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
      "messages.0.content")],
)
def test_lone_surrogates_are_422_naming_the_field(url, backend, route, body, field):
    r = httpx.post(url + route, content=body, headers=auth())
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]
    assert backend.calls == []


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [b'{"inputs": "\xff\xfe", "prompt": "\xc3"}', b"[" * 50_000],
                         ids=["invalid-utf8", "deep-nesting"])
def test_undecodable_bodies_are_422_validation(url, backend, route, body):
    r = httpx.post(url + route, content=body, headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and "not valid JSON" in r.json()["error"]
    assert backend.calls == []
    ok = httpx.post(url + "/generate", json={"inputs": "a b"}, headers=auth())
    assert ok.status_code == 200


# --- error bodies ------------------------------------------------------------------------

LEAKS = re.compile(
    r"Traceback|File \"|/home/|/work/|/usr/|site-packages|\.py\b|\x1b\[|"
    r"\b\d{1,3}(\.\d{1,3}){3}\b|pid[=: ]+\d|[0-9a-f]{32}"
)

RAY_LIKE = (
    "generation failed: RayTaskError(RuntimeError): \x1b[36mray::ShardWorker.execute()\x1b[39m "
    "(pid=48213, ip=10.1.2.3, actor_id=8a1f0c2e9b7d4e5f6a7b8c9d0e1f2a3b)\n"
    "Traceback (most recent call last):\n"
    '  File "/home/user/tpserve/tpserve/cluster/shard_worker.py", line 212, in execute\n'
    "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"
)


@pytest.mark.parametrize(
    "failure",
    [RuntimeError(RAY_LIKE), GenerationError(RAY_LIKE), NotReadyError(RAY_LIKE),
     KeyError("/etc/passwd")],
    ids=["bug", "generation", "not_ready", "key"],
)
def test_error_bodies_leak_no_internals(url, backend, failure, caplog):
    backend.raise_on_generate = failure
    bodies = []
    for route, body in [("/generate", BODY), ("/generate_stream", BODY),
                        ("/v1/completions", {"prompt": "a"}),
                        ("/v1/chat/completions", {"messages": [{"role": "u", "content": "a"}]})]:
        r = httpx.post(url + route, json=body, headers=auth())
        assert r.status_code >= 500
        assert set(r.json()) == {"error", "error_type"}
        bodies.append(r.text)
    backend.raise_on_generate = None
    backend.fail_after = 1  # and mid-stream
    backend.fail_exception = failure
    bodies.append(httpx.post(url + "/generate_stream", json=BODY, headers=auth()).text)
    for text in bodies:
        assert not LEAKS.search(text), text
    ids = re.findall(r"internal error ([0-9a-f]{12})", " ".join(bodies))
    if not isinstance(failure, NotReadyError):
        assert ids
        # The id the client sees is in the server log, next to the details.
        assert any(ids[0] in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize(
    "route,content",
    [("/generate", b'{"inputs": "/etc/passwd 10.0.0.1 \\u001b[31m", "parameters": {"x": 1}}')],
)
def test_user_text_is_never_read_as_a_path(url, backend, route, content):
    r = httpx.post(url + route, content=content, headers=auth())
    assert r.status_code == 200
    assert backend.calls[-1].prompt.startswith("/etc/passwd")  # just text to the model


def test_a_trailing_slash_asks_the_same_key_as_its_route(url, backend):
    """The slash is stripped before the key check: neither a way around it nor a new wall."""
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/generate/", json=BODY).status_code == 401
        assert http.post("/generate/", json=BODY, headers=auth()).status_code == 200
        assert http.get("/health/").status_code == http.get("/health").status_code
