"""Slow and oversized request heads against tpserve.server.http_protocol: uvicorn's own
httptools protocol kept a 200 MB header in memory and a half-sent request line open forever."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fake_backend import FakeBackend

from tpserve.server.app import build_app
from tpserve.server.http_protocol import http_protocol

Bounded = http_protocol()
pytestmark = pytest.mark.skipif(isinstance(Bounded, str), reason="httptools not installed")


@contextlib.contextmanager
def serve_bounded(head_timeout_s: float = 30.0):
    protocol = type("Quick", (Bounded,), {"HEAD_TIMEOUT_S": head_timeout_s})
    config = uvicorn.Config(build_app(FakeBackend()), host="127.0.0.1", port=0,
                            log_level="warning", lifespan="off", http=protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _answer(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_oversized_header_is_431_long_before_it_is_all_sent():
    with serve_bounded() as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        sent = 0
        with contextlib.suppress(OSError):  # the server closes the connection on us
            while sent < 50_000_000 and not select.select([s], [], [], 0)[0]:
                s.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 20_000_000  # answered soon after the limit (kernel buffers hold MBs)
        status, body = _answer(s)
        assert status == 431 and body["error_type"] == "validation"


def test_many_small_headers_count_too():
    with serve_bounded() as port, socket.create_connection(("127.0.0.1", port)) as s:
        with contextlib.suppress(OSError):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X-A: b\r\n" * 20000)
        assert _answer(s)[0] == 431


def test_half_sent_request_line_is_closed_with_408():
    with serve_bounded(head_timeout_s=0.5) as port:
        quiet = socket.create_connection(("127.0.0.1", port))  # sends nothing at all
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: loc")
            t0 = time.monotonic()
            s.settimeout(5)
            status, body = _answer(s)
            assert status == 408 and body["error_type"] == "validation"
            assert time.monotonic() - t0 < 3
        quiet.settimeout(5)
        assert _answer(quiet)[0] == 408
        quiet.close()


def test_normal_requests_and_keep_alive_still_work():
    with serve_bounded(head_timeout_s=0.5) as port:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=10) as c:
            for _ in range(3):  # one kept-alive connection, idle longer than the head timeout
                r = c.post("/generate", json={"inputs": "a b", "parameters": {"max_new_tokens": 2}},
                           headers={"x-pad": "p" * 32000})
                assert r.status_code == 200 and r.json()["generated_text"] == " a b"
                time.sleep(0.7)
            big = c.post("/generate", json={"inputs": "w " * 100_000})  # a big body is no head
            assert big.status_code == 422
