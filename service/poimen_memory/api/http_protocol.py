"""uvicorn's h11 protocol with a deadline for the first request.

uvicorn closes an idle keep-alive connection only after a response, so a client that opens
a connection and never sends a byte holds its socket (and one of limit_concurrency's
slots) until it goes away. Here the same keep-alive timer also starts when the connection
is made; the first bytes cancel it (uvicorn's own data_received does), exactly as they do
between requests. What this does not bound is a client that trickles a request slowly: the
header size is capped (h11_max_incomplete_event_size) but its pace is not.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class FirstRequestDeadline(H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
