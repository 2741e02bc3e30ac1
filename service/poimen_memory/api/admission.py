"""Admission: how much work the service takes on at once, whose, and a fast, typed refusal
beyond.

Past a few dozen requests in flight a query only waits longer for the same database
connections and the same cores; measured before this existed, at 63-64 connections 87-97%
of requests got uvicorn's bare 503 and some 200s arrived after their deadline. So the work
routes (``/memory/...`` and ``/mcp``) are admitted ``max_inflight`` at a time; up to
``queue`` more wait, each at most ``wait_s``; anything beyond is refused at once with 503
``busy`` and ``Retry-After``. Probes (``/healthz``, ``/metrics``) are never queued.

Each client has a share: at most ``client_inflight`` of its requests in flight or waiting,
and, when ``client_rate`` is set, a token bucket of that rate and ``client_burst``. A client
is an API key (its bearer token, hashed), or the address a keyless request comes from; past
its share it gets 429 with Retry-After.

A share bounds how many requests a client has, not what they cost, and one query can cost
several others (its text is embedded, one inference at a time; its results and cited
turns are serialised): one key's 16 dear queries left three normal keys 10% of their
throughput at a share of 8 (docs/benchmarks.md, "Fair admission"). So each request is also
charged a cost estimated from what it declares (``Cost``: its text's length, ``limit``,
``evidence``; a body's length), a normal query about one unit, into its client's cost rate
(units a second, decayed over ``fair_window_s``), and the service is shared by cost, as a
fair scheduler shares a processor, but only while it is contended, so it stays
work-conserving:

- the clients a request competes with are the *active* others: those with a request in
  flight or waiting right now, at ``fair_floor`` units a second or more. With none (a
  client alone, clients taking turns, a trickle beside a batch), nothing is refused by cost;
- among ``n`` active clients each has an even share of the slots, ``max_inflight / n``
  units of cost in flight or waiting (at least ``_EVEN_MIN``): a request that keeps its
  client within it is admitted (two normal queries at a time hold no one back, however the
  rates compare);
- beyond it, a client may hold one request (a dear query still runs, one at a time), and
  its cost rate may not pass ``fair_share`` times the busiest active other client's. A
  second request beyond the even share is refused 429 with Retry-After ``retry_after_s``
  (one of its own must end first); one past the rate, with the time its rate takes to fall
  back under.

Refusing at the door rather than reordering the queue: the slots are not the bottleneck
(the cores and the one-at-a-time embedder are), so a dear client kept waiting in the queue
still fills the service with its work once admitted; fair queueing over the slots kept
the normal keys 0.35-0.40 of their throughput in a pilot (docs/benchmarks.md).

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
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from poimen_core.vocabulary import QUERY_MAX_CHARS
from poimen_memory.api.asgi import HttpMiddleware
from poimen_memory.api.credentials import bearer_token
from poimen_memory.api.numbers import digits_value
from poimen_memory.errors import Busy, OverShare, PoimenError

__all__ = ["ARRIVED", "Admission", "Cost", "arrived", "client_of", "parse_cost"]

ARRIVED = "poimen_arrived"
_WORK = ("/memory/", "/mcp")


def arrived(scope: Scope) -> float | None:
    """When the request reached the service (time.monotonic()), or None outside it."""
    state = scope.get("state")
    value = state.get(ARRIVED) if isinstance(state, dict) else None
    return value if isinstance(value, float) else None


def client_of(scope: Scope, anonymous: bool | None = None) -> str:
    """Whose share a request counts against: its key's hash (the key is never kept), read
    as auth reads it (credentials.bearer_token: the raw bytes made every spelling of one
    key a client of its own), else the address it came from. In anonymous mode (no key
    exists) a token means nothing, so it names no client: one per junk token let one
    caller pose as many. A wrong key is a client of its own until auth refuses it."""
    if not anonymous:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                token = bearer_token(value.decode("latin-1"))
                if token is not None:
                    return "key:" + hashlib.sha256(token.encode("latin-1")).hexdigest()[:32]
                break  # the first Authorization header, as auth reads it
    peer = scope.get("client")
    return f"addr:{peer[0]}" if peer else "addr:?"


def _declared(value: str, cap: int) -> int:
    """A number a request declares, read as the routes read it, at most ``cap``; 0 for what
    is no number (the contract refuses it later)."""
    n = digits_value(value, cap)
    return 0 if n is None else min(n, cap)


@dataclass(frozen=True)
class Cost:
    """What a request is charged, in units of a normal query (POIMEN_HTTP_COST): ``base`` for
    any request, plus ``char`` a character of its query text (a body's byte, for a write or
    an MCP call, whose text is embedded as a query's is), ``result`` a result it asks for
    (``limit``), ``cited`` a cited turn (``evidence``). Measured one request at a time on the
    benchmark's corpus (server + database CPU, docs/benchmarks.md "Fair admission"), a
    default query costs ~37 ms, +0.42 ms a result, +0.08 ms a cited turn (``result`` and
    ``cited``), +0.042 ms a character: ``char`` 0.0011 by CPU alone. Its default is four
    times that because the embedder runs one inference at a time: a long text holds what
    every query waits for (68 ms for 1,950 characters against 5 ms for a question), and
    under load one dear query took the place of 8-10 normal ones, not the 3.8 its CPU says."""

    base: float = 1.0
    char: float = 0.0045
    result: float = 0.011
    cited: float = 0.002

    def of(self, scope: Scope) -> float:
        """An estimate from what the request declares, before anything is read but its
        query string and headers: a wrong or missing value costs nothing extra (the
        contract refuses it later)."""
        units = self.base
        # HEAD too: Starlette answers it on every GET route, running the whole query
        if scope.get("method") in ("GET", "HEAD"):
            for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
                if name == "query":
                    units += self.char * len(value)
                elif name == "limit":
                    units += self.result * _declared(value, 10_000)
                elif name == "evidence":
                    units += self.cited * _declared(value, 10_000)
        else:
            # A write's texts are embedded by the ingest workers, which POIMEN_INGEST_WORKERS
            # and _QUEUE bound on their own: a body is charged at most as the longest query
            # text, so a bulk write beside readers is not refused for its size alone.
            headers = dict(scope.get("headers", ()))
            declared = headers.get(b"content-length", b"").decode("latin-1")
            length = digits_value(declared, QUERY_MAX_CHARS)
            if length is not None:
                units += self.char * min(length, QUERY_MAX_CHARS)
            elif b"transfer-encoding" in headers:
                # A chunked body declares no length: charged as the longest, not as base
                # alone whatever it holds. (No length and no chunks: no body, base.)
                units += self.char * QUERY_MAX_CHARS
        return units


def parse_cost(raw: str) -> Cost:
    """POIMEN_HTTP_COST: ``name=value`` pairs (base, char, result, cited), comma-separated;
    the ones left out keep their defaults."""
    values: dict[str, float] = {}
    names = set(Cost.__dataclass_fields__)
    for part in filter(None, (p.strip() for p in raw.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in names:
            known = ", ".join(sorted(names))
            raise ValueError(f"{part!r}: expected name=value, the name one of {known}")
        number = float(value)
        if not number >= 0 or math.isinf(number):
            raise ValueError(f"{name} must be a finite number >= 0")
        values[name] = number
    return Cost(**values)


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class _Rate:
    """A client's cost rate (units a second) as of ``at``."""

    per_s: float
    at: float


# The most idle clients whose rate buckets are remembered; the oldest go first (a full
# bucket is what a forgotten client gets back, so forgetting one grants nothing new).
_BUCKETS = 10_000
# The least even share of the slots, in units of cost: about three questions in flight at
# once, however many clients are active (with more than max_inflight / 4 of them, a client
# asking two at a time is queued with the rest rather than refused).
_EVEN_MIN = 4.0
# What both refusals by cost tell the client.
_DEAR = "its dear requests (long texts, many results or cited turns) count for several"
_SETTINGS = "POIMEN_HTTP_FAIR_SHARE, _FLOOR and POIMEN_HTTP_COST set the share"


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
        cost: Cost | None = None,
        fair_share: float = 0.0,
        fair_floor: float = 0.0,
        fair_window_s: float = 5.0,
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
        self.cost = cost or Cost()
        # 0: no cost rate share (the behaviour before).
        self.fair_share, self.fair_floor = fair_share, fair_floor
        self.fair_window_s = fair_window_s
        self._usage: OrderedDict[str, _Rate] = OrderedDict()
        self._held_cost: dict[str, float] = {}  # per client: the cost it has in flight or waiting

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})[ARRIVED] = time.monotonic()
        if not str(scope.get("path", "")).startswith(_WORK):
            await self.app(scope, receive, send)
            return
        # The app's key ring (api/auth.py): whether any key exists, as last read.
        keys = getattr(getattr(scope.get("app"), "state", None), "keys", None)
        client = client_of(scope, None if keys is None else keys.anonymous)
        cost = self.cost.of(scope)
        over = self._over_share(client) or self._over_fair(client, cost)
        if over is not None:
            await _answer(send, over, math.ceil(over.retry_after_s))
            return
        self._held[client] = self._held.get(client, 0) + 1
        self._held_cost[client] = self._held_cost.get(client, 0.0) + cost
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
            self._held_cost[client] -= cost
            if not self._held[client]:
                del self._held[client]
                del self._held_cost[client]  # no rounding left behind

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

    def _rate(self, client: str, now: float) -> float:
        """The client's cost rate now: units a second, each charge decayed with time
        constant ``fair_window_s``."""
        usage = self._usage.get(client)
        if usage is None:
            return 0.0
        return usage.per_s * math.exp((usage.at - now) / self.fair_window_s)

    def _over_fair(self, client: str, cost: float) -> _Over | None:
        """Charges the request's cost to its client's rate, or refuses it 429 while the
        service is contended and the client is beyond its even share of the slots: when it
        already holds a request there, or its rate would pass ``fair_share`` times the
        busiest active other client's."""
        if not self.fair_share:
            return None
        now = time.monotonic()
        rate = self._rate(client, now) + cost / self.fair_window_s
        busiest, active = 0.0, 0
        for other, held in self._held.items():
            if other == client:
                continue
            # A client under the floor is neither held nor holds another back: a trickle
            # beside a batch leaves the batch the service.
            other_rate = self._rate(other, now)
            if held and other_rate >= self.fair_floor and other_rate > 0:
                busiest, active = max(busiest, other_rate), active + 1
        held_cost = self._held_cost.get(client, 0.0)
        even = max(self.max_inflight / (active + 1), _EVEN_MIN * self.cost.base)
        if active and held_cost + cost > even:
            if held_cost > 0:
                return _Over(
                    f"this client has {held_cost:.1f} units of cost in flight or waiting; "
                    f"with this request {held_cost + cost:.1f}, more than its even share "
                    f"({even:.1f}) while {active} other client{'s' if active > 1 else ''} "
                    "use the service",
                    "wait for one of its requests to end; " + _DEAR + ". " + _SETTINGS,
                    self.retry_after_s,
                )
            limit = self.fair_share * busiest
            if rate > limit:
                return _Over(
                    f"this client is using {rate:.1f} units of cost a second, more than "
                    f"{self.fair_share:g} times the busiest other client's {busiest:.1f}, "
                    f"while {active} other client{'s' if active > 1 else ''} use the service",
                    _DEAR + "; the other clients are served meanwhile. " + _SETTINGS,
                    self.fair_window_s * math.log(rate / limit),
                )
        # Charged now, before the capacity is known: a request then refused 503 still
        # counts (the service was busy with it in view), as a refused one here does not.
        self._usage.pop(client, None)
        self._usage[client] = _Rate(rate, now)  # the most recently charged last
        while len(self._usage) > _BUCKETS:
            self._usage.popitem(last=False)
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
