"""tpserve.Client / AsyncClient and TGI's own text_generation client against one server."""

from __future__ import annotations

import asyncio

import pytest
import text_generation
from text_generation import errors as tgi_errors
from text_generation.types import Message

from tpserve.client import AsyncClient, Client
from tpserve.errors import GenerationError, NotReadyError, OverloadedError, ValidationError

PROMPT = "the quick brown fox </s>"
EXPECTED = " the quick brown fox"

# text_generation 0.7 still calls pydantic's deprecated .dict().
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")


@pytest.fixture
def url(server, backend) -> str:
    return server[1]


@pytest.fixture
def client(url):
    with Client(url) as c:
        yield c


def test_generate_returns_details(client):
    res = client.generate(PROMPT, max_new_tokens=10)
    assert res.generated_text == EXPECTED
    details = res.details
    assert details.finish_reason == "eos_token"
    assert details.generated_tokens == 5
    assert details.seed is None
    tokens = details.tokens
    assert [t.text for t in tokens] == [" the", " quick", " brown", " fox", "</s>"]
    assert [t.special for t in tokens] == [False] * 4 + [True]
    assert tokens[0].logprob == pytest.approx(-0.1) and isinstance(tokens[0].id, int)


def test_generate_passes_parameters(client, backend):
    res = client.generate(
        "a b c",
        max_new_tokens=3,
        do_sample=True,
        seed=11,
        top_k=4,
        stop_sequences=[" b"],
        return_full_text=True,
    )
    assert res.generated_text == "a b c a b"
    assert res.details.finish_reason == "stop_sequence" and res.details.seed == 11
    params = backend.calls[-1].params
    assert (params.do_sample, params.seed, params.top_k, params.stop) == (True, 11, 4, (" b",))


def test_generate_stream(client):
    events = list(client.generate_stream(PROMPT, max_new_tokens=10))
    assert all(e.generated_text is None for e in events[:-1])
    text = "".join(e.token.text for e in events if not e.token.special)
    assert text == events[-1].generated_text == EXPECTED
    assert events[-1].details.finish_reason == "eos_token"
    assert events[-1].details.generated_tokens == 5


def test_async_client_matches_sync(client, url):
    async def run():
        aclient = AsyncClient(url)
        res = await aclient.generate(PROMPT, max_new_tokens=10)
        events = [e async for e in aclient.generate_stream(PROMPT, max_new_tokens=10)]
        return res, events, await aclient.health(), await aclient.info()

    res, events, healthy, info = asyncio.run(run())
    assert res.generated_text == client.generate(PROMPT, max_new_tokens=10).generated_text
    assert res.details.generated_tokens == 5
    assert events[-1].generated_text == EXPECTED
    assert healthy and info["model_id"] == "fake/echo"


def test_tgi_client_gets_the_same_text(client, url):
    tgi = text_generation.Client(url)
    res = tgi.generate(PROMPT, max_new_tokens=10)
    ours = client.generate(PROMPT, max_new_tokens=10)
    assert res.generated_text == ours.generated_text == EXPECTED
    assert res.details.finish_reason.value == ours.details.finish_reason
    assert [t.id for t in res.details.tokens] == [t.id for t in ours.details.tokens]
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=10))
    assert events[-1].generated_text == EXPECTED
    assert "".join(e.token.text for e in events if not e.token.special) == EXPECTED


def test_tgi_async_client(url):
    async def run():
        tgi = text_generation.AsyncClient(url)
        res = await tgi.generate(PROMPT, max_new_tokens=10)
        events = [e async for e in tgi.generate_stream(PROMPT, max_new_tokens=10)]
        return res, events

    res, events = asyncio.run(run())
    assert res.generated_text == events[-1].generated_text == EXPECTED


def test_tgi_client_chat(url):
    tgi = text_generation.Client(url)
    res = tgi.chat([Message(role="user", content="hi")], max_tokens=2, temperature=0.0)
    assert res.choices[0].message.content == " user: hi"
    # The whole stream, read to its end: text_generation 0.7 parses every `data:` line as
    # JSON, so a closing `data: [DONE]` raised JSONDecodeError after the last chunk.
    chunks = list(tgi.chat([Message(role="user", content="hi")], max_tokens=2, stream=True))
    assert "".join(c.choices[0].delta.content for c in chunks) == " user: hi"
    assert chunks[-1].choices[0].finish_reason == "length"

    async def read_async():
        stream = await text_generation.AsyncClient(url).chat(
            [Message(role="user", content="hi")], max_tokens=2, stream=True)
        return [c async for c in stream]

    chunks = asyncio.run(read_async())
    assert "".join(c.choices[0].delta.content for c in chunks) == " user: hi"


