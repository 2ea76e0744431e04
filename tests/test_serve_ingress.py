"""The Serve ingress (today's app over ReplicaSetBackend) against fake replicas: every route
answers as the direct server does, a replica that cannot serve is skipped, /info lists the
replicas and /metrics carries per-replica gauges. No Ray needed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_backend import FakeBackend, serve
from serve_fakes import FakeHandle, FakeReplica

from tpserve.engine.request import SamplingParams
from tpserve.errors import NotReadyError
from tpserve.serve import ingress as ingress_module
from tpserve.serve.ingress import ReplicaSetBackend
from tpserve.server.app import build_app


class WordTokenizer:
    chat_template = "fake"

    def __call__(self, text):
        return type("Enc", (), {"input_ids": text.split()})()

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        return FakeBackend().apply_chat_template(messages, tools)


def make_backend(n: int = 2) -> tuple[ReplicaSetBackend, FakeHandle]:
    handle = FakeHandle([FakeReplica(f"r{i}") for i in range(n)])
    backend = ReplicaSetBackend(handle, WordTokenizer(), replicas=n)
    asyncio.run(backend.refresh_info())
    asyncio.run(backend.refresh_replicas())
    return backend, handle


@pytest.fixture(scope="module")
def urls():
    backend, handle = make_backend()
    with serve(build_app(backend)) as ingress, serve(build_app(FakeBackend())) as direct:
        yield ingress, direct, backend, handle


REQUESTS = [
    ("/generate", {"inputs": "a b c", "parameters": {"max_new_tokens": 5, "details": True}}),
    ("/generate", {"inputs": "x y </s>", "parameters": {"max_new_tokens": 9}}),
    ("/", {"inputs": "a b", "parameters": {"max_new_tokens": 3}}),
    ("/generate", {"inputs": "a b c", "parameters": {"max_new_tokens": 3, "best_of": 2,
                                                     "do_sample": True, "details": True}}),
    ("/", {"inputs": "a b", "parameters": {"max_new_tokens": 3, "best_of": 2,
                                           "temperature": 0.7}}),
    ("/generate_stream", {"inputs": "a b c", "parameters": {"max_new_tokens": 4,
                                                            "details": True}}),
    ("/v1/completions", {"model": "m", "prompt": "p q r", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 3,
                              "messages": [{"role": "user", "content": "hi there"}]}),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 3, "stream": True,
                              "messages": [{"role": "user", "content": "hi there"}]}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 3, "input": "hi there"}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 3, "stream": True,
                       "input": [{"role": "user", "content": "hi there"}]}),
    ("/generate", {"inputs": "w " * 100, "parameters": {"max_new_tokens": 2}}),  # too long
]


def comparable(r: httpx.Response):
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        # /v1/responses names each event on an `event:` line before its `data:` line.
        data = [e.split("\n")[-1] for e in r.text.split("\n\n")]
        body = [json.loads(d[5:]) for d in data if d.startswith("data:")
                and d[5:].strip() != "[DONE]"]
    else:
        body = r.json()
    # OpenAI ids and timestamps differ per request, and so do best_of's drawn seeds.
    drop = {"id", "created", "system_fingerprint", "created_at", "completed_at", "item_id",
            "call_id", "seed"}
    strip = lambda x: ({k: strip(v) for k, v in x.items() if k not in drop}  # noqa: E731
                       if isinstance(x, dict) else [strip(v) for v in x]
                       if isinstance(x, list) else x)
    return r.status_code, strip(body)


@pytest.mark.parametrize("route,body", REQUESTS)
def test_every_route_answers_as_the_direct_server(urls, route, body):
    ingress, direct, _, _ = urls
    a = httpx.post(ingress + route, json=body, timeout=10)
    b = httpx.post(direct + route, json=body, timeout=10)
    assert comparable(a) == comparable(b)


def test_best_of_candidates_are_replica_requests_of_their_own(urls):
    ingress, _, _, handle = urls
    opened = len(handle.streams)
    r = httpx.post(ingress + "/generate", timeout=10, json={"inputs": "a b", "parameters": {
        "best_of": 2, "do_sample": True, "max_new_tokens": 2, "details": True}})
    assert r.status_code == 200
    details = r.json()["details"]
    [other] = details["best_of_sequences"]
    assert other["seed"] != details["seed"]  # each candidate sampled with its own seed
    assert len(handle.streams) - opened == 2
    assert httpx.get(ingress + "/info").json()["max_best_of"] == 2


def test_requests_spread_over_replicas_and_info_lists_them(urls):
    ingress, _, backend, handle = urls
    before = [r.served for r in handle.replicas]
    for _ in range(4):
        assert httpx.post(ingress + "/generate", json={"inputs": "a b"}).status_code == 200
    assert [r.served - b for r, b in zip(handle.replicas, before)] == [2, 2]
    asyncio.run(backend.refresh_replicas())
    info = httpx.get(ingress + "/info").json()
    assert info["num_replicas"] == 2 and info["tp_size"] == 2
    assert [(r["replica_id"], r["state"]) for r in info["replicas"]] == [("r0", "ready"),
                                                                        ("r1", "ready")]
    assert info["replicas"][0]["shards"] == ["tpserve-r0-shard-0", "tpserve-r0-shard-1"]
    metrics = httpx.get(ingress + "/metrics").text
    assert 'tpserve_replica{replica="r1",stat="kv_blocks_free"} 10.0' in metrics
    assert 'tpserve_engine{stat="replicas"} 2.0' in metrics


def test_replica_that_cannot_serve_is_skipped_before_the_first_token(monkeypatch):
    monkeypatch.setattr(ingress_module, "RETRY_WAIT_S", 0.0)
    backend, handle = make_backend(2)
    handle.replicas[0].dead = True
    with serve(build_app(backend)) as url:
        for _ in range(3):
            r = httpx.post(url + "/generate", json={"inputs": "a b"}, timeout=10)
            assert r.status_code == 200, r.text
        asyncio.run(backend.refresh_replicas())
        states = [r["state"] for r in httpx.get(url + "/info").json()["replicas"]]
        assert states[0].startswith("failed") and states[1] == "ready"
        assert backend.ready()
        handle.replicas[1].dead = True  # none left: unhealthy, requests refused with 503
        asyncio.run(backend.refresh_replicas())
        assert not backend.ready()
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/generate", json={"inputs": "a b"}, timeout=30)
        assert r.status_code == 503


def test_retries_give_up_with_the_replicas_error(monkeypatch):
    monkeypatch.setattr(ingress_module, "RETRY_WAIT_S", 0.0)
    backend, handle = make_backend(2)
    for r in handle.replicas:
        r.dead = True

    async def ask():
        return [e async for e in backend.generate("a b", SamplingParams(max_new_tokens=2))]

    with pytest.raises(NotReadyError, match="shard actor died"):
        asyncio.run(ask())
    assert len(handle.streams) == 1 + ingress_module.RETRIES


def test_validation_error_keeps_its_status_and_is_not_retried():
    backend, handle = make_backend(2)
    with serve(build_app(backend)) as url:
        r = httpx.post(url + "/generate", json={"inputs": "w " * 100}, timeout=10)
    assert r.status_code == 422 and "at most 64 tokens" in r.json()["error"]
    assert sum(r.served for r in handle.replicas) == 1


def test_closing_a_stream_early_cancels_it_on_the_replica():
    backend, handle = make_backend(1)

    async def first_then_close():
        stream = backend.generate("a b c", SamplingParams(max_new_tokens=10))
        await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0)

    asyncio.run(first_then_close())
    assert handle.streams[-1].cancelled
    assert handle.replicas[0].backend.aborted.is_set()


def test_finished_stream_is_not_cancelled():
    backend, handle = make_backend(1)

    async def whole():
        return [e async for e in backend.generate("a b", SamplingParams(max_new_tokens=3))]

    assert asyncio.run(whole())[-1].finished
    assert not handle.streams[-1].cancelled


def bare_replica(fake: FakeBackend):
    """A TPReplica around a fake engine, without Serve (its constructor needs a replica
    context); generate() only uses the backend."""
    from tpserve.serve.replica import TPReplica

    replica = object.__new__(TPReplica)
    replica.backend, replica.tokens_out = fake, 0
    return replica


def test_replica_sends_every_ready_event_in_one_message():
    fake = FakeBackend()
    replica = bare_replica(fake)
    params = SamplingParams(max_new_tokens=6)

    async def collect(gen):
        return [item async for item in gen]

    batches = asyncio.run(collect(replica.generate("a b c", params)))
    direct = asyncio.run(collect(FakeBackend().generate("a b c", params)))
    flat = [e for b in batches for e in b]
    assert [e.token for e in flat] == [e.token for e in direct]
    assert flat[-1].finished and flat[-1].generated_text == direct[-1].generated_text
    assert len(batches) < len(flat)  # the fake produces faster than it is read: coalesced
    assert replica.tokens_out == 6


def test_replica_stream_closed_early_aborts_and_errors_pass_through():
    fake = FakeBackend(token_delay=0.01)
    replica = bare_replica(fake)

    async def first_then_close():
        gen = replica.generate("a b c", SamplingParams(max_new_tokens=50))
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(first_then_close())
    assert fake.aborted.is_set()
    fake.reset().fail_after = 2

    async def until_failure():
        return [b async for b in replica.generate("a b", SamplingParams(max_new_tokens=5))]

    with pytest.raises(Exception, match="fake engine failure"):
        asyncio.run(until_failure())
