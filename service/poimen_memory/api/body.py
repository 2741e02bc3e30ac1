"""A request body within a size and a time budget, for every route that reads one (the node
writes, the review posts, and POST /mcp before the MCP SDK sees it): uvicorn bounds neither,
so a client that trickles a body a byte at a time would hold a work slot for as long as it
liked."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import Message, Receive

from poimen_memory.api.numbers import digits_value
from poimen_memory.errors import PayloadTooLarge, RequestTimeout, UnsupportedEncoding

SPLIT_NODES = "POIMEN_MAX_BODY_BYTES sets the limit; split the nodes over several requests"


async def read_body(
    request: Request, limit: int, timeout_s: float, *, hint: str = SPLIT_NODES
) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes, and (408) when
    it has not all arrived within ``timeout_s``; and (415) unread when it comes compressed."""
    _uncompressed(request)
    declared = request.headers.get("content-length", "")
    too_large = PayloadTooLarge(f"request body is over {limit} bytes", hint=hint)
    length = digits_value(declared, limit)
    if length is not None and length > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
            hint="POIMEN_HTTP_BODY_TIMEOUT_S sets the limit; send the body at once",
        ) from None
    return b"".join(chunks)


def _uncompressed(request: Request) -> None:
    """No route decodes a Content-Encoding: a gzip body was read as its compressed bytes (a
    JSON error about what the client never sent) or, as an empty or NDJSON body, taken for
    something else. RFC 9110 (15.5.16) answers a coding the server does not take with 415;
    "identity" (no coding) is the one it takes, as the header written out or not at all."""
    codings = [
        c.strip().lower()
        for value in request.headers.getlist("content-encoding")
        for c in value.split(",")
    ]
    unsupported = [c for c in codings if c not in ("", "identity")]
    if unsupported:
        raise UnsupportedEncoding(
            f"a request body with Content-Encoding {unsupported[0][:40]!r} is not taken",
            hint="send the body uncompressed, without a Content-Encoding header",
        )


def media_type(request: Request) -> str:
    """The body's media type as the request's Content-Type names it: lower case (a media
    type's case means nothing), without parameters; "" for none."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI receive that gives ``body`` as the whole request once, then the connection's
    own messages (a disconnect): for an app that reads the body itself after it was read."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