def test_chat_streams_still_end_with_done_for_other_clients(url):
    """Only text_generation's requests (every field of its ChatRequest, nulls included) go
    without the closing `[DONE]`; OpenAI's clients and curl keep it."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    raw = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).text
    assert raw.rstrip().endswith("data: [DONE]"), raw


def test_health_and_info(client, backend):
    assert client.health() is True
    assert client.info()["tp_size"] == 2
    backend.is_ready = False
    assert client.health() is False
    with pytest.raises(NotReadyError):
        client.generate("a")


def test_health_is_false_when_nothing_listens():
    assert Client("http://127.0.0.1:9", timeout=1).health() is False


def test_client_side_validation_fails_before_the_network(client, backend):
    with pytest.raises(ValidationError, match="`temperature`: Input should be greater than 0"):
        client.generate("a", temperature=0)
    with pytest.raises(ValidationError, match="`best_of` > 1"):
        client.generate("a", best_of=2)
    assert backend.calls == []


def test_server_side_errors_map_to_tpserve_errors(client, backend):
    with pytest.raises(ValidationError, match="`stop` supports up to 3"):
        client.generate("a", stop_sequences=["1", "2", "3", "4"])
    with pytest.raises(ValidationError, match="at most 64 tokens"):
        list(client.generate_stream("w " * 65))
    backend.raise_on_generate = OverloadedError("queue is full")
    with pytest.raises(OverloadedError, match="queue is full"):
        client.generate("a")
    backend.raise_on_generate = None
    backend.fail_after = 1
    with pytest.raises(GenerationError, match="fake engine failure"):
        list(client.generate_stream("a b", max_new_tokens=5))


def test_async_client_errors(url, backend):
    backend.fail_after = 1

    async def run():
        return [e async for e in AsyncClient(url).generate_stream("a b", max_new_tokens=5)]

    with pytest.raises(GenerationError, match="fake engine failure"):
        asyncio.run(run())
    backend.fail_after = None
    backend.raise_on_generate = OverloadedError("busy")
    with pytest.raises(OverloadedError):
        asyncio.run(AsyncClient(url).generate("a"))


def test_tgi_client_sees_tgi_errors(url, backend):
    tgi = text_generation.Client(url)
    with pytest.raises(tgi_errors.ValidationError, match="`stop` supports up to 3"):
        tgi.generate("a", stop_sequences=["1", "2", "3", "4"])
    backend.raise_on_generate = OverloadedError("busy")
    with pytest.raises(tgi_errors.OverloadedError):
        tgi.generate("a")
    backend.raise_on_generate = None
    backend.fail_after = 1
    with pytest.raises(tgi_errors.GenerationError, match="fake engine failure"):
        list(tgi.generate_stream("a b", max_new_tokens=5))
    backend.fail_after = None
    assert tgi.generate("a", max_new_tokens=1).generated_text == " a"


# --- no answer from the server -------------------------------------------------------------
def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _each_call(url: str, timeout: float):
    """Every request method of both clients, as a zero-argument call."""
    sync = Client(url, timeout=timeout)

    async def agen():
        return [e async for e in AsyncClient(url, timeout=timeout).generate_stream("a")]

    return {"generate": lambda: sync.generate("a"),
            "generate_stream": lambda: list(sync.generate_stream("a")),
            "info": sync.info,
            "async generate": lambda: asyncio.run(AsyncClient(url, timeout=timeout)
                                                  .generate("a")),
            "async generate_stream": lambda: asyncio.run(agen()),
            "async info": lambda: asyncio.run(AsyncClient(url, timeout=timeout).info())}


def test_a_server_that_is_not_running_is_a_clear_connection_error():
    """httpx's bare `[Errno 111] Connection refused` used to escape, naming no server."""
    from tpserve.client import ServerUnreachableError
    from tpserve.errors import TPServeError

    url = f"http://127.0.0.1:{_closed_port()}"
    for name, call in _each_call(url, 5).items():
        with pytest.raises(ServerUnreachableError, match=f"cannot connect to {url}") as info:
            call()
        assert "tpserve launch" in str(info.value), name
        assert isinstance(info.value, ConnectionError), name
        assert isinstance(info.value, TPServeError), name


def test_a_server_that_does_not_answer_in_time_is_a_timeout_error():
    """httpx's bare `timed out` used to escape; now it names the server and the timeout."""
    import socket

    from tpserve.client import ClientTimeoutError
    from tpserve.errors import RequestTimeoutError

    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for name, call in _each_call(url, 0.3).items():
            with pytest.raises(ClientTimeoutError, match=r"sent nothing for 0.3 s") as info:
                call()
            assert isinstance(info.value, TimeoutError), name
            assert isinstance(info.value, RequestTimeoutError), name


