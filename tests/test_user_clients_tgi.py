"""TGI's streaming route as line-reading clients read it: text with Unicode line separators.

U+2028, U+2029 and U+0085 are legal raw inside a JSON string, and text models do generate
them (scraped web text); but str.splitlines() and httpx's iter_lines() end a line at each
of them, so an SSE event that carries one raw arrives cut in two."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_backend import FakeBackend, serve

from tpserve.client import AsyncClient, Client
from tpserve.engine.request import GenerationEvent, TokenInfo
from tpserve.server.app import build_app

SEPARATORS = ["a\u2028b", " c\u2029", "\x85d"]
TEXT = "".join(SEPARATORS)


class SeparatorBackend(FakeBackend):
    """Generates SEPARATORS, one token each, whatever the prompt."""

    def generate(self, prompt, params, truncate=None, add_special_tokens=True):
        async def events():
            for i, text in enumerate(SEPARATORS):
                last = i == len(SEPARATORS) - 1
                event = GenerationEvent(token=TokenInfo(10 + i, text, -0.5))
                if last:
                    event.finished, event.finish_reason = True, "length"
                    event.generated_text, event.generated_tokens = TEXT, len(SEPARATORS)
                    event.prompt_tokens = 1
                yield event

        return events()


@pytest.fixture(scope="module")
def url():
    with serve(build_app(SeparatorBackend())) as base:
        yield base


def test_stream_events_stay_one_line_each(url):
    body = {"inputs": "x", "parameters": {"max_new_tokens": 3, "details": True}}
    for route in ("/generate_stream", "/"):
        raw = httpx.post(url + route, json={**body, "stream": True}, timeout=30).text
        lines = [line for line in raw.splitlines() if line]
        assert all(line.startswith("data:") for line in lines), lines
        events = [json.loads(line[len("data:"):]) for line in lines]
        assert [e["token"]["text"] for e in events] == SEPARATORS
        assert events[-1]["generated_text"] == TEXT


def test_tpserve_client_streams_text_with_line_separators(url):
    events = list(Client(url).generate_stream("x", max_new_tokens=3))
    assert [e.token.text for e in events] == SEPARATORS
    assert events[-1].generated_text == TEXT


def test_tpserve_client_reads_raw_separators_from_a_tgi_server():
    """Real TGI (serde_json) writes U+2028 raw: the client must still read whole events."""
    tokens = [{"id": 10 + i, "text": t, "logprob": -0.5, "special": False}
              for i, t in enumerate(SEPARATORS)]
    events = [{"token": t, "top_tokens": [], "generated_text": None, "details": None}
              for t in tokens]
    events[-1].update(generated_text=TEXT, details={
        "finish_reason": "length", "generated_tokens": 3, "seed": None})
    body = "".join(f"data:{json.dumps(e, ensure_ascii=False)}\n\n" for e in events)
    assert "\u2028" in body  # raw, as TGI sends it

    def tgi(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body.encode(),
                              headers={"content-type": "text/event-stream"})

    client = Client("http://tgi.invalid")
    client._http = httpx.Client(base_url="http://tgi.invalid",
                                transport=httpx.MockTransport(tgi))
    got = list(client.generate_stream("x", max_new_tokens=3))
    assert [e.token.text for e in got] == SEPARATORS
    assert got[-1].generated_text == TEXT

    class MockedAsyncClient(AsyncClient):
        def _client_kwargs(self):
            return {**super()._client_kwargs(), "transport": httpx.MockTransport(tgi)}

    async def stream():
        return [e async for e in MockedAsyncClient("http://tgi.invalid").generate_stream("x")]

    got = asyncio.run(stream())
    assert [e.token.text for e in got] == SEPARATORS
    assert got[-1].generated_text == TEXT
