"""What plain HTTP tools (curl, uptime monitors) get from the app over the fake backend."""

from __future__ import annotations

import httpx


def test_health_answers_head_as_get(server, backend):
    """Uptime monitors and load balancers probe with HEAD; TGI (axum's `get`) answers it."""
    url = server[1]
    assert httpx.head(url + "/health").status_code == 200
    backend.is_ready = False
    assert httpx.head(url + "/health").status_code == httpx.get(url + "/health").status_code
    assert httpx.get(url + "/health").status_code == 503


def test_a_json_body_sent_without_a_json_content_type_says_so(server, backend):
    """`curl -d '{...}'` without -H sends application/x-www-form-urlencoded: the 422 must
    say what to change, not "Input should be a valid dictionary"."""
    url = server[1]
    for route, body in (("/generate", '{"inputs": "a b", "parameters": {}}'),
                        ("/v1/completions", '{"prompt": "a b", "max_tokens": 2}')):
        r = httpx.post(url + route, content=body,
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 422
        got = r.json()
        assert got["error_type"] == "validation"
        assert "content-type: application/json" in got["error"], got["error"]
        # The same body as JSON is served.
        assert httpx.post(url + route, content=body,
                          headers={"content-type": "application/json"}).status_code == 200


def test_a_union_field_error_says_each_thing_once(server, backend):
    """OpenAI's `prompt` is a string or one of three kinds of list: a wrong type must not
    repeat "Input should be a valid list" once per list kind."""
    r = httpx.post(server[1] + "/v1/completions", json={"prompt": 5})
    assert r.status_code == 422
    parts = r.json()["error"].split("; ")
    assert len(parts) == len(set(parts)), parts
    assert "`prompt`: Input should be a valid string" in parts


def test_tgi_optional_parameters_sent_as_null_take_their_defaults(server, backend):
    """TGI's optional parameters (Rust `Option<T>`, `return_full_text` among them) read a
    JSON null as "not given": clients that write every field send null. Each answer is the
    one the same request gets without those fields."""
    url = server[1]
    nullable = ["best_of", "frequency_penalty", "grammar", "max_new_tokens",
                "repetition_penalty", "return_full_text", "seed", "temperature", "top_k",
                "top_n_tokens", "top_p", "truncate", "typical_p", "adapter_id"]
    for route in ("/generate", "/"):
        plain = httpx.post(url + route, json={"inputs": "a b c", "parameters": {}})
        nulls = httpx.post(url + route, json={
            "inputs": "a b c", "parameters": dict.fromkeys(nullable)})
        assert nulls.status_code == 200, nulls.text
        assert nulls.json() == plain.json()
