"""A download from the hub that stops answering fails instead of hanging (hub.py uses it).

huggingface_hub 2.x sends some requests with no timeout at all and retries timeouts up to six
times with back-off. StallGuard gives every request of one download the download timeout for
each of its waits (connecting, the answer, each read of a body), and ends the download at the
first request sent again after a silence, with HubStalledError naming the host, the request
and the wait. Installed through huggingface_hub's public set_client_factory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


# hf_xet (files the hub serves through Xet) has its own HTTP client, read from these variables
# (humantime durations) when its runtime starts: 60 s to connect, 300 s of silence per read,
# and retries for up to 6 minutes by default.
XET_TIMEOUTS = ("HF_XET_CLIENT_CONNECT_TIMEOUT", "HF_XET_CLIENT_READ_TIMEOUT",
                "HF_XET_CLIENT_RETRY_MAX_DURATION")


def bound_xet(seconds: float) -> dict[str, str]:
    """Give hf_xet the download timeout: for connecting, for each read, and as the span it
    keeps retrying in (a silence that long is not waited through again, as for the hub's
    own requests). A variable the user set is left as it is. Returns what was set."""
    value = f"{max(1, round(seconds * 1000))}ms"
    set_here = {name: value for name in XET_TIMEOUTS if name not in os.environ}
    os.environ.update(set_here)
    return set_here


class HubStalledError(Exception):
    """The hub (or a proxy, or a CDN it redirected to) sent nothing for the download timeout.
    Not an httpx error, so huggingface_hub does not retry it: it ends the download."""

    def __init__(self, method: str, url: str, what: str, seconds: float,
                 cancelled: bool = False) -> None:
        self.method, self.url, self.what, self.seconds = method, url, what, seconds
        self.cancelled = cancelled
        super().__init__("the download was interrupted" if cancelled else
                         f"{_origin(url)}{_via_proxy(url)} {what} for {seconds:g} s "
                         f"({method} {_no_query(url)})")

    def again(self) -> HubStalledError:
        """A fresh instance for another thread (one instance raised in several threads would
        share one traceback)."""
        return HubStalledError(self.method, self.url, self.what, self.seconds, self.cancelled)


# What the request was doing when its wait ran out, from httpcore's trace event names
# (connection.connect_tcp, http11.receive_response_headers, ...).
_PHASES = (("receive_response_body", "stopped sending in the middle of an answer"),
           ("receive_response_headers", "accepted the connection but sent no answer"),
           ("send_request", "accepted the connection but took no request"),
           ("", "did not complete the connection"))  # connect_tcp, start_tls, proxies


class StallGuard:
    """Bounds every network wait of one download (installed by guarded). Each request gets
    the timeout for connecting, sending, waiting for the answer and for each read of its
    body, longer or shorter than huggingface_hub's own; httpcore's trace events say which
    wait ran out. A request that is sent again after a silence (huggingface_hub retries
    timeouts, up to six times with back-off) raises HubStalledError instead, and from then
    on so do every request and every body read of the download, so that neither retries
    nor the other files keep the launch waiting. (A request huggingface_hub gives up on by
    itself, such as its best-effort telemetry, is let go.)"""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.stalls: dict[tuple[str, str], HubStalledError] = {}  # (method, URL): silence
        self.failed: HubStalledError | None = None  # set once the download is ending
        self._lock = threading.Lock()

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed.again()

    def cancel(self) -> None:
        """End every request and body read of the download at once (Ctrl-C: the threads
        that fetch the files would otherwise finish their files before the process ends).
        Called from a signal handler, so it takes no lock: the main thread may hold
        self._lock where the signal lands. One assignment is atomic; if a stall is
        recorded at the same moment, either error ends the download."""
        if self.failed is None:
            self.failed = HubStalledError("", "", "", 0, cancelled=True)

    def on_request(self, request) -> None:
        self.check()
        stalled = self.stalls.get((request.method, str(request.url)))
        if stalled is not None:  # huggingface_hub retrying a request the hub left unanswered
            with self._lock:
                self.failed = self.failed or stalled
            self.check()
        t = self.seconds
        previous = request.extensions.get("trace")

        def trace(name: str, info: dict):
            if name.endswith(".failed") and type(info.get("exception")).__name__.endswith(
                    "Timeout"):  # httpcore's ConnectTimeout, ReadTimeout, WriteTimeout
                self._record(request.method, str(request.url), name)
            return previous(name, info) if previous is not None else None

        request.extensions = {**request.extensions, "trace": trace,
                              "timeout": {"connect": t, "read": t, "write": t, "pool": t}}

    def _record(self, method: str, url: str, event: str) -> None:
        what = next(text for key, text in _PHASES if key in event)
        stalled = HubStalledError(method, url, what, self.seconds)
        log.debug("no answer: %s", stalled)
        with self._lock:
            self.stalls.setdefault((method, url), stalled)

    def behind(self, exc: BaseException) -> HubStalledError | None:
        """The silence that caused `exc` (huggingface_hub wraps the timeouts it does not
        retry, e.g. LocalEntryNotFoundError from a revision's metadata), else None."""
        if self.failed is not None:
            return self.failed
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if isinstance(exc, HubStalledError):
                return exc
            if type(exc).__name__.endswith("Timeout"):
                try:
                    request = exc.request  # httpx's request error; raises when unset
                    key = (request.method, str(request.url))
                except Exception:  # noqa: BLE001 - a timeout of another kind
                    key = None
                if key in self.stalls:
                    return self.stalls[key]
            exc = exc.__cause__ or exc.__context__
        return None


@contextlib.contextmanager
def cancelled_by_interrupt(guard: StallGuard):
    """Ctrl-C (SIGINT) during the block cancels `guard`'s download, then interrupts as
    before. Only in the main thread, and only over Python's own handler."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def interrupted(signum, frame):
        guard.cancel()
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_guard_lock = threading.Lock()  # one guarded download at a time per process
_active_guard: StallGuard | None = None


@contextlib.contextmanager
def guarded(guard: StallGuard):
    """`guard` watches the requests huggingface_hub makes while the block runs."""
    global _active_guard
    with _guard_lock:
        installed = _install_client_factory()
        if not installed:
            log.warning("this huggingface_hub has no set_client_factory: a hub that stops "
                        "answering may hang the download (upgrade huggingface_hub)")
        _active_guard = guard
        try:
            yield
        finally:
            _active_guard = None


def _install_client_factory() -> bool:
    """Once per process: huggingface_hub's HTTP clients get tpserve's event hooks (which do
    nothing outside a guarded download). Its own factory still makes the client (proxies
    from the environment, its request hook), and a client it recreates after a connection
    error gets the hooks too."""
    try:
        import huggingface_hub
        from huggingface_hub.utils import _http
    except ImportError:
        return False
    make = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) or getattr(
        _http, "default_client_factory", None)
    if make is None or not hasattr(huggingface_hub, "set_client_factory"):
        return False
    if getattr(make, "_tpserve_guarded", False):
        return True

    def factory():
        client = make()
        # httpx (huggingface_hub 1.x) or httpx2 (2.x): the body stream type that client reads
        stream_base = sys.modules[type(client).__module__.split(".")[0]].SyncByteStream
        guarded_stream = _guarded_stream_class(stream_base)
        hooks = client.event_hooks
        client.event_hooks = {
            "request": [*hooks.get("request", []), _on_request],
            "response": [*hooks.get("response", []),
                         lambda response: _on_response(response, guarded_stream)]}
        return client

    factory._tpserve_guarded = True  # type: ignore[attr-defined]
    huggingface_hub.set_client_factory(factory)
    return True


def _on_request(request) -> None:
    guard = _active_guard
    if guard is not None:
        guard.on_request(request)


def _on_response(response, guarded_stream) -> None:
    guard = _active_guard
    if guard is not None:
        response.stream = guarded_stream(response.stream, guard)


def _guarded_stream_class(stream_base: type) -> type:
    class GuardedStream(stream_base):
        """A response body as huggingface_hub reads it, which ends at once when another
        request of the download stalled (a large file on a healthy connection would
        otherwise keep the failed launch waiting until it is complete)."""

        def __init__(self, inner, guard: StallGuard) -> None:
            self._inner, self._guard = inner, guard

        def __iter__(self):
            for chunk in self._inner:
                self._guard.check()
                yield chunk

        def close(self) -> None:
            self._inner.close()

    return GuardedStream


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _via_proxy(url: str) -> str:
    """Where the environment sends `url` through a proxy, the words that say so (what hung may
    be the proxy, not the hub); its host and port only, never a password in its URL."""
    import urllib.request

    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return ""
    where = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = f":{where.port}" if where.port else ""
    return f" through the proxy {where.hostname}{port}"


def _no_query(url: str) -> str:
    """The URL without its query (a CDN's signed URLs carry long signatures)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"
