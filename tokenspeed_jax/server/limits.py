"""Request limits that protect every other client: body size (`--max-request-bytes`) and the
waiting queue (`--max-queued-requests`).

The body limit is an ASGI middleware, so an oversized body is refused (413) before it is parsed:
a declared `Content-Length` above the limit is refused without reading a byte; a body without one
(chunked) is counted as it arrives and refused as soon as the count passes the limit. Parsing a
20 MB JSON body blocks the event loop for seconds, for every client.

The queue limit answers 503 with `Retry-After` at once when the engine already holds that many
waiting requests, instead of letting overload grow the queue (and every client's latency)
without bound.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenspeed_jax.server.errors import error_response, send_error

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
RETRY_AFTER_S = 1


def _too_large(limit: int) -> str:
    return f"request body exceeds the server's limit of {limit} bytes (--max-request-bytes)"


class BodyLimitMiddleware:
    """413 for HTTP request bodies over `max_bytes` (see the module docstring)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        try:
            size = int(declared) if declared is not None else None
        except ValueError:
            size = None
        if size is not None and size > self.max_bytes:
            await send_error(send, 413, _too_large(self.max_bytes))
            return
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # FastAPI turns this into the 413 error body
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except HTTPException as e:  # raised where no handler caught it (e.g. outside a route)
            if e.status_code != 413 or started:
                raise
            await send_error(send, 413, str(e.detail))


def queue_full(stats: list[dict], limit: int | None) -> JSONResponse | None:
    """The 503 to answer when the replicas' `stats()` already hold `limit` waiting requests;
    None when there is room (or no limit)."""
    if limit is None:
        return None
    waiting = sum(int(s.get("num_waiting", 0)) for s in stats)
    if waiting < limit:
        return None
    return error_response(
        503,
        f"the server is overloaded ({waiting} requests waiting, "
        f"--max-queued-requests {limit}); retry shortly",
        code="server_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
