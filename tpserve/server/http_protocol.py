"""uvicorn's HTTP/1.1 protocol with bounds on the request head.

uvicorn's httptools protocol keeps whatever a client sends before the end of the headers
(a 200 MB header line cost 200 MB of server memory) for as long as the client likes (a
connection sending half a request line stayed open forever, holding a socket). Here a head
larger than MAX_HEAD_BYTES gets 431 and one not complete after HEAD_TIMEOUT_S gets 408, both
with TGI's error body, and the connection is closed. Use it as `uvicorn.Config(app,
http=http_protocol())`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


def _response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message, "error_type": "validation"}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def http_protocol() -> Any:
    """The bounded protocol class, or uvicorn's h11 (which bounds a head to 16 KiB itself)
    where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        MAX_HEAD_BYTES = 64 * 1024  # request line + headers; nginx's default is 8-32 KiB
        HEAD_TIMEOUT_S = 30.0  # from the connection, or a request's first byte, to its headers
        LINGER_S = 1.0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_bytes, self._in_head, self._refused = 0, True, False
            self._head_timer: asyncio.TimerHandle | None = None
            self._start_head_timer()

        def _start_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(self.HEAD_TIMEOUT_S, self._head_timeout)

        def _refuse(self, status: int, reason: str, message: str) -> None:
            """Answer, then read and drop what still comes for LINGER_S before closing:
            closing with unread bytes would reset the connection and lose the answer."""
            if self._head_timer is not None:
                self._head_timer.cancel()
            if self._refused or self.transport.is_closing():
                return
            self._refused = True
            self.transport.write(_response(status, reason, message))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._head_timer = self.loop.call_later(self.LINGER_S, self.transport.close)

        def _head_timeout(self) -> None:
            if self._in_head:
                self._refuse(408, "Request Timeout", "the request's headers did not arrive "
                             f"within {self.HEAD_TIMEOUT_S:g} s")

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > self.MAX_HEAD_BYTES:
                self._refuse(431, "Request Header Fields Too Large", "the request line and "
                             f"headers are larger than {self.MAX_HEAD_BYTES} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._in_head:  # the next request on a kept-alive connection
                self._in_head, self._head_bytes = True, 0
                self._start_head_timer()

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return BoundedHttpToolsProtocol
