"""uvicorn's h11 protocol with a deadline for the first request, and its answer to a
request h11 cannot parse in the service's error shape.

uvicorn closes an idle keep-alive connection only after a response, so a client that opens
a connection and never sends a byte holds its socket (and one of limit_concurrency's
slots) until it goes away. Here the same keep-alive timer also starts when the connection
is made; the first bytes cancel it (uvicorn's own data_received does), exactly as they do
between requests. What this does not bound is a client that trickles a request slowly: the
header size is capped (h11_max_incomplete_event_size) but its pace is not.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from poimen_memory.api.asgi import SECURITY_HEADERS


class FirstRequestDeadline(H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (its request line, its headers or its body's framing)
        never reaches the app, or a route reading it gets no more of it: uvicorn answered in
        bare text, without the headers every other answer carries (api/asgi.SECURITY_HEADERS).
        Here it is the JSON error body and those headers; uvicorn's words, which echo
        nothing of the request, are its detail. The connection closes, as uvicorn's did.

        Where this side has answered already (a route refused the request before reading its
        body, whose framing then broke), h11 takes no second response: the connection only
        closes. uvicorn's own raised there, out of data_received, and asyncio logged a fatal
        error with its traceback for every such request."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = json.dumps({
                "error": "malformed_request",
                "detail": msg,
                "hint": "send a well-formed HTTP/1.1 request: its request line, headers or "
                        "body framing are not",
            }).encode()  # fmt: skip
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *SECURITY_HEADERS,
            ]
            try:
                for event in (
                    h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                    h11.Data(data=body),
                    h11.EndOfMessage(),
                ):
                    self.transport.write(self.conn.send(event) or b"")
            except h11.LocalProtocolError:
                pass  # h11 refused the answer midway: closing is all that is left
        self.transport.close()
