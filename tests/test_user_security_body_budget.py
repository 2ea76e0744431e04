"""Many large uploads at once against the real app over the fake backend: the bytes of request
bodies held at once are capped (--max-body-bytes-in-flight). Without the cap, N clients each
sending a body just under --max-body-bytes were all buffered before admission control could
answer 429."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest
from fake_backend import FakeBackend, serve

from tpserve.config import ServerConfig
from tpserve.server.app import build_app

KIB = 1024
LIMIT = 64 * KIB            # --max-body-bytes
BUDGET = 128 * KIB          # --max-body-bytes-in-flight: two bodies of UPLOAD, not three
UPLOAD = 60 * KIB
HEAD = b'{"inputs": "a b", "parameters": {"max_new_tokens": 2}'


def body(size: int) -> bytes:
    """A valid /generate body of exactly `size` bytes (JSON padded with spaces)."""
    return HEAD + b" " * (size - len(HEAD) - 1) + b"}"


@pytest.fixture(scope="module")
def budgeted():
    backend = FakeBackend()
    cfg = ServerConfig(max_body_bytes=LIMIT, max_body_bytes_in_flight=BUDGET)
    with serve(build_app(backend, cfg)) as url:
        yield backend, url


@pytest.fixture
def url(budgeted) -> str:
    budgeted[0].reset()
    return budgeted[1]


class Upload:
    """A client sending one body over a raw socket, as slowly as the test likes."""

    def __init__(self, url: str, size: int, path: str = "/generate",
                 method: str = "POST") -> None:
        host, port = url.removeprefix("http://").split(":")
        self.body = body(size)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {size}\r\n"
                          "\r\n".encode())

    def send(self, n: int) -> Upload:
        self.sock.sendall(self.body[:n])
        self.body = self.body[n:]
        return self

    def finish(self) -> tuple[int, str]:
        """Send the rest; the answer's status and body."""
        try:
            self.sock.sendall(self.body)
        except OSError:  # answered (and closed) before the body was read: read why
            pass
        return self.reply()

    def reply(self) -> tuple[int, str]:
        return self.reply_with_head()[::2]

    def reply_with_head(self) -> tuple[int, str, str]:
        """The answer's status, its body and its head (status line and headers)."""
        data = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        self.sock.close()
        head, _, rest = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), head.decode().lower(), rest.decode()


def held(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(r"^tpserve_http_request_body_bytes (\S+)$", text, re.M).group(1))


def wait_held(url: str, expected: float) -> None:
    deadline = time.monotonic() + 10
    while held(url) != expected:
        assert time.monotonic() < deadline, f"body bytes held: {held(url)}, not {expected}"
        time.sleep(0.02)


def in_threads(*calls):
    results: list = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def test_upload_over_the_budget_is_429_while_the_others_complete(url):
    a = Upload(url, UPLOAD).send(1000)  # two slow uploads hold 120 KiB of 128
    b = Upload(url, UPLOAD).send(1000)
    wait_held(url, 2 * UPLOAD)

    # A third: refused before its body is sent, with when to try again (RFC 9110).
    status, head, text = Upload(url, UPLOAD).reply_with_head()
    assert status == 429, text
    assert "\r\nretry-after: 1\r\n" in head + "\r\n", head
    assert '"error_type": "overloaded"' in text and "--max-body-bytes-in-flight" in text

    def chunked():  # no Content-Length: refused as it grows past what is left
        yield HEAD
        for _ in range(8):
            yield b" " * (4 * KIB)
        yield b"}"

    r = httpx.post(url + "/generate", content=chunked(), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 429, r.text
    assert r.json()["error_type"] == "overloaded" and r.headers["retry-after"] == "1"

    # A small request still fits beside them, and the slow uploads are undisturbed.
    r = httpx.post(url + "/generate", json={"inputs": "c d", "parameters": {"max_new_tokens": 2}},
                      timeout=10)
    assert r.status_code == 200 and r.json()["generated_text"] == " c d", r.text
    (sa, ta), (sb, tb) = in_threads(a.finish, b.finish)
    assert (sa, sb) == (200, 200), (ta, tb)
    assert json.loads(ta)["generated_text"] == json.loads(tb)["generated_text"] == " a b"

    # Released: two uploads at the limit are accepted again, side by side.
    wait_held(url, 0)
    c, d = Upload(url, UPLOAD).send(1000), Upload(url, UPLOAD).send(1000)
    assert [s for s, _ in in_threads(c.finish, d.finish)] == [200, 200]


def test_budget_is_released_however_a_request_ends(url, budgeted):
    backend = budgeted[0]
    # Client gone mid-upload.
    gone = Upload(url, UPLOAD).send(1000)
    wait_held(url, UPLOAD)
    gone.sock.close()
    wait_held(url, 0)
    # 413: a chunked body past --max-body-bytes.
    r = httpx.post(url + "/generate", content=iter([HEAD, b" " * (LIMIT + 1), b"}"]),
                   timeout=10, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    # The backend failing: 500.
    backend.raise_on_generate = RuntimeError("boom")
    status, _ = Upload(url, UPLOAD).finish()
    assert status == 500
    backend.reset()
    # An exception out of the app (a route's bug), on a request that declared a body.
    backend.info = lambda: 1 / 0  # shadows the method
    status, _ = Upload(url, UPLOAD, "/info", method="GET").finish()
    assert status == 500
    del backend.info
    # A stream the client leaves after its first token.
    backend.token_delay = 0.05
    stream = Upload(url, 2 * KIB, "/generate_stream")
    stream.body = (b'{"inputs": "a b", "parameters": {"max_new_tokens": 50}}').ljust(2 * KIB)
    stream.send(2 * KIB)
    assert stream.sock.recv(100).startswith(b"HTTP/1.1 200")
    stream.sock.close()
    wait_held(url, 0)
    backend.reset()
    # Nothing leaked: two uploads at the limit fit at once.
    c, d = Upload(url, UPLOAD).send(1000), Upload(url, UPLOAD).send(1000)
    assert [s for s, _ in in_threads(c.finish, d.finish)] == [200, 200]