def test_a_connection_lost_mid_stream_is_a_connection_error():
    import socket
    import threading

    from tpserve.client import ServerUnreachableError

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def answer_then_die() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n5\r\ndata:")  # then gone

        thread = threading.Thread(target=answer_then_die)
        thread.start()
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(ServerUnreachableError, match=f"connection to {url} failed"):
            list(Client(url, timeout=5).generate_stream("a"))
        thread.join(timeout=5)


def test_a_base_url_without_a_scheme_is_refused_at_once():
    """`Client("localhost:8080")` used to fail on the first call with httpx's "unsupported
    protocol 'localhost://'"."""
    with pytest.raises(ValueError, match="must start with http:// or https://, as in "
                                         "'http://localhost:8080'"):
        Client("localhost:8080")
    with pytest.raises(ValueError, match="http://"):
        AsyncClient("127.0.0.1:8080")


def _answering(status: int, body: bytes, headers: dict[str, str]):
    """A loopback HTTP server that answers every request with `status`, `headers`, `body`:
    what a proxy in front of tpserve (or another version of it) may send."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("status,headers,body,cls,retry", [
    # were the class's 1 s, and a 404 read as status 500, a 413 as 422
    (429, {"Retry-After": "7"}, b'{"error": "busy", "error_type": "overloaded"}',
     OverloadedError, 7),
    (503, {"Retry-After": "30"}, b'{"error": "loading", "error_type": "unhealthy"}',
     NotReadyError, 30),
    (413, {}, b'{"error": "too big", "error_type": "validation"}', ValidationError, None),
    (404, {}, b'{"error": "no such route", "error_type": "http"}', GenerationError, None),
    (502, {}, b"<html>Bad Gateway</html>", GenerationError, None),
])
def test_an_error_carries_the_answers_status_and_retry_after(status, headers, body, cls, retry):
    srv, url = _answering(status, body, headers)
    try:
        for call in (lambda: Client(url).generate("a"),
                     lambda: list(Client(url).generate_stream("a")),
                     lambda: asyncio.run(AsyncClient(url).generate("a"))):
            with pytest.raises(cls) as info:
                call()
            assert (info.value.status_code, info.value.retry_after) == (status, retry)
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_servers_retry_after_reaches_the_exception(client, backend):
    backend.raise_on_generate = OverloadedError("queue is full")
    with pytest.raises(OverloadedError, match="queue is full") as info:
        client.generate("a")
    assert (info.value.status_code, info.value.retry_after) == (429, 1)


@pytest.mark.parametrize("body", [b"<html>Sign in to the proxy</html>", b'{"hello": 1}'])
def test_an_answer_that_is_not_tpserves_is_a_tpserve_error(body):
    """A 200 from something else at the address (a proxy's page, another server) escaped as
    json's JSONDecodeError or pydantic's ValidationError, which no caller catching
    TPServeError expects."""
    srv, url = _answering(200, body, {"Content-Type": "text/html"})
    stream_srv, stream_url = _answering(200, b"data:" + body + b"\n\n",
                                        {"Content-Type": "text/event-stream"})
    try:
        for call in (lambda: Client(url).generate("a"),
                     lambda: asyncio.run(AsyncClient(url).generate("a")),
                     lambda: list(Client(stream_url).generate_stream("a"))):
            with pytest.raises(GenerationError, match="not tpserve's .*check that the address"):
                call()
    finally:
        for s in (srv, stream_srv):
            s.shutdown()
            s.server_close()


@pytest.mark.parametrize("offset,expected", [(120, range(118, 122)), (-60, range(0, 1))])
def test_a_retry_after_given_as_an_http_date_is_read_as_seconds(offset, expected):
    """Proxies and load balancers send Retry-After as an HTTP-date; it read as None."""
    import email.utils
    import time

    date = email.utils.formatdate(time.time() + offset, usegmt=True)
    srv, url = _answering(503, b"<html>Service Unavailable</html>", {"Retry-After": date})
    try:
        with pytest.raises(NotReadyError) as info:
            Client(url).generate("a")
        assert info.value.retry_after in expected
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_unreadable_retry_after_is_none():
    srv, url = _answering(429, b'{"error": "busy", "error_type": "overloaded"}',
                          {"Retry-After": "soon"})
    try:
        with pytest.raises(OverloadedError) as info:
            Client(url).generate("a")
        assert (info.value.status_code, info.value.retry_after) == (429, None)
    finally:
        srv.shutdown()
        srv.server_close()
