"""Soak against the fake backend: concurrent streaming and non-streaming clients, a share
vanishing mid-stream, leave nothing behind (no open generation, no in-flight request), and
64 concurrent requests succeed afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fake_backend import FakeBackend, serve
from soak_clients import all_succeed, soak

from tpserve.config import ServerConfig
from tpserve.server.app import build_app

PROMPTS = ["a b c d e f", "one two three", "x y z w v u t s"]


@pytest.fixture(scope="module")
def fake_server():
    backend = FakeBackend(token_delay=0.002)
    with serve(build_app(backend, ServerConfig(request_timeout_s=10))) as url:
        yield backend, url


def _inflight(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("tpserve_requests_inflight "):
            return float(line.split()[1])
    raise AssertionError("no inflight gauge")


def wait_idle(backend: FakeBackend, url: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while backend.active or _inflight(url):
        assert time.monotonic() < deadline, (backend.active, _inflight(url))
        time.sleep(0.05)


def test_soak_with_disconnects_leaks_nothing(fake_server):
    backend, url = fake_server
    backend.token_delay = 0.002
    report = asyncio.run(soak(url, rounds=4, clients=48, prompts=PROMPTS, max_new=30,
                              vanish=0.3, deadline_s=20))
    assert report.requests == 4 * 48
    # Each request ended one way, and only in the expected ways.
    assert set(report.outcomes) <= {"completed", "vanished", "gave_up"}, report.outcomes
    assert report.outcomes["completed"] > report.requests // 2
    assert report.outcomes["vanished"] > 0 and report.outcomes["gave_up"] > 0
    assert report.slowest_s < 20
    print("FAKE SOAK", report.requests, dict(report.outcomes), round(report.slowest_s, 2))
    wait_idle(backend, url)
    results = asyncio.run(all_succeed(url, 64, {"inputs": "p q", "parameters": {
        "max_new_tokens": 4}}))
    assert {r["generated_text"] for r in results} == {" p q p q"}
    wait_idle(backend, url)
