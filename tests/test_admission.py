"""Graceful overload (api/admission.py): at most POIMEN_HTTP_MAX_INFLIGHT work requests at
once, up to POIMEN_HTTP_QUEUE more waiting at most POIMEN_HTTP_QUEUE_WAIT_S, the rest a fast
503 `busy` with Retry-After; a query's deadline counts from its arrival, queue included.

The middleware is driven directly over ASGI (an app that holds its requests until told),
so every interleaving is exact; the deadline and the 503s are checked on the real service."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from starlette.testclient import TestClient

from poimen_lab.live_server import live_server
from poimen_memory.api.admission import Admission, Cost, arrived, client_of
from poimen_memory.contract.query import parse_query
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import ConfigError, DeadlineExceeded
from poimen_memory.settings import Settings
from service_client import make_key, serve


class Held:
    """An ASGI app that answers 200 once ``release`` is set, recording what it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.arrivals: list[float | None] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.started += 1
        self.arrivals.append(arrived(scope))
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _get(
    app: Any,
    path: str = "/memory/query",
    key: str | None = None,
    peer: str = "127.0.0.1",
    query: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "path": path, "method": "GET", "headers": headers,
             "client": (peer, 50000), "query_string": urlencode(query or {}).encode()}  # fmt: skip
    await app(scope, receive, send)
    start = sent[0]
    answered = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], answered, b"".join(m.get("body", b"") for m in sent[1:])


def _admission(held: Held, **kw: Any) -> Admission:
    opts = {"max_inflight": 1, "queue": 0, "wait_s": 5.0, "retry_after_s": 2} | kw
    return Admission(held, **opts)


def test_beyond_capacity_the_answer_is_a_fast_typed_503_with_retry_after() -> None:
    async def run() -> None:
        held = Held()
        app = _admission(held)
        first = asyncio.create_task(_get(app))
        await asyncio.sleep(0.01)
        status, headers, body = await _get(app)
        # Refused while the slot is still taken: it waited for nothing (queue 0).
        assert not first.done() and held.started == 1
        assert status == 503 and headers["retry-after"] == "2"
        err = json.loads(body)
        assert err["error"] == "busy" and "POIMEN_HTTP_MAX_INFLIGHT" in err["hint"]
        held.release.set()
        assert (await first)[0] == 200
        assert app.inflight == 0

    asyncio.run(run())


