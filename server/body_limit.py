"""ASGI middleware that lets a too-large request body be answered 413 however the client sends it.

It only delays: the app still answers (413, from its MAX_CONTENT_LENGTH), but only once the body has been read to the
end and dropped, or the client has stopped sending it. Never buffers a body and never answers a request itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Receive, Send], Awaitable[None]]

# A client still sending after this long gets its 413 anyway (its connection may then reset).
DRAIN_SECONDS = 60.0
# A client that sends no part of its too-large body for this long gets its 413 then.
IDLE_SECONDS = 1.0


class BodyLimit:
    """Why: a server that answers while the client is still sending closes a connection with unread data, which the
    kernel turns into a reset, so the client sees a broken connection instead of the 413. Bodies over `limit` bytes
    (declared by Content-Length, or found so while a chunked body arrives) are read to the end, or until the client
    sends nothing for IDLE_SECONDS, before the app sees their last part: a client that declares 10^12 bytes and sends
    none is answered within a second or two."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.limit:
            await _drain(receive)
            await self.app(scope, _ended(receive), send)
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit and message.get("more_body", False):
                    await _drain(receive)
                    message = {**message, "more_body": False}
            return message

        await self.app(scope, limited, send)


def _declared_length(scope: dict) -> int:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of the body (until its end, the client's disconnect, IDLE_SECONDS without a part, or
    DRAIN_SECONDS)."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        try:
            message = await asyncio.wait_for(receive(), IDLE_SECONDS)
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _ended(receive: Receive) -> Receive:
    """A receive whose body is over at once (the real one has been drained); later calls wait on the real one (for
    the client's disconnect)."""
    done = False

    async def ended() -> dict[str, Any]:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()

    return ended
