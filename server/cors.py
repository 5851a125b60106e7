"""ASGI middleware for cross-origin requests from browsers, with vLLM's flags and defaults (`--allowed-origins`,
`--allowed-methods`, `--allowed-headers`, `--allow-credentials`; every origin, method and header allowed, no
credentials).

A preflight (OPTIONS with Access-Control-Request-Method) is answered here: 200 with the allowed methods and headers,
or 400 for an origin not allowed. Any other request from an allowed origin gets Access-Control-Allow-Origin on its
answer; a request without an Origin header passes untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Receive, Send], Awaitable[None]]

# How long a browser may keep a preflight's answer (seconds)
PREFLIGHT_MAX_AGE = 600


class Cors:
    def __init__(self, app: ASGIApp, origins: Sequence[str] = ("*",), methods: Sequence[str] = ("*",),
                 headers: Sequence[str] = ("*",), credentials: bool = False):
        self.app = app
        self.origins = set(origins)
        self.methods = list(methods)
        self.headers = list(headers)
        self.credentials = credentials

    def allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def _origin_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        """Access-Control-Allow-Origin (the origin itself when credentials are allowed or origins are listed: a
        browser refuses "*" with credentials), and what goes with it."""
        if "*" in self.origins and not self.credentials:
            return [(b"access-control-allow-origin", b"*")]
        headers = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if self.credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        return headers

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_headers = {name.lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
        origin = request_headers.get(b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in request_headers:
            await self._preflight(origin, request_headers, send)
            return
        if not self.allowed(origin):
            await self.app(scope, receive, send)
            return
        extra = self._origin_headers(origin)

        async def with_origin(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_origin)

    async def _preflight(self, origin: str, request_headers: dict, send: Send) -> None:
        method = request_headers[b"access-control-request-method"]
        if not self.allowed(origin) or ("*" not in self.methods and method not in self.methods):
            body = b"Disallowed CORS " + (b"origin" if not self.allowed(origin) else b"method")
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        asked = request_headers.get(b"access-control-request-headers", "")
        allow_headers = asked if "*" in self.headers else ", ".join(self.headers)
        allow_methods = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT" if "*" in self.methods else ", ".join(
            self.methods)
        headers = [*self._origin_headers(origin), (b"access-control-allow-methods", allow_methods.encode()),
                   (b"access-control-max-age", str(PREFLIGHT_MAX_AGE).encode()), (b"content-length", b"2"),
                   (b"content-type", b"text/plain")]
        if allow_headers:
            headers.append((b"access-control-allow-headers", allow_headers.encode("latin-1")))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"OK"})
