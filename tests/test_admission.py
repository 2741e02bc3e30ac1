"""Graceful overload (api/admission.py): at most POIMEN_HTTP_MAX_INFLIGHT work requests at
once, up to POIMEN_HTTP_QUEUE more waiting at most POIMEN_HTTP_QUEUE_WAIT_S, the rest a fast
503 `busy` with Retry-After; a query's deadline counts from its arrival, queue included.

The middleware is driven directly over ASGI (an app that holds its requests until told),
so every interleaving is exact; the deadline and the 503s are checked on the real service."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from starlette.testclient import TestClient

from poimen_memory.api.admission import Admission, arrived
from poimen_memory.contract.query import parse_query
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import DeadlineExceeded
from service_client import serve


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
    app: Any, path: str = "/memory/query", key: str | None = None, peer: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "path": path, "method": "GET", "headers": headers,
             "client": (peer, 50000)}  # fmt: skip
    await app(scope, receive, send)
    start = sent[0]
    headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


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
        second = asyncio.create_task(_get(app))
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
