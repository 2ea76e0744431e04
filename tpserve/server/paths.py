"""A path with trailing slashes is served as the path without them.

`POST /v1/chat/completions/` (a base URL ending in a slash, joined by hand) got Starlette's
307 redirect with an empty body: clients that do not follow redirects for POST (httpx,
aiohttp by default, curl without -L) saw an empty answer, and those that do sent the body
twice. No route of tpserve's ends in a slash but `/`, so the slashes name nothing else.
Outermost, so that the API-key, body-limit and metrics middlewares see the path the router
will: a key is never asked or waived because of a slash.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class TrailingSlashMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            raw = scope.get("raw_path")
            if raw:  # the path as sent, query excluded (ASGI): logs and metrics read it
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
