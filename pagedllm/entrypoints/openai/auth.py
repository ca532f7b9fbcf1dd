"""API-key check as ASGI middleware, so it runs before body parsing: a client without the key
gets 401 even for a malformed body. Probes, docs and the web console's page and assets stay open
(a browser cannot send a header when it opens a page: the page asks for the key and sends it with
every API call it makes)."""
from __future__ import annotations

import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.http_errors import error_body

OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every HTTP path outside the open paths and prefixes."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS,
                 open_prefixes: tuple[str, ...] = ()):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = error_body("missing or incorrect API key (send 'Authorization: Bearer <key>')", "invalid_request_error", None, "invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _open(self, path: str) -> bool:
        # A prefix never opens a path that climbs out of it ("/console/static/../x").
        return path in self.open_paths or (path.startswith(self.open_prefixes) and "/.." not in path)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return secrets.compare_digest(value, self._expected)
        return False
