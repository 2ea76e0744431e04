"""Every route answers junk with a 4xx `{"error", "error_type"}` (or a 2xx), never a 5xx, a
crash or a hang, and serves a normal request the same way afterwards.

Bodies are generated from the OpenAPI schema the app serves (tests/schema_strategies.py),
a few hundred per route, against the fake backend; hand-written cases cover what a schema
cannot express (bytes that are not JSON, wrong methods and content types).
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from fake_backend import FakeBackend, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import from_schema, hostile_json

from tpserve.config import ServerConfig
from tpserve.server.app import build_app

EXAMPLES_PER_ROUTE = 200
POST_ROUTES = ["/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions",
               "/v1/responses"]
NORMAL = {"inputs": "one two three", "parameters": {"max_new_tokens": 4, "details": True}}


@pytest.fixture(scope="module")
def app_url():
    backend = FakeBackend()
    with serve(build_app(backend, ServerConfig(max_body_bytes=256 * 1024))) as url:
        yield backend, url


@pytest.fixture(scope="module")
def http(app_url):
    with httpx.Client(base_url=app_url[1], timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def schema(http) -> dict:
    return http.get("/openapi.json").json()


@pytest.fixture(scope="module")
def baseline(http) -> dict:
    r = http.post("/generate", json=NORMAL)
    assert r.status_code == 200
    return r.json()


# (status, error_type) of every answer, printed at the end (run with -s) for reliability.md.
ANSWERS: collections.Counter = collections.Counter()


def check_answer(r: httpx.Response) -> None:
    error_type = r.json().get("error_type") if r.status_code >= 400 else None
    ANSWERS[(r.status_code, error_type)] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error", "error_type"} and body["error"], body
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for event in filter(None, r.text.split("\n\n")):
            # /v1/responses names each event on an `event:` line before its `data:` line.
            payload = event.split("\n")[-1].removeprefix("data:").strip()
            if payload != "[DONE]":
                data = json.loads(payload)
                assert "error" not in data or data["error_type"] != "generation", data
    else:
        r.json()


def body_strategy(schema: dict, route: str) -> st.SearchStrategy:
    op = schema["paths"][route]["post"]
    components = schema["components"]["schemas"]
    content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    return from_schema(content.get("schema", {}), components)


@pytest.mark.parametrize("route", POST_ROUTES)
def test_generated_bodies_never_get_5xx(http, schema, baseline, app_url, route):
    if route == "/":  # the compat route has a hand-written body; /generate's schema fits it
        strategy = body_strategy(schema, "/generate").map(
            lambda b: {**b, "stream": True} if isinstance(b, dict) and len(b) % 2 else b)
    else:
        strategy = body_strategy(schema, route)

    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def run(body):
        content = json.dumps(body, allow_nan=True)  # NaN/Infinity as Python's json writes them
        r = http.post(route, content=content, headers={"content-type": "application/json"})
        check_answer(r)

    run()
    assert _inflight(http) == 0
    assert http.post("/generate", json=NORMAL).json() == baseline


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=hostile_json, route=st.sampled_from(POST_ROUTES))
def test_arbitrary_json_never_gets_5xx(http, body, route):
    r = http.post(route, content=json.dumps(body, allow_nan=True),
                  headers={"content-type": "application/json"})
    check_answer(r)


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=300), route=st.sampled_from(POST_ROUTES))
def test_arbitrary_bytes_never_get_5xx(http, raw, route):
    check_answer(http.post(route, content=raw, headers={"content-type": "application/json"}))


def _nested(depth: int) -> bytes:
    return b'{"inputs": "a", "parameters": ' + b'{"x": ' * depth + b"1" + b"}" * depth + b"}"


HAND_WRITTEN = {
    "malformed": (b'{"inputs": "a"', "application/json"),
    "trailing_garbage": (b'{"inputs": "a"} xyz', "application/json"),
    "invalid_utf8": (b'{"inputs": "\xff\xfe\xc3("}', "application/json"),
    "utf16_bom": ('{"inputs": "a"}'.encode("utf-16"), "application/json"),
    "lone_surrogate": (b'{"inputs": "\\ud800"}', "application/json"),
    "nul_in_text": (b'{"inputs": "a\\u0000b"}', "application/json"),
    "deep_array": (b'{"inputs": ' + b"[" * 50000 + b"]" * 50000 + b"}", "application/json"),
    "deep_object": (_nested(20000), "application/json"),
    "null_body": (b"null", "application/json"),
    "list_body": (b'[{"inputs": "a"}]', "application/json"),
    "string_body": (b'"inputs"', "application/json"),
    "nulls": (b'{"inputs": null, "parameters": {"temperature": null}}', "application/json"),
    "wrong_types": (b'{"inputs": 7, "parameters": {"max_new_tokens": "x", "stop": "y"}}',
                    "application/json"),
    "huge_int": (b'{"inputs": "a", "parameters": {"max_new_tokens": 1' + b"0" * 4000 + b"}}",
                 "application/json"),
    "negative": (b'{"inputs": "a", "parameters": {"max_new_tokens": -3, "seed": -1}}',
                 "application/json"),
    "nan": (b'{"inputs": "a", "parameters": {"temperature": NaN}}', "application/json"),
    "infinity": (b'{"inputs": "a", "parameters": {"repetition_penalty": Infinity}}',
                 "application/json"),
    "thousands_of_stops": (json.dumps({"inputs": "a", "parameters": {
        "stop": [f"s{i}" for i in range(5000)]}}).encode(), "application/json"),
    "enormous_prompt": (json.dumps({"inputs": "w " * 100000}).encode(), "application/json"),
    "empty_prompt": (b'{"inputs": ""}', "application/json"),
    "unknown_fields": (b'{"inputs": "a", "zzz": 1, "parameters": {"yyy": [1]}}',
                       "application/json"),
    "form_encoded": (b"inputs=a", "application/x-www-form-urlencoded"),
    "text_plain": (b'{"inputs": "a"}', "text/plain"),
    "no_body": (b"", "application/json"),
}
# Accepted on purpose: unknown fields are ignored (as TGI does); RFC 8259 JSON may be UTF-16.
OK_CASES = {"unknown_fields", "nul_in_text", "utf16_bom"}  # JSON may be UTF-16


@pytest.mark.parametrize("case", sorted(HAND_WRITTEN))
@pytest.mark.parametrize("route", POST_ROUTES)
def test_hand_written_junk(http, baseline, case, route):
    content, ctype = HAND_WRITTEN[case]
    r = http.post(route, content=content, headers={"content-type": ctype})
    check_answer(r)
    if case not in OK_CASES or route.startswith("/v1"):
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("route", POST_ROUTES)
def test_wrong_methods_are_405(http, method, route):
    r = http.request(method, route)
    assert r.status_code == 405
    assert set(r.json()) == {"error", "error_type"}


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(path=st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                          exclude_characters="?#%"), max_size=40))
def test_unknown_paths_are_404(http, path):
    r = http.get("/" + path.lstrip("/"))
    assert r.status_code < 500
    if r.status_code >= 400:
        assert set(r.json()) == {"error", "error_type"}


def test_server_unchanged_after_the_barrage(http, baseline):
    assert http.post("/generate", json=NORMAL).json() == baseline
    assert _inflight(http) == 0
    print("FUZZ ANSWERS", sum(ANSWERS.values()), sorted(ANSWERS.items(), key=str))


def _inflight(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("tpserve_requests_inflight "):
            return float(line.split()[1])
    raise AssertionError("no tpserve_requests_inflight gauge")
