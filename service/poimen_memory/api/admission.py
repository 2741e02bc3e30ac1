"""Admission: how much work the service takes on at once, and a fast, typed refusal beyond.

Past a few dozen requests in flight a query only waits longer for the same database
connections and the same cores; measured before this existed, at 63-64 connections 87-97%
of requests got uvicorn's bare 503 and some 200s arrived after their deadline. So the work
routes (``/memory/...`` and ``/mcp``) are admitted ``max_inflight`` at a time; up to
``queue`` more wait, each at most ``wait_s``; anything beyond is refused at once with
503 ``busy`` and ``Retry-After``. Probes (``/healthz``, ``/metrics``) are never queued.

Each client has a share: at most ``client_inflight`` of its requests in flight or waiting,
and, when ``client_rate`` is set, a token bucket of that rate and ``client_burst``. A client
is an API key (its bearer token, hashed), or the address a keyless request comes from, so
one tenant sending costly queries in parallel fills its share, gets 429 with Retry-After,
and leaves the other slots to the others (docs/benchmarks.md measures it).

The arrival time is kept in the request's state: a query's deadline counts from it
(``arrived``), so time spent queued is time spent, and no answer comes after its deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from poimen_memory.api.asgi import HttpMiddleware
from poimen_memory.errors import Busy, OverShare, PoimenError

__all__ = ["ARRIVED", "Admission", "arrived"]

ARRIVED = "poimen_arrived"
_WORK = ("/memory/", "/mcp")


def arrived(scope: Scope) -> float | None:
    """When the request reached the service (time.monotonic()), or None outside it."""
    state = scope.get("state")
    value = state.get(ARRIVED) if isinstance(state, dict) else None
    return value if isinstance(value, float) else None


def client_of(scope: Scope) -> str:
    """Whose share a request counts against: its bearer token's hash (the key is never kept),
    else the address it came from. A wrong key is a client of its own until auth refuses it."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return "key:" + hashlib.sha256(value).hexdigest()[:32]
    peer = scope.get("client")
    return f"addr:{peer[0]}" if peer else "addr:?"


@dataclass
class _Bucket:
    tokens: float
    at: float


# The most idle clients whose rate buckets are remembered; the oldest go first (a full
# bucket is what a forgotten client gets back, so forgetting one grants nothing new).
_BUCKETS = 10_000


class Admission(HttpMiddleware):
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_inflight: int,
        queue: int,
        wait_s: float,
        retry_after_s: int,
        client_inflight: int | None = None,
        client_rate: float = 0.0,
        client_burst: int = 20,
    ) -> None:
        super().__init__(app)
        self.max_inflight, self.queue, self.wait_s = max_inflight, queue, wait_s
        self.retry_after_s = retry_after_s
        self.client_inflight = client_inflight  # None: no share, the capacity alone
        self.client_rate, self.client_burst = client_rate, client_burst
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._held: dict[str, int] = {}  # per client: its requests in flight or waiting
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})[ARRIVED] = time.monotonic()
        if not str(scope.get("path", "")).startswith(_WORK):
            await self.app(scope, receive, send)
            return
        client = client_of(scope)
        over = self._over_share(client)
        if over is not None:
            await _answer(send, over, math.ceil(over.retry_after_s))
            return
        self._held[client] = self._held.get(client, 0) + 1
        try:
            if not await self._admit():
                await self._refuse(send)
                return
            try:
                await self.app(scope, receive, send)
            finally:
                self._release()
        finally:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]

    def _over_share(self, client: str) -> _Over | None:
        """Why this client may not start another request now, or None."""
        if self.client_inflight is not None and self._held.get(client, 0) >= self.client_inflight:
            return _Over(
                f"this client has {self.client_inflight} requests in flight or waiting, its "
                "share of the service",
                "wait for one to end; POIMEN_HTTP_CLIENT_INFLIGHT sets the share",
                self.retry_after_s,
            )
        if not self.client_rate:
            return None
        now = time.monotonic()
        bucket = self._buckets.pop(client, None) or _Bucket(float(self.client_burst), now)
        bucket.tokens = min(self.client_burst, bucket.tokens + (now - bucket.at) * self.client_rate)
        bucket.at = now
        self._buckets[client] = bucket  # the most recently seen last
        while len(self._buckets) > _BUCKETS:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1:
            return _Over(
                f"this client sent more than {self.client_rate:g} requests a second "
                f"(bursts of {self.client_burst})",
                "POIMEN_HTTP_CLIENT_RATE and POIMEN_HTTP_CLIENT_BURST set the rate",
                (1 - bucket.tokens) / self.client_rate,
            )
        bucket.tokens -= 1
        return None

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
        await _answer(send, err, self.retry_after_s)


class _Over(OverShare):
    """A 429 and when to try again."""

    def __init__(self, detail: str, hint: str, retry_after_s: float) -> None:
        super().__init__(detail, hint=hint)
        self.retry_after_s = retry_after_s


async def _answer(send: Send, err: PoimenError, retry_after_s: int) -> None:
    body = json.dumps(err.to_json()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.http_status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(max(1, retry_after_s)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
