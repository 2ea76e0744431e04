"""API keys and the request body limits, as pure ASGI middleware.

Pure ASGI (not BaseHTTPMiddleware) so that nothing buffers bodies or hides disconnects.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.errors import OverloadedError

_RETRY = [(b"retry-after", str(OverloadedError.retry_after).encode())]

# Routes a load balancer or orchestrator must reach without a key.
ALWAYS_PUBLIC = frozenset({"/health"})
# Host names an open loopback server also answers (comma-separated; `*`: any).
ALLOWED_HOSTS_ENV = "TPSERVE_ALLOWED_HOSTS"
# Where APIKeyMiddleware leaves the accepted key's tag: scope["state"], which handlers read
# as request.state.
KEY_TAG = "api_key_tag"


async def send_error(send: Send, status: int, message: str, error_type: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer with TGI's error body without touching the app (nor the request body)."""
    body = json.dumps({"error": message, "error_type": error_type}).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def digest_matches(candidate: bytes, digests: tuple[bytes, ...]) -> bool:
    """Constant time against every key: digests have one length whatever the keys' lengths,
    and no early exit reveals which key, or how much of one, matched."""
    found = False
    for digest in digests:
        found |= hmac.compare_digest(candidate, digest)
    return found


def key_tag(state: object) -> bytes:
    """The tag of the API key a request was let in with (`request.state`), which owns what
    the request stores; b"" on a server without keys (one scope for all)."""
    return getattr(state, KEY_TAG, b"")


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every route except the public ones, and
    leaves the accepted key's tag in the request's state (key_tag)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], public: frozenset[str]) -> None:
        self.app = app
        self.keys = tuple(key_digest(k) for k in keys)
        self.public = public
        # Tags are HMACs under a secret of this process: what the response store holds names
        # a key without being a digest a guessed key could be checked against elsewhere.
        self._tag_secret = os.urandom(32)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        candidate = key_digest(token.strip())
        if scheme.lower() == "bearer" and digest_matches(candidate, self.keys):
            tag = hmac.new(self._tag_secret, candidate, hashlib.sha256).digest()
            scope.setdefault("state", {})[KEY_TAG] = tag
            await self.app(scope, receive, send)
            return
        why = "missing" if not auth else "invalid"
        await send_error(
            send, 401, f"{why} API key: send `Authorization: Bearer <key>`", "unauthorized",
            headers=[(b"www-authenticate", b"Bearer")],
        )


class BodyBudget:
    """The bytes of request bodies one app holds at once, received or still arriving.

    The body limit alone lets N clients each send a body just under it at once, all held in
    memory before admission control could answer 429. One per app, used from its event loop
    only (so no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`: at once from Content-Length, or as soon as a chunked
    body's bytes pass the limit (so at most `max_bytes` is ever buffered). 429 `overloaded`
    when a body would take `budget` past its limit: at once for a declared length (reserved
    whole before the body is read), or as a chunked body grows. A request's bytes stay taken
    until the app is done with it, whichever way it ends."""

    def __init__(self, app: ASGIApp, max_bytes: int, budget: BodyBudget) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = budget

    def _too_large(self) -> str:
        return (f"request body is larger than the server's limit of {self.max_bytes} bytes "
                "(--max-body-bytes)")

    def _over_budget(self) -> str:
        return (f"the server is receiving as many request bodies as it holds at once (at most "
                f"{self.budget.limit} bytes, --max-body-bytes-in-flight); retry shortly")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        held = 0
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                await send_error(send, 400, "invalid Content-Length header", "validation")
                return
            if declared > self.max_bytes:
                await send_error(send, 413, self._too_large(), "validation")
                return
            if not self.budget.take(declared):
                await send_error(send, 429, self._over_budget(), "overloaded", _RETRY)
                return
            held = declared
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen, held
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                # Raised inside the route's body read: FastAPI lets HTTPException through
                # to the error handlers, which answer in TGI's shape.
                if seen > self.max_bytes:
                    raise HTTPException(413, self._too_large())
                if seen > held:  # a chunked body: take what it grew by
                    if not self.budget.take(seen - held):
                        raise HTTPException(429, self._over_budget(),
                                            headers={"Retry-After": _RETRY[0][1].decode()})
                    held = seen
            return message

        try:
            await self.app(scope, counted_receive, send)
        finally:
            self.budget.give(held)


def _host_name(header: bytes) -> str:
    """The name of a Host header, without port, brackets or a trailing dot, lowercased."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".") if host != "." else host


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _loopback(server: tuple | None) -> bool:
    try:
        return server is not None and ipaddress.ip_address(server[0]).is_loopback
    except ValueError:
        return False


class HostCheckMiddleware:
    """Refuses DNS rebinding against an open (keyless) server on a loopback address: a web
    page whose name is re-pointed to 127.0.0.1 is same-origin with the server, so the
    browser would send it JSON and let the page read the answers. Such requests carry the
    page's host name; local clients send `localhost` or an address. Servers with a key, or
    bound to another address, are not checked (the key, or the network, is the guard)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    @classmethod
    def from_env(cls, app: ASGIApp) -> HostCheckMiddleware:
        names = os.environ.get(ALLOWED_HOSTS_ENV, "")
        return cls(app, frozenset(n.strip().lower().rstrip(".") for n in names.split(",")
                                  if n.strip()))

    def _allowed(self, name: str) -> bool:
        return (name == "localhost" or name.endswith(".localhost") or _is_address(name)
                or name in self.allowed or "*" in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _loopback(scope.get("server")):
            header = dict(scope["headers"]).get(b"host")
            if header is not None and not self._allowed(_host_name(header)):
                await send_error(
                    send, 403, f"this server on a loopback address does not answer the Host "
                    f"{header.decode('latin-1')[:100]!r} (DNS rebinding guard): use localhost "
                    f"or an address, set an API key, or list the name in {ALLOWED_HOSTS_ENV}",
                    "forbidden")
                return
        await self.app(scope, receive, send)
