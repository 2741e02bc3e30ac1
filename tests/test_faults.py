"""Faults answered within the deadline: the database stopped and started again under the
running service (no restart of the service), and no task left with an unretrieved error."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from conftest import FIXTURE, free_port
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest
from service_client import KONG, serve


@pytest.fixture
def own_cluster(work_dir: Path, embedder: LocalEmbedder) -> Iterator[Cluster]:
    """A cluster of its own, so stopping it disturbs no other test."""
    c = Cluster(work_dir / "fault-data", work_dir / "fault-run", free_port(), find_pg_bin())
    c.start(fast=True)
    with connect(c.url(), autocommit=True) as conn:
        migrate(conn, work_dir / "plpython")
        records, _ = parse_lines(FIXTURE.read_text().splitlines())
        ingest(conn, records, embedder, progress=False)
    yield c
    c.destroy()


def _get(client: TestClient) -> tuple[int, str, float]:
    started = time.monotonic()
    r = client.get("/memory/query", params={"query": KONG, "timeout_seconds": 5})
    return r.status_code, r.json().get("error", ""), time.monotonic() - started


def test_a_stopped_database_is_503_at_once_and_the_service_recovers(
    own_cluster: Cluster, embedder: LocalEmbedder
) -> None:
    with serve({"POIMEN_DATABASE_URL": own_cluster.url()}, embedder) as client:
        assert _get(client)[0] == 200
        own_cluster.stop()
        down = [_get(client) for _ in range(3)]
        # Every 503 says when to try again (Retry-After, POIMEN_HTTP_RETRY_AFTER_S).
        retry_after = client.get("/memory/query", params={"query": KONG}).headers["retry-after"]
        health = client.get("/healthz")
        own_cluster.start(fast=True)
        back = None
        for _ in range(20):  # bounded: the pool reconnects within a few seconds
            back = _get(client)
            if back[0] == 200:
                break
            time.sleep(0.25)
    for status, error, elapsed in down:
        # Well before the five seconds the request allowed (about one on a quiet machine;
        # the bound leaves room for a loaded one).
        assert (status, error) == (503, "database_unavailable") and elapsed < 3.0
    assert health.status_code == 503 and health.json()["down"] == ["database"]
    assert retry_after == "1"
    assert back is not None and back[0] == 200
