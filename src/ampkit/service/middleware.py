"""ASGI middleware of the service: the body cap, enforced while the body is read, and one
structured request-log line per call.

Both are plain ASGI (no ``BaseHTTPMiddleware``): the cap sees each chunk as it arrives, so an
8 MiB chunked body is refused after the first chunk past the cap, not after all of it was read;
the log sees the final status and the matched route (``/v1/runs/{run_id}``, not the run's id).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

__all__ = ["BodyCap", "RequestLog", "log"]

log = logging.getLogger("ampkit.service")

Scope = dict[str, Any]
Message = dict[str, Any]


async def _reply(send: Callable[..., Any], status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )  # the rest of the body is never read: close
    await send({"type": "http.response.body", "body": body})


class BodyCap:
    """413 for a request body over ``cap(scope)`` bytes: at once by its Content-Length, else (chunked)
    as soon as the bytes read so far pass the cap. The body (at most the cap) is then replayed to the app."""

    def __init__(self, app: Any, cap: Callable[[Scope], int]) -> None:
        self.app, self.cap = app, cap

    async def __call__(
        self, scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = self.cap(scope)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            shown = length.decode("latin-1")[:40]
            return await _reply(
                send, 413, f"request body of {shown} bytes exceeds the limit of {cap}"
            )
        if length is None and scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([message], receive), send)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                return await _reply(
                    send, 413, f"request body exceeds the limit of {cap} bytes ({size} read so far)"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[Message], receive: Callable[..., Any]) -> Callable[..., Any]:
    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return replay


class RequestLog:
    """One line per call on the ``ampkit.service`` logger (INFO): ``request {"owner", "method",
    "route", "status", "ms"}`` as JSON. ``owner(scope)`` names the caller (``null`` without a valid token)."""

    def __init__(self, app: Any, owner: Callable[[Scope], Any]) -> None:
        self.app, self.owner = app, owner

    async def __call__(
        self, scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, logged = time.perf_counter(), [500], [False]

        def write() -> None:
            if logged[0] or not log.isEnabledFor(logging.INFO):
                return
            logged[0] = True
            route = getattr(scope.get("route"), "path", None) or scope.get("path", "")
            log.info(
                "request %s",
                json.dumps(
                    {
                        "owner": self.owner(scope),
                        "method": scope.get("method"),
                        "route": route,
                        "status": status[0],
                        "ms": round((time.perf_counter() - start) * 1000, 2),
                    },
                    ensure_ascii=True,
                ),
            )

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                write()  # before the last byte leaves: a client that has its answer finds its line
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            write()  # no complete response (an error, a client gone): the line all the same