def test_a_queued_request_runs_when_a_slot_frees_and_in_arrival_order() -> None:
    async def run() -> None:
        held = Held()
        app = _admission(held, queue=2)
        tasks = [asyncio.create_task(_get(app)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert held.started == 1 and len(app._waiters) == 2
        held.release.set()
        assert [(await t)[0] for t in tasks] == [200, 200, 200]
        assert held.started == 3 and app.inflight == 0
        # Arrival is stamped before the queue: later requests arrived later, not when admitted.
        stamps = [a for a in held.arrivals if a is not None]
        assert len(stamps) == 3 and stamps == sorted(stamps)

    asyncio.run(run())


def test_a_wait_is_bounded_and_gives_its_place_back() -> None:
    async def run() -> None:
        held = Held()
        app = _admission(held, queue=1, wait_s=0.1)
        first = asyncio.create_task(_get(app))
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        second = asyncio.create_task(_get(app, peer="10.0.0.2"))  # another client
        await asyncio.sleep(0.02)
        assert len(app._waiters) == 1  # queued, waiting
        status, headers, _ = await second
        assert status == 503 and "retry-after" in headers
        # It gave up after its wait (a lower bound cannot flake), not when the slot freed.
        assert time.monotonic() - t0 >= 0.09 and not first.done()
        assert not app._waiters and app.inflight == 1
        held.release.set()
        await first
        assert app.inflight == 0

    asyncio.run(run())


def test_a_client_that_leaves_the_queue_leaks_no_slot() -> None:
    async def run() -> None:
        held = Held()
        app = _admission(held, queue=2)
        first = asyncio.create_task(_get(app))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(_get(app))
        await asyncio.sleep(0.01)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        held.release.set()
        await first
        assert app.inflight == 0 and not app._waiters
        held.release = asyncio.Event()
        later = asyncio.create_task(_get(app))
        await asyncio.sleep(0.01)
        assert app.inflight == 1  # the slot is there to take
        held.release.set()
        assert (await later)[0] == 200

    asyncio.run(run())


def test_probes_are_never_queued() -> None:
    async def run() -> None:
        held = Held()
        app = _admission(held)
        first = asyncio.create_task(_get(app))
        await asyncio.sleep(0.01)
        probe = asyncio.create_task(_get(app, "/healthz"))
        await asyncio.sleep(0.01)
        assert held.started == 2  # admitted past the full work queue
        held.release.set()
        assert (await probe)[0] == 200 and (await first)[0] == 200

    asyncio.run(run())


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


def test_a_query_deadline_counts_from_its_arrival(client: TestClient) -> None:
    """A request that waited its whole timeout in the queue is answered 503 at once, with
    Retry-After, instead of doing the work and answering after its deadline."""
    state = client.app.state.poimen  # type: ignore[attr-defined]
    req = parse_query({"query": "kong body buffer", "timeout_seconds": "1"}, state.settings)
    retriever = state.retriever
    assert client.portal is not None
    before = retriever.cache.stats()
    with pytest.raises(DeadlineExceeded):
        client.portal.call(
            partial(retriever.query, req.model_copy(), started=time.monotonic() - 1.5)
        )
    # Refused before any work: not even the query's embedding was looked up.
    assert retriever.cache.stats() == before
    body = client.portal.call(partial(retriever.query, req, started=time.monotonic()))
    assert body["results"] and retriever.cache.stats()["misses"] == before["misses"] + 1


def test_a_client_beyond_its_share_gets_429_and_the_others_are_served() -> None:
    """Per key (and per address without one): a client holding its share of the slots is
    refused 429 with Retry-After at once, while another key and another address still get
    the free slots."""

    async def run() -> None:
        held = Held()
        app = _admission(held, max_inflight=8, client_inflight=2)
        mine = [asyncio.create_task(_get(app, key="costly")) for _ in range(2)]
        await asyncio.sleep(0.01)
        status, headers, body = await _get(app, key="costly")
        assert status == 429 and headers["retry-after"] == "2"
        err = json.loads(body)
        assert err["error"] == "too_many_requests"
        assert "POIMEN_HTTP_CLIENT_INFLIGHT" in err["hint"]
        others = [
            asyncio.create_task(_get(app, key="other")),
            asyncio.create_task(_get(app, peer="10.0.0.7")),
        ]
        await asyncio.sleep(0.01)
        assert held.started == 4  # both others run beside the costly key's two
        held.release.set()
        assert [(await t)[0] for t in mine + others] == [200] * 4
        assert app.inflight == 0 and app._held == {}

    asyncio.run(run())


def test_a_client_over_its_rate_gets_429_until_its_bucket_refills() -> None:
    async def run() -> None:
        held = Held()
        held.release.set()
        app = _admission(held, max_inflight=8, client_rate=0.5, client_burst=2)
        assert [(await _get(app, key="k"))[0] for _ in range(2)] == [200, 200]
        status, headers, body = await _get(app, key="k")
        # Empty at 0.5 a second: the next token is about 2 s away.
        assert status == 429 and headers["retry-after"] == "2"
        assert "POIMEN_HTTP_CLIENT_RATE" in json.loads(body)["hint"]
        assert (await _get(app, key="another"))[0] == 200

    asyncio.run(run())


# --- the share by cost ---------------------------------------------------------------------

NORMAL = {"query": "why do uploads fail"}
# As dear as the contract allows: ~1,950 characters of text, 50 results, 100 cited turns.
DEAR = {"query": " ".join(f"word{i:04d}" for i in range(216)), "limit": "50", "evidence": "100"}


def test_the_cost_of_a_request_is_what_it_declares() -> None:
    cost = Cost()

    def of(method: str = "GET", headers: Any = (), **params: str) -> float:
        scope = {"method": method, "headers": list(headers),
                 "query_string": urlencode(params).encode()}  # fmt: skip
        return cost.of(scope)

    normal, dear = of(**NORMAL), of(**DEAR)
    assert 1.0 < normal < 1.2 and dear > 8 * normal
    assert of(query="x" * 100, limit="50") > of(query="x" * 100) > of(query="x")
    assert of(query="x", evidence="100") > of(query="x")
    # A malformed value costs nothing extra (the contract refuses it later).
    assert of(query="x", limit="\u0661\u0660\u0660") == of(query="x", limit="lots") == of(query="x")
    # HEAD runs the GET route whole: charged as the GET (it was base alone).
    assert of("HEAD", **DEAR) == dear
    # A body (a write, an MCP call) is charged by its length, as text; a chunked one, which
    # declares none, as the longest, not as base alone; none at all (a DELETE), base.
    empty = of("POST", [(b"content-length", b"0")])
    assert of("POST", [(b"content-length", b"2000")]) > empty == of("DELETE") == cost.base
    chunked = of("POST", [(b"transfer-encoding", b"chunked")])
    assert chunked == of("POST", [(b"content-length", b"9000000")]) > empty
    # ... at most as the longest query text: a bulk write is bounded by the ingest queue.
    assert of("POST", [(b"content-length", b"9000000")]) <= of(query="x" * 2000)
    assert Settings.from_env({"POIMEN_HTTP_COST": "char=0.002, base=0.5"}).http_cost == Cost(
        base=0.5, char=0.002
    )
    for bad in ("chars=1", "char", "char=-1", "char=inf"):
        with pytest.raises(ConfigError, match="POIMEN_HTTP_COST"):
            Settings.from_env({"POIMEN_HTTP_COST": bad})


def test_a_client_is_its_key_however_the_header_spells_it() -> None:
    """Admission counted the header's raw bytes: every spelling auth accepts of one key
    (the scheme's case, extra spaces) was a client of its own, and in anonymous mode any
    junk token was one more client (a helper's attack)."""

    def who(auth: bytes | None, anonymous: bool | None = False, peer: str = "10.0.0.1") -> str:
        headers = [] if auth is None else [(b"authorization", auth)]
        return client_of({"headers": headers, "client": (peer, 5000)}, anonymous)

    key = who(b"Bearer pmk_abc")
    assert key.startswith("key:")
    assert {who(b"bearer pmk_abc"), who(b"BEARER   pmk_abc"), who(b"Bearer pmk_abc  ")} == {key}
    assert who(b"Bearer pmk_other") != key
    # no key exists: a token names nobody, the address does
    assert who(b"Bearer junk1", anonymous=True) == who(b"Bearer junk2", anonymous=True)
    assert who(b"Bearer junk1", anonymous=True) == who(None) == "addr:10.0.0.1"
    # a header that is no bearer token: the address
    assert who(b"Basic dXNlcjpwdw==") == "addr:10.0.0.1"


class Gate:
    """An ASGI app that answers at once, but holds the requests of the keys in ``hold``
    until their event is set: who is in flight is exactly what the test says."""

    def __init__(self) -> None:
        self.hold: dict[str, asyncio.Event] = {}
        self.started: Counter[str] = Counter()
        self.tasks: list[asyncio.Task[tuple[int, dict[str, str], bytes]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        key = auth.removeprefix("Bearer ")
        self.started[key] += 1
        if key in self.hold:
            await self.hold[key].wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def held(self, key: str) -> asyncio.Event:
        self.hold[key] = asyncio.Event()
        return self.hold[key]


def _fair(app: Any, **kw: Any) -> Admission:
    opts = {"max_inflight": 16, "client_inflight": 8, "fair_share": 1.0, "fair_floor": 2.0,
            "fair_window_s": 5.0} | kw  # fmt: skip
    return _admission(app, **opts)


async def _busy(app: Admission, gate: Gate, key: str, answered: int = 12) -> asyncio.Event:
    """``key`` as a normal tenant that is using the service: ``answered`` questions (about
    2.6 units a second over the 5 s window, over the floor), then two in flight, held until
    the event returned is set."""
    for _ in range(answered):
        assert (await _get(app, key=key, query=NORMAL))[0] == 200
    release = gate.held(key)
    gate.tasks += [asyncio.create_task(_get(app, key=key, query=NORMAL)) for _ in range(2)]
    await asyncio.sleep(0.01)
    return release


def test_a_client_dearer_than_its_share_gets_429_while_the_others_are_served() -> None:
    """One key's dear queries while another key has requests in flight: beyond its even
    share of the slots it may hold one request, and use no more than the busy key's cost
    rate (POIMEN_HTTP_FAIR_SHARE=1); past either it is refused 429 with Retry-After, and
    the normal key goes on being served."""

    async def run() -> None:
        gate = Gate()
        app = _fair(gate)
        release = await _busy(app, gate, "normal")
        # One dear query in flight (held): a second one is refused at once.
        dear_release = gate.held("dear")
        first = asyncio.create_task(_get(app, key="dear", query=DEAR))
        await asyncio.sleep(0.01)
        status, headers, body = await _get(app, key="dear", query=DEAR)
        assert status == 429 and headers["retry-after"] == "2", (status, body)
        err = json.loads(body)
        assert err["error"] == "too_many_requests" and "POIMEN_HTTP_FAIR_SHARE" in err["hint"]
        assert "in flight" in err["detail"]
        dear_release.set()
        assert (await first)[0] == 200
        # Answered one at a time, its rate passes the normal key's (~2.6 units a second):
        # refused with the time its rate takes to fall back under.
        del gate.hold["dear"]
        statuses = []
        for _ in range(3):
            status, headers, body = await _get(app, key="dear", query=DEAR)
            statuses.append(status)
        assert statuses[-1] == 429, statuses
        assert "times the busiest other" in json.loads(body)["detail"]
        assert 1 <= int(headers["retry-after"]) <= 5
        # The normal key is admitted meanwhile (a third request in flight); and another
        # address is served (anonymous clients are told apart by address).
        gate.tasks.append(asyncio.create_task(_get(app, key="normal", query=NORMAL)))
        await asyncio.sleep(0.01)
        assert gate.started["normal"] == 15
        assert (await _get(app, peer="10.0.0.9", query=NORMAL))[0] == 200
        # Once the normal key has nothing in flight, the dear key is alone: served.
        release.set()
        assert {(await t)[0] for t in gate.tasks} == {200}
        assert (await _get(app, key="dear", query=DEAR))[0] == 200
        assert app._held == {} and app._held_cost == {}

    asyncio.run(run())


def test_a_client_alone_or_taking_turns_is_never_held_by_cost() -> None:
    """Work-conserving: a client alone, however dear its requests and however many at once,
    and clients taking turns (each busy while the other is idle, as two MCP clients one
    after the other) are never refused by the share by cost."""

    async def run() -> None:
        gate = Gate()
        app = _fair(gate)
        statuses: list[int] = []
        # Alone: twenty dear queries one after the other, then eight at once.
        statuses += [(await _get(app, key="batch", query=DEAR))[0] for _ in range(20)]
        release = gate.held("batch")
        eight = [asyncio.create_task(_get(app, key="batch", query=DEAR)) for _ in range(8)]
        await asyncio.sleep(0.01)
        assert gate.started["batch"] == 28
        release.set()
        statuses += [(await t)[0] for t in eight]
        # Two clients taking turns, each with several requests in flight, dear or not, the
        # other idle: the rates they leave behind hold no one back.
        for turn in range(6):
            key, query = ("a", DEAR) if turn % 2 else ("b", NORMAL)
            release = gate.held(key)
            burst = [asyncio.create_task(_get(app, key=key, query=query)) for _ in range(6)]
            await asyncio.sleep(0.01)
            release.set()
            statuses += [(await t)[0] for t in burst]
            del gate.hold[key]
        # Over MCP (a POST charged by its body's length), the same.
        for turn in range(6):
            key = "mcp-a" if turn % 2 else "mcp-b"
            statuses += [(await _post(app, key, 1_900))[0] for _ in range(10)]
        assert set(statuses) == {200}, statuses
        # Beside a client with a request in flight but under the floor (a query now and
        # then): still none refused.
        trickle = gate.held("trickle")
        gate.tasks.append(asyncio.create_task(_get(app, key="trickle", query=NORMAL)))
        await asyncio.sleep(0.01)
        assert {(await _get(app, key="batch", query=DEAR))[0] for _ in range(20)} == {200}
        trickle.set()
        assert {(await t)[0] for t in gate.tasks} == {200}
        # Off (POIMEN_HTTP_FAIR_SHARE=0): never, whoever else is busy.
        off_gate = Gate()
        off = _fair(off_gate, fair_share=0.0)
        release = await _busy(off, off_gate, "normal")
        assert {(await _get(off, key="dear", query=DEAR))[0] for _ in range(20)} == {200}
        release.set()
        assert {(await t)[0] for t in off_gate.tasks} == {200}

    asyncio.run(run())


def test_busy_equal_clients_hold_each_other_to_nothing() -> None:
    """Three clients asking questions two at a time each, side by side, as three normal
    tenants do: always contended, yet within their even share of the slots, so none is
    refused, whatever their rates."""

    async def run() -> None:
        app = _fair(Stepper())

        async def tenant(key: str) -> list[int]:
            return [(await _get(app, key=key, query=NORMAL))[0] for _ in range(40)]

        runs = await asyncio.gather(*(tenant(k) for k in "aabbcc"))
        assert {s for statuses in runs for s in statuses} == {200}

    asyncio.run(run())


class Stepper:
    """An ASGI app whose requests take a few turns of the event loop: concurrent clients
    overlap."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _post(app: Any, key: str, length: int) -> tuple[int, bytes]:
    """A POST to /mcp whose body is ``length`` bytes, as an MCP call is charged."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"x" * length, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode()),
               (b"content-length", str(length).encode())]  # fmt: skip
    scope = {"type": "http", "path": "/mcp", "method": "POST", "headers": headers,
             "client": ("127.0.0.1", 50000), "query_string": b""}  # fmt: skip
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_on_the_real_server_the_dear_key_gets_429_and_the_other_key_200(
    fixture_url: str, tmp_path: Path
) -> None:
    """Real HTTP to `poimen-memory serve` with the default share: a key sending dear
    queries in parallel is served in full alone; while another key asks questions two at
    a time, it is refused 429 with Retry-After and the other key gets only 200s. A window
    of a minute and a low floor make the rates independent of how fast this machine is;
    the rounds bound how long the test tries, nothing is timed."""
    normal, dear = make_key(fixture_url, ["poimen"]), make_key(fixture_url, ["poimen"])
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_FAIR_WINDOW_S": "60",
           "POIMEN_HTTP_FAIR_FLOOR": "0.05"}  # fmt: skip
    slow = {**DEAR, "timeout_seconds": "30"}
    with live_server(env, tmp_path / "server.log") as url, ThreadPoolExecutor(6) as pool:

        def get(key: str, params: dict[str, str]) -> httpx.Response:
            return httpx.get(f"{url}/memory/query", params=params, timeout=60,
                             headers={"Authorization": f"Bearer {key}"})  # fmt: skip

        def parallel(key: str, params: dict[str, str], n: int) -> list[httpx.Response]:
            return list(pool.map(lambda _: get(key, params), range(n)))

        # Alone: dear queries in parallel, beyond any even share, all served.
        assert [r.status_code for r in parallel(dear, slow, 3)] == [200] * 3
        # Beside a busy normal key (two questions at a time): the dear key gets 429s.
        stop, seen = threading.Event(), Counter[int]()

        def ask() -> None:
            while not stop.is_set():
                seen[get(normal, NORMAL).status_code] += 1

        askers = [pool.submit(ask) for _ in range(2)]
        refused: list[httpx.Response] = []
        for _ in range(20):
            refused = [r for r in parallel(dear, slow, 3) if r.status_code != 200]
            if refused:
                break
        stop.set()
        for asker in askers:
            asker.result()
        assert refused, "the dear key was never refused"
        for r in refused:
            assert r.status_code == 429 and r.json()["error"] == "too_many_requests", r.text
            assert int(r.headers["retry-after"]) >= 1, r.headers
        assert set(seen) == {200} and seen[200] > 0, seen
        # The normal key idle again: the dear key is alone, and served.
        assert get(dear, slow).status_code == 200
