"""ASGI middleware writing one access-log line per request: client, method, path, status and latency (to the last byte
of the answer, a stream's included).

Observes only: never changes a request or an answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Receive, Send], Awaitable[None]]

log = logging.getLogger("qwen_jax.access")


class AccessLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0  # none sent: the client went away first

        async def observed(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            log.info('%s "%s %s HTTP/%s" %d %.1f ms', where, scope["method"], scope["path"],
                     scope.get("http_version", "1.1"), status, (time.monotonic() - start) * 1000)
