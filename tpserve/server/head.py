"""HEAD answered wherever GET is.

HTTP requires it (RFC 9110 9.3.2) and TGI's router answers it; uptime monitors, load
balancers and `curl -I` probe with it. FastAPI's routes take only the methods they list, and
listing HEAD beside GET puts each operation in the OpenAPI schema twice under one id. The
route sees GET; the server, which keeps the request's own scope, sends no body for HEAD.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HeadAsGetMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        inner = {**scope, "method": "GET"}
        try:
            await self.app(inner, receive, send)
        finally:  # what routing added (the matched route, which metrics label by) goes back
            scope.update((k, v) for k, v in inner.items() if k != "method")
