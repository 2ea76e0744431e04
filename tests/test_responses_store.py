"""The Responses API's store: `previous_response_id`, GET / DELETE /v1/responses/{id} and its
input_items, through the real `openai` client in its strict mode (every answer validated
against the client's types).

Oracles: a conversation continued from the store is the conversation sent whole, by the
prompt the fake engine is given (it records each prompt) and, on the embedded tiny model, by
the greedy answer and its prompt token count. Another API key's response answers as the same
id does once it is deleted (an unknown id). Bounds, the age limit (on an injected clock) and
switches are checked on the fake engine, and the store itself on its own."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_utils import served_engine
from fake_backend import FakeBackend, serve

from tpserve.config import ServerConfig
from tpserve.server.app import build_app
from tpserve.server.responses_store import ResponseStore
from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")

N = 6
KEY_A, KEY_B = "key-a", "key-b"


def _client(url: str, key: str = "unused"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def engine_url():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=512,
                       max_concurrent_requests=4, block_size=16, num_blocks=128,
                       server=ServerConfig(api_keys=(KEY_A, KEY_B))) as (_, url):
        yield url


@pytest.fixture(scope="module")
def fake():
    backend = FakeBackend()
    with serve(build_app(backend)) as url:
        yield backend, _client(url), url


def _prompt(backend: FakeBackend) -> str:
    return backend.calls[-1].prompt


# --- on the embedded model: greedy equality --------------------------------------------------

def test_two_turns_through_the_store_answer_as_the_whole_conversation(engine_url):
    oai = _client(engine_url, KEY_A)
    greedy = {"max_output_tokens": N, "temperature": 0, "model": "m"}
    r1 = oai.responses.create(input="What is Ray?", instructions="Answer briefly.", **greedy)
    assert r1.store is True and r1.previous_response_id is None
    r2 = oai.responses.create(input="And tensor parallelism?", previous_response_id=r1.id,
                              include=["message.output_text.logprobs"], **greedy)
    assert r2.previous_response_id == r1.id
    # OpenAI's rule: the earlier response's instructions are not carried over.
    whole = oai.responses.create(input=[
        {"role": "user", "content": "What is Ray?"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And tensor parallelism?"}],
        include=["message.output_text.logprobs"], **greedy)
    assert r2.output_text == whole.output_text
    assert r2.usage.input_tokens == whole.usage.input_tokens
    assert [lp.token for lp in r2.output[0].content[0].logprobs] == \
        [lp.token for lp in whole.output[0].content[0].logprobs]


def test_three_turns_chained_and_streamed_turns_are_stored(engine_url):
    oai = _client(engine_url, KEY_A)
    greedy = {"max_output_tokens": N, "temperature": 0, "model": "m"}
    questions = ["Name a city.", "Why that one?", "Thanks!"]
    prev, history = None, []
    for i, q in enumerate(questions):
        if i == 1:  # a streamed turn in the middle: stored when it ends, then continued
            events = list(oai.responses.create(input=q, previous_response_id=prev,
                                               stream=True, **greedy))
            r = events[-1].response
            assert oai.responses.retrieve(r.id) == r
        else:
            r = oai.responses.create(input=q, previous_response_id=prev, **greedy)
        history += [{"role": "user", "content": q},
                    {"role": "assistant", "content": r.output_text}]
        prev = r.id
    whole = oai.responses.create(input=history[:-1], **greedy)
    assert r.output_text == whole.output_text
    assert r.usage.input_tokens == whole.usage.input_tokens
    items = oai.responses.input_items.list(r.id, order="asc", limit=100).data
    texts = [item.content[0].text for item in items]
    assert texts == [turn["content"] for turn in history[:-1]]


def _as_key(url: str, key: str, response_id: str) -> list[tuple[int, dict]]:
    """Status and body of every use of a stored id with `key`: GET, input_items, DELETE and
    continuing it."""
    auth = {"Authorization": f"Bearer {key}"}
    got = [httpx.get(f"{url}/v1/responses/{response_id}", headers=auth),
           httpx.get(f"{url}/v1/responses/{response_id}/input_items", headers=auth),
           httpx.delete(f"{url}/v1/responses/{response_id}", headers=auth),
           httpx.post(f"{url}/v1/responses", headers=auth, timeout=60, json={
               "model": "m", "input": "x", "max_output_tokens": 1,
               "previous_response_id": response_id})]
    return [(r.status_code, r.json()) for r in got]


def test_another_keys_response_answers_as_an_unknown_id(engine_url):
    a, b = _client(engine_url, KEY_A), _client(engine_url, KEY_B)
    greedy = {"max_output_tokens": N, "temperature": 0, "model": "m"}
    r = a.responses.create(input="What is Ray?", **greedy)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(r.id)
    # An unknown previous_response_id is a 422 (OpenAI: 400), and so is another key's.
    with pytest.raises(openai.UnprocessableEntityError):
        b.responses.create(input="And then?", previous_response_id=r.id, **greedy)
    as_b = _as_key(engine_url, KEY_B, r.id)
    # Key A still has it whole: B's delete removed nothing, and A continues it.
    assert a.responses.retrieve(r.id) == r
    assert [i.content[0].text for i in a.responses.input_items.list(r.id).data] == \
        ["What is Ray?"]
    r2 = a.responses.create(input="And then?", previous_response_id=r.id, **greedy)
    assert r2.previous_response_id == r.id
    # Once A deletes it the id is unknown to everyone: B's answers are what they were.
    a.responses.delete(r.id)
    assert [status for status, _ in as_b] == [404, 404, 404, 422]
    assert _as_key(engine_url, KEY_B, r.id) == as_b
    assert _as_key(engine_url, KEY_A, r.id) == as_b


# --- on the fake engine: what is stored, and the rendered prompt -----------------------------

def test_retrieve_returns_the_created_object_and_input_items_what_was_given(fake):
    backend, oai, _ = fake
    given = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "alpha "},
                                          {"type": "input_text", "text": "beta"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "gamma"}]
    r = oai.responses.create(model="m", input=given, max_output_tokens=3,
                             metadata={"k": "v"})
    assert oai.responses.retrieve(r.id) == r
    items = oai.responses.input_items.list(r.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "function_call",
                                       "function_call_output"]
    assert items[0].role == "developer" and items[0].content[0].text == "Be brief."
    assert "".join(p.text for p in items[1].content) == "alpha beta"
    assert (items[2].call_id, items[2].name, items[3].output) == ("c1", "f", "gamma")
    assert len({i.id for i in items}) == 4
    # Newest first by default, with OpenAI's list fields.
    page = httpx.get(f"{fake[2]}/v1/responses/{r.id}/input_items?limit=3").json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [i["id"] for i in page["data"]] == [i.id for i in items[::-1][:3]]
    assert (page["first_id"], page["last_id"]) == (items[3].id, items[1].id)
    rest = httpx.get(f"{fake[2]}/v1/responses/{r.id}/input_items",
                     params={"after": page["last_id"]}).json()
    assert [i["id"] for i in rest["data"]] == [items[0].id] and rest["has_more"] is False
    # A continuation renders the conversation as it would be sent whole.
    r2 = oai.responses.create(model="m", input="delta", previous_response_id=r.id,
                              max_output_tokens=3)
    chained = _prompt(backend)
    oai.responses.create(model="m", max_output_tokens=3, input=[
        *given, *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "delta"}])
    assert _prompt(backend) == chained
    assert len(oai.responses.input_items.list(r2.id, limit=100).data) == 4 + len(r.output) + 1


def test_instructions_are_not_carried_over(fake):
    backend, oai, _ = fake
    r1 = oai.responses.create(model="m", input="one two", instructions="Speak softly.",
                              max_output_tokens=2)
    assert "Speak softly." in _prompt(backend)
    oai.responses.create(model="m", input="three", previous_response_id=r1.id,
                         instructions="Shout.", max_output_tokens=2)
    assert "Speak softly." not in _prompt(backend) and "Shout." in _prompt(backend)


def test_delete_then_retrieve_is_404_and_continuing_it_422(fake):
    _, oai, url = fake
    r = oai.responses.create(model="m", input="one two", max_output_tokens=2)
    assert httpx.delete(f"{url}/v1/responses/{r.id}").json() == \
        {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(r.id)
    assert e.value.response.json()["error_type"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list(r.id)
    # OpenAI answers 400 (previous_response_not_found): tpserve's 422 for the request.
    with pytest.raises(openai.UnprocessableEntityError) as e:
        oai.responses.create(model="m", input="x", previous_response_id=r.id)
    assert "`previous_response_id`: no stored response" in e.value.body


def test_unknown_id_and_store_false_are_404(fake):
    _, oai, url = fake
    body = httpx.get(f"{url}/v1/responses/resp_nope").json()
    assert body["error_type"] == "not_found" and "resp_nope" in body["error"]
    r = oai.responses.create(model="m", input="one two", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.UnprocessableEntityError):
        oai.responses.create(model="m", input="x", previous_response_id=r.id)


def test_queries_not_served_are_refused(fake):
    _, oai, url = fake
    r = oai.responses.create(model="m", input="one two", max_output_tokens=2)
    for query in ("stream=true", "limit=0", "limit=101", "order=up", "after=msg_x",
                  "before=msg_x"):
        path = "" if query.startswith("stream") else "/input_items"
        got = httpx.get(f"{url}/v1/responses/{r.id}{path}?{query}")
        assert got.status_code == 422, query
        assert got.json()["error_type"] == "validation"
    # The client's own spelling of `include` is taken (and changes nothing).
    assert oai.responses.retrieve(r.id, include=["message.output_text.logprobs"]) == r


def test_failed_stream_is_not_stored_and_an_incomplete_one_is():
    backend = FakeBackend(fail_after=2)
    with serve(build_app(backend)) as url:
        oai = _client(url)
        events = list(oai.responses.create(model="m", input="a b c d", stream=True))
        assert events[-1].type == "response.failed"
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(events[-1].response.id)
        backend.fail_after = None
        cut = oai.responses.create(model="m", input="a b c d", max_output_tokens=1)
        assert cut.status == "incomplete" and oai.responses.retrieve(cut.id) == cut


def test_the_least_recently_used_response_is_dropped():
    with serve(build_app(FakeBackend(), ServerConfig(responses_store_size=2))) as url:
        oai = _client(url)
        a, b = (oai.responses.create(model="m", input="x y", max_output_tokens=1)
                for _ in range(2))
        oai.responses.retrieve(a.id)  # a is now more recent than b
        c = oai.responses.create(model="m", input="x y", max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(b.id)
        assert oai.responses.retrieve(a.id) == a and oai.responses.retrieve(c.id) == c


def test_store_off():
    with serve(build_app(FakeBackend(), ServerConfig(responses_store_size=0))) as url:
        oai = _client(url)
        r = oai.responses.create(model="m", input="x y", max_output_tokens=1, store=True)
        assert r.store is False
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.retrieve(r.id)
        assert "store is off" in e.value.body  # the client's body: tpserve's `error`
        with pytest.raises(openai.UnprocessableEntityError) as e:
            oai.responses.create(model="m", input="x", previous_response_id=r.id)
        assert "store, which is off" in e.value.body


def test_store_routes_need_the_api_key():
    with serve(build_app(FakeBackend(), ServerConfig(api_keys=("k1",)))) as url:
        r = _client(url, "k1").responses.create(model="m", input="x y", max_output_tokens=1)
        for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
            got = httpx.request(method, f"{url}/v1/responses/{r.id}{path}")
            assert got.status_code == 401, (method, path)
        assert _client(url, "k1").responses.retrieve(r.id) == r


def test_without_keys_every_client_shares_one_scope():
    with serve(build_app(FakeBackend())) as url:
        r = _client(url, "one").responses.create(model="m", input="x y", max_output_tokens=1)
        assert _client(url, "another").responses.retrieve(r.id) == r


def test_an_expired_response_answers_as_an_unknown_id():
    now = [100.0]
    app = build_app(FakeBackend(), ServerConfig(responses_store_ttl_s=60))
    app.state.responses_store.clock = lambda: now[0]
    with serve(app) as url:
        oai = _client(url)
        r = oai.responses.create(model="m", input="x y", max_output_tokens=1)
        now[0] += 59.9
        assert oai.responses.retrieve(r.id) == r
        assert len(oai.responses.input_items.list(r.id).data) == 1
        now[0] += 0.1
        gone = _as_key(url, "unused", r.id)
        assert [status for status, _ in gone] == [404, 404, 404, 422]
        unknown = _as_key(url, "unused", "resp_never")
        assert json.dumps(gone).replace(r.id, "resp_never") == json.dumps(unknown)
        assert len(app.state.responses_store) == 0


# --- the store alone -------------------------------------------------------------------------

def _body(i: int, size: int = 0) -> dict:
    return {"id": f"resp_{i}", "output": [{"text": "x" * size}]}


def test_store_bounds_by_count_and_bytes():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(4):
        assert store.put(_body(i), (), 0)
    assert len(store) == 3 and store.get("resp_0") is None
    store.get("resp_1")  # now the most recent: 2 goes next
    assert store.put(_body(4, size=4_000), (), 0)
    assert store.put(_body(5, size=4_000), (), 0)
    assert [i for i in range(6) if store.get(f"resp_{i}")] == [1, 4, 5]
    assert store.put(_body(6, size=4_000), (), 0)  # over 10,000 bytes: 1, then 4 go
    assert [i for i in range(7) if store.get(f"resp_{i}")] == [5, 6]
    assert not store.put(_body(7, size=20_000), (), 0)  # alone over the bound: not kept
    assert store.delete("resp_5") and not store.delete("resp_5")
    assert store.nbytes == store.get("resp_6").nbytes > 4_000
    with pytest.raises(ValueError):
        ResponseStore(-1, 10)


def test_store_scopes_entries_by_owner():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    assert store.put(_body(0), (), 0, owner=b"a") and store.put(_body(1), (), 0, owner=b"a")
    assert store.get("resp_0", b"b") is None and store.get("resp_0") is None
    assert not store.delete("resp_0", b"b") and len(store) == 2
    # Another owner's lookup does not make it recent: resp_0 is still the first to go.
    assert store.put(_body(2), (), 0, owner=b"b")
    assert store.get("resp_0", b"a") is None
    assert store.get("resp_1", b"a").owner == b"a" and store.get("resp_2", b"b").owner == b"b"
    assert store.delete("resp_2", b"b") and store.get("resp_2", b"b") is None


def test_store_age_limit_on_its_clock():
    now = [0.0]
    store = ResponseStore(max_responses=10, max_bytes=100_000, ttl_s=10, clock=lambda: now[0])
    assert store.put(_body(0, size=1_000), (), 0)
    now[0] = 5
    assert store.put(_body(1, size=2_000), (), 0)
    one = store.get("resp_1").nbytes
    now[0] = 9.999
    assert store.get("resp_0") is not None  # read: recent, but no younger
    now[0] = 10
    assert store.get("resp_0") is None and store.get("resp_1") is not None
    # resp_1 expires at 15; its memory goes with the next put, no lookup of it needed.
    now[0] = 15
    assert store.put(_body(2), (), 0)
    assert len(store) == 1 and store.nbytes == store.get("resp_2").nbytes < one
    assert not store.delete("resp_1")
    forever = ResponseStore(max_responses=10, max_bytes=100_000, ttl_s=0, clock=lambda: now[0])
    assert forever.put(_body(0), (), 0)
    now[0] = 1e12
    assert forever.get("resp_0") is not None
    with pytest.raises(ValueError):
        ResponseStore(1, 10, ttl_s=-1)
