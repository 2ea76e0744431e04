"""A loopback soak: many concurrent streaming and non-streaming clients over the TGI and
OpenAI routes, a share of which vanish mid-stream or give up early. Every request is
classified into exactly one terminal outcome; used by the fast (fake backend) and the slow
(real engine) soak tests."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class SoakReport:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    requests: int = 0
    slowest_s: float = 0.0

    def add(self, outcome: str, seconds: float) -> None:
        self.outcomes[outcome] += 1
        self.requests += 1
        self.slowest_s = max(self.slowest_s, seconds)


KINDS = ("tgi", "tgi_stream", "openai", "openai_stream", "chat_stream")


def _request(rng: random.Random, prompt: str, max_new: int,
             kinds: tuple[str, ...] = KINDS) -> tuple[str, dict, bool]:
    kind = rng.choice(kinds)
    sampling = rng.random() < 0.5
    if kind.startswith("tgi"):
        params = {"max_new_tokens": max_new, "details": True}
        if sampling:
            params.update(do_sample=True, temperature=0.8, top_k=20, seed=rng.randrange(1000))
        route = "/generate_stream" if kind == "tgi_stream" else "/generate"
        return route, {"inputs": prompt, "parameters": params}, kind == "tgi_stream"
    body = {"max_tokens": max_new, "temperature": 0.8 if sampling else 0.0,
            "stream": kind.endswith("stream")}
    if kind == "chat_stream":
        return "/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": prompt}]}, True
    return "/v1/completions", {**body, "prompt": prompt}, body["stream"]


async def _one(client: httpx.AsyncClient, rng: random.Random, prompt: str, max_new: int,
               vanish: float, deadline_s: float, report: SoakReport,
               kinds: tuple[str, ...]) -> None:
    route, body, stream = _request(rng, prompt, max_new, kinds)
    start = time.monotonic()
    outcome = "unknown"
    try:
        async with asyncio.timeout(deadline_s):
            if stream:
                outcome = await _stream(client, route, body, rng.random() < vanish)
            elif rng.random() < vanish / 2:
                # Gives up before the answer: the server must abort the request.
                try:
                    await client.post(route, json=body, timeout=0.05)
                    outcome = "completed"
                except httpx.TimeoutException:
                    outcome = "gave_up"
            else:
                r = await client.post(route, json=body)
                outcome = "completed" if r.status_code == 200 else f"http_{r.status_code}"
    except TimeoutError:
        outcome = "hung"  # past the client's deadline: a failure
    except httpx.TransportError as exc:
        outcome = f"transport_{type(exc).__name__}"
    report.add(outcome, time.monotonic() - start)


async def _stream(client: httpx.AsyncClient, route: str, body: dict, vanish: bool) -> str:
    async with client.stream("POST", route, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"http_{r.status_code}"
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return "completed"
            data = json.loads(payload)
            if "error" in data:
                return f"error_{data['error_type']}"
            events += 1
            if vanish and events >= 1:
                return "vanished"  # leaving the block closes the connection mid-stream
            if data.get("generated_text") is not None:  # TGI's final event
                return "completed"
        return "truncated"


async def soak(url: str, rounds: int, clients: int, prompts: list[str], max_new: int,
               vanish: float = 0.3, deadline_s: float = 60.0, seed: int = 0,
               headers: dict | None = None, kinds: tuple[str, ...] = KINDS) -> SoakReport:
    """`rounds` waves of `clients` concurrent requests; returns the outcome counts.
    `kinds`: which of KINDS to mix (chat needs a model with a chat template)."""
    rng = random.Random(seed)
    report = SoakReport()
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=deadline_s, limits=limits,
                                 headers=headers) as client:
        for _ in range(rounds):
            await asyncio.gather(*(
                _one(client, random.Random(rng.random()), rng.choice(prompts), max_new, vanish,
                     deadline_s, report, kinds) for _ in range(clients)))
    return report


async def all_succeed(url: str, n: int, body: dict, headers: dict | None = None) -> list[dict]:
    """`n` concurrent /generate requests; asserts every one is a 200."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers,
                                 limits=httpx.Limits(max_connections=n)) as client:
        rs = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(n)))
    assert [r.status_code for r in rs] == [200] * n, [r.text for r in rs if r.status_code != 200]
    return [r.json() for r in rs]
