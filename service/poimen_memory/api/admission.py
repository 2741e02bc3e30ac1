"""Admission: how much work the service takes on at once, and a fast, typed refusal beyond.

Past a few dozen requests in flight a query only waits longer for the same database
connections and the same cores; measured before this existed, at 63-64 connections 87-97%
of requests got uvicorn's bare 503 and some 200s arrived after their deadline. So the work
routes (``/memory/...`` and ``/mcp``) are admitted ``max_inflight`` at a time; up to
``queue`` more wait, each at most ``wait_s``; anything beyond is refused at once with
503 ``busy`` and ``Retry-After``. Probes (``/healthz``, ``/metrics``) are never queued.

The arrival time is kept in the request's state: a query's deadline counts from it
(``arrived``), so time spent queued is time spent, and no answer comes after its deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

from poimen_memory.api.asgi import HttpMiddleware
from poimen_memory.errors import Busy

__all__ = ["ARRIVED", "Admission", "arrived"]

ARRIVED = "poimen_arrived"
_WORK = ("/memory/", "/mcp")


def arrived(scope: Scope) -> float | None:
    """When the request reached the service (time.monotonic()), or None outside it."""
    state = scope.get("state")
    value = state.get(ARRIVED) if isinstance(state, dict) else None
    return value if isinstance(value, float) else None


class Admission(HttpMiddleware):
    def __init__(
        self, app: ASGIApp, *, max_inflight: int, queue: int, wait_s: float, retry_after_s: int
    ) -> None:
        super().__init__(app)
        self.max_inflight, self.queue, self.wait_s = max_inflight, queue, wait_s
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})[ARRIVED] = time.monotonic()
        if not str(scope.get("path", "")).startswith(_WORK):
            await self.app(scope, receive, send)
            return
        if not await self._admit():
            await self._refuse(send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._release()

    async def _admit(self) -> bool:
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            return True
        if len(self._waiters) >= self.queue:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # _release hands its slot over to the first waiter (inflight stays counted).
            await asyncio.wait_for(asyncio.shield(waiter), self.wait_s)
        except TimeoutError:
            pass
        except BaseException:  # the client went away while it waited
            self._abandon(waiter)
            raise
        if waiter.done() and not waiter.cancelled():
            return True  # possibly just as the wait ran out: the slot is ours
        self._abandon(waiter)
        return False

    def _abandon(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done() and not waiter.cancelled():
            self._release()  # handed a slot it will not use: pass it on
            return
        waiter.cancel()
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: inflight unchanged
                return
        self.inflight -= 1

    async def _refuse(self, send: Send) -> None:
        err = Busy(
            f"the service is at capacity ({self.max_inflight} requests in flight, "
            f"{self.queue} waiting)",
            hint=f"retry after {self.retry_after_s} s; POIMEN_HTTP_MAX_INFLIGHT, "
            "POIMEN_HTTP_QUEUE and POIMEN_HTTP_QUEUE_WAIT_S set the capacity",
        )
        body = json.dumps(err.to_json()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.http_status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(self.retry_after_s).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
