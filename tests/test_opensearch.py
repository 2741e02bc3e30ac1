"""The OpenSearch engine, outbox drainer and reindex, against the REST double in
tests/doubles (no OpenSearch server can be installed on the build machines)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from doubles.opensearch_server import OpenSearchServer, run_opensearch_server
from poimen_memory.db.queries import q
from poimen_memory.errors import OpenSearchUnavailable
from poimen_memory.ingest.outbox import SyncReport, reindex, sync_outbox
from poimen_memory.settings import Settings
from poimen_memory.upstreams.opensearch import (
    OpenSearchEngine,
    engine_from_settings,
    search_body,
)

INDEX = "poimen-test"

Conn = psycopg.Connection[Any]


@pytest.fixture
def server() -> Iterator[OpenSearchServer]:
    with run_opensearch_server() as s:
        yield s


@pytest.fixture
def engine(server: OpenSearchServer) -> Iterator[OpenSearchEngine]:
    with OpenSearchEngine(server.url, INDEX, timeout_s=1.0, bulk_timeout_s=2.0) as e:
        yield e


def enqueue_all(conn: Conn) -> int:
    cur = conn.execute(
        "INSERT INTO memory.opensearch_outbox (node_id, op) SELECT id, 'index' FROM memory.nodes"
    )
    return cur.rowcount


def drain(conn: Conn, engine: OpenSearchEngine, **kw: Any) -> SyncReport:
    return sync_outbox(conn, engine, backoff_base_s=0.01, progress=False, **kw)


def outbox(conn: Conn) -> list[tuple[int, str, int, str | None]]:
    sql = "SELECT node_id, op, attempts, last_error FROM memory.opensearch_outbox ORDER BY id"
    return conn.execute(sql).fetchall()


def shas(conn: Conn) -> set[str]:
    return {r[0] for r in conn.execute("SELECT encode(sha256, 'hex') FROM memory.nodes")}


def sha_of(conn: Conn, where: str) -> str:
    row = conn.execute(f"SELECT encode(sha256, 'hex') FROM memory.nodes WHERE {where} LIMIT 1")
    return str(row.fetchone()[0])  # type: ignore[index]


def test_ensure_index_creates_the_seed_mapping(server: OpenSearchServer, engine: OpenSearchEngine):
    assert engine.ensure_index() is True
    assert engine.ensure_index() is False
    puts = [r for r in server.requests if r.method == "PUT"]
    assert [r.path for r in puts] == [f"/{INDEX}"]
    props = puts[0].body["mappings"]["properties"]
    assert props["content"] == {
        "type": "text",
        "analyzer": "english",
        "fields": {"exact": {"type": "text", "analyzer": "standard"}},
    }
    assert props["section_title"]["type"] == props["breadcrumb"]["type"] == "text"
    assert props["source"]["type"] == "text"
    assert props["source"]["fields"]["keyword"]["type"] == "keyword"
    for name in ("project_id", "level", "sha256"):
        assert props[name] == {"type": "keyword"}


def test_sync_drains_the_outbox(conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine):
    conn.execute(
        "UPDATE memory.nodes SET breadcrumb = '{Runbooks,Kong}' WHERE external_id = 'poimen:mem:1'"
    )
    n = enqueue_all(conn)
    report = drain(conn, engine, batch_size=5)
    assert (report.indexed, report.failed, report.remaining, report.stopped) == (n, 0, 0, None)
    assert outbox(conn) == []
    assert set(server.docs(INDEX)) == shas(conn)
    assert len(server.requests_to("/_bulk")) == -(-n // 5)
    text, title, source = conn.execute(
        "SELECT text, title, source FROM memory.nodes WHERE external_id = 'poimen:chat:2'"
    ).fetchone()  # type: ignore[misc]
    assert server.docs(INDEX)[sha_of(conn, "external_id = 'poimen:chat:2'")] == {
        "content": text,
        "section_title": title,
        "breadcrumb": "",
        "source": source,
        "project_id": "poimen",
        "level": "L0",
        "sha256": sha_of(conn, "external_id = 'poimen:chat:2'"),
    }
    mem = server.docs(INDEX)[sha_of(conn, "external_id = 'poimen:mem:1'")]
    assert (mem["breadcrumb"], mem["level"]) == ("Runbooks > Kong", "L1")


def test_outage_loses_nothing_and_a_later_sync_catches_up(
    conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine
):
    n = enqueue_all(conn)
    server.down = True
    report = drain(conn, engine, batch_size=8, max_attempts=3)
    assert report.stopped is not None and "503" in report.stopped
    assert (report.indexed, report.remaining) == (0, n)
    rows = outbox(conn)
    assert len(rows) == n
    # The first batch was tried three times; the run then stopped before touching the rest.
    assert all(a == 3 and e is not None and "503" in e for _, _, a, e in rows[:8])
    assert all(a == 0 and e is None for _, _, a, e in rows[8:])

    server.down = False
    report = drain(conn, engine, batch_size=8)
    assert (report.indexed, report.remaining, report.stopped) == (n, 0, None)
    assert set(server.docs(INDEX)) == shas(conn)


def test_transient_failures_are_retried_with_backoff(
    conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine
):
    n = enqueue_all(conn)
    server.fail_next(2, 503)
    started = time.monotonic()
    report = sync_outbox(conn, engine, max_attempts=4, backoff_base_s=0.1, progress=False)
    assert time.monotonic() - started >= 0.1 + 0.2
    assert (report.indexed, report.remaining, report.stopped) == (n, 0, None)


def test_item_failures_stay_queued_with_their_error(
    conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine
):
    n = enqueue_all(conn)
    bad = sha_of(conn, "external_id = 'poimen:chat:1'")
    busy = sha_of(conn, "external_id = 'poimen:chat:3'")
    server.fail_item(bad, 400, "mapper_parsing_exception")
    server.fail_item(busy, 429, "rejected_execution_exception", times=1)
    report = drain(conn, engine)
    assert (report.indexed, report.failed, report.remaining) == (n - 1, 1, 1)
    # Only the 429 item was worth a second try within the run.
    retry = server.requests_to("/_bulk")[-1].body
    assert retry == [{"index": {"_id": busy}}, server.docs(INDEX)[busy]]
    [(_, _, attempts, error)] = outbox(conn)
    assert attempts == 1 and error is not None and "400 mapper_parsing_exception" in error
    assert bad not in server.docs(INDEX)

    del server.item_failures[bad]
    report = drain(conn, engine)
    assert (report.indexed, report.remaining) == (1, 0)
    assert set(server.docs(INDEX)) == shas(conn)


def test_delete_ops_and_rows_for_vanished_nodes(
    conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine
):
    enqueue_all(conn)
    drain(conn, engine)
    gone = sha_of(conn, "external_id = 'atlas:mem:1'")
    conn.execute(
        "INSERT INTO memory.opensearch_outbox (node_id, op) SELECT id, 'delete' "
        "FROM memory.nodes WHERE external_id = 'atlas:mem:1'"
    )
    conn.execute(
        "INSERT INTO memory.opensearch_outbox (node_id, op) VALUES (-1, 'index'), (-2, 'delete')"
    )
    report = drain(conn, engine)
    assert (report.deleted, report.skipped, report.remaining) == (1, 2, 0)
    assert gone not in server.docs(INDEX)


def test_reindex_rebuilds_from_postgres(
    conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine
):
    engine.ensure_index()
    server.indices[INDEX].docs["stale"] = {"content": "left over"}
    server.requests.clear()
    n = reindex(conn, engine, batch_size=4, progress=False)
    assert n == len(shas(conn)) == 21
    assert set(server.docs(INDEX)) == shas(conn)
    calls = [(r.method, r.path) for r in server.requests]
    assert calls[:3] == [("DELETE", f"/{INDEX}"), ("HEAD", f"/{INDEX}"), ("PUT", f"/{INDEX}")]
    assert len(server.requests_to("/_bulk")) == 6 and calls[-1] == ("POST", f"/{INDEX}/_refresh")


def test_search_sends_the_seed_body_and_hits_map_to_postgres(
    conn: Conn, server: OpenSearchServer, engine: OpenSearchEngine
):
    reindex(conn, engine, progress=False)
    hits = engine.search("kong body buffer", "poimen", ["L0", "L1"], 5, 1.0)
    [req] = server.requests_to("/_search")
    assert req.params == {"_source": "false"}
    assert req.body == {
        "size": 5,
        "query": {
            "bool": {
                "must": [
                    {
                        "multi_match": {
                            "query": "kong body buffer",
                            "fields": ["content^2", "section_title^1.5", "breadcrumb", "source"],
                            "fuzziness": "AUTO",
                        }
                    }
                ],
                "filter": [{"term": {"project_id": "poimen"}}, {"terms": {"level": ["L0", "L1"]}}],
            }
        },
    }
    assert hits and [h.rank for h in hits] == list(range(1, len(hits) + 1))
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    ids = {
        key: node_id
        for node_id, key in conn.execute(
            q("ids_for_sha256"), {"shas": [bytes.fromhex(h.sha256) for h in hits]}
        ).fetchall()
    }
    assert set(ids) == {h.sha256 for h in hits}
    rows = conn.execute(
        "SELECT p.name, n.level FROM memory.nodes n JOIN memory.projects p "
        "ON p.id = n.project_id WHERE n.id = ANY(%s)",
        [list(ids.values())],
    )
    assert {r for r in rows} <= {("poimen", "L0"), ("poimen", "L1")}

    unfiltered = engine.search("kong body buffer", None, None, 50, 1.0)
    assert server.requests_to("/_search")[-1].body["query"]["bool"]["filter"] == []
    projects = {
        r[0]
        for r in conn.execute(
            "SELECT p.name FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id "
            "WHERE encode(n.sha256, 'hex') = ANY(%s)",
            [[h.sha256 for h in unfiltered]],
        )
    }
    assert projects == {"poimen", "atlas"}


def test_search_body_is_pure_and_filters_are_optional():
    body = search_body("q", None, None, 3)
    assert body["size"] == 3 and body["query"]["bool"]["filter"] == []
    assert search_body("q", "atlas", None, 3)["query"]["bool"]["filter"] == [
        {"term": {"project_id": "atlas"}}
    ]
    assert search_body("q", None, ["L2"], 3)["query"]["bool"]["filter"] == [
        {"terms": {"level": ["L2"]}}
    ]


def test_asearch_runs_in_a_thread(conn: Conn, engine: OpenSearchEngine):
    reindex(conn, engine, progress=False)
    sync = engine.search("kong", "atlas", None, 3, 1.0)
    assert asyncio.run(engine.asearch("kong", "atlas", None, 3, 1.0)) == sync != []


def test_search_failures_are_typed_and_never_retried(
    server: OpenSearchServer, engine: OpenSearchEngine
):
    with pytest.raises(OpenSearchUnavailable) as missing:
        engine.search("kong", None, None, 3, 1.0)
    assert (missing.value.status, missing.value.tag) == (404, "http_404")
    engine.ensure_index()
    server.fail_next(1, 503)
    before = len(server.requests)
    with pytest.raises(OpenSearchUnavailable) as busy:
        engine.search("kong", None, None, 3, 1.0)
    assert busy.value.status == 503 and len(server.requests) == before + 1
    server.delay_s = 5.0
    started = time.monotonic()
    with pytest.raises(OpenSearchUnavailable, match="timed out") as late:
        engine.search("kong", None, None, 3, 0.2)
    assert late.value.reason == "timeout"
    assert time.monotonic() - started < 3.0  # the 0.2 s timeout, not the 5 s delay


def test_healthy_is_false_when_down_and_never_raises(
    server: OpenSearchServer, engine: OpenSearchEngine
):
    assert engine.healthy(0.5)
    server.health_status = "red"
    assert not engine.healthy(0.5)
    server.health_status, server.down = "green", True
    assert not engine.healthy(0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with OpenSearchEngine(f"http://127.0.0.1:{port}", INDEX) as dead:
            assert not dead.healthy(0.5)
            with pytest.raises(OpenSearchUnavailable, match="connection failed") as refused:
                dead.bulk_delete(["00" * 32])
            assert refused.value.reason == "transport"


def test_engine_from_settings():
    assert engine_from_settings(Settings.from_env({}).opensearch) is None
    env = {
        "POIMEN_OPENSEARCH_URL": "http://127.0.0.1:9",
        "POIMEN_OPENSEARCH_INDEX": "x",
        "POIMEN_OPENSEARCH_TIMEOUT_S": "0.7",
        "POIMEN_OPENSEARCH_BULK_TIMEOUT_S": "9",
    }
    engine = engine_from_settings(Settings.from_env(env).opensearch)
    assert engine is not None
    with engine:
        assert (engine.index, engine.timeout_s, engine.bulk_timeout_s) == ("x", 0.7, 9.0)


def test_triggers_queue_every_change_and_the_service_drains_them(
    fixture_url: str, conn: Conn, server: OpenSearchServer, embedder: Any
) -> None:
    """Writes made any way (HTTP, a DBA's UPDATE or DELETE) reach OpenSearch through the
    trigger-filled outbox, drained by the running service in the background."""
    from service_client import serve

    env = {
        "POIMEN_DATABASE_URL": fixture_url,
        "POIMEN_OPENSEARCH_URL": server.url,
        "POIMEN_OPENSEARCH_INDEX": INDEX,
        "POIMEN_OPENSEARCH_DRAIN_INTERVAL_S": "0.2",
        "POIMEN_HEALTH_CACHE_S": "0",
    }

    def wait_for(check: Any) -> bool:
        # Bounded: 30 s at most. The drain runs every 0.2 s, but a clean-clone CI run of the
        # whole suite on two cores once took longer than the 10 s this allowed (2026-12-07).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.1)
        return False

    with serve(env, embedder) as client:
        node = {"id": "fresh", "level": "L0", "project": "poimen", "text": "a brand new turn"}
        assert client.post("/memory/nodes", json=[node]).status_code == 201
        sha = sha_of(conn, "external_id = 'fresh'")
        assert wait_for(lambda: sha in server.docs(INDEX))
        conn.execute("UPDATE memory.nodes SET title = 'renamed' WHERE external_id = 'fresh'")
        assert wait_for(lambda: server.docs(INDEX)[sha].get("section_title") == "renamed")
        conn.execute("UPDATE memory.nodes SET embedding = embedding WHERE external_id = 'fresh'")
        # A new content hash is a new document: the old one is deleted, the new one indexed.
        conn.execute("UPDATE memory.nodes SET sha256 = sha256(sha256) WHERE external_id = 'fresh'")
        new_sha = sha_of(conn, "external_id = 'fresh'")
        assert wait_for(lambda: new_sha in server.docs(INDEX) and sha not in server.docs(INDEX))
        sha = new_sha
        conn.execute("DELETE FROM memory.nodes WHERE external_id = 'fresh'")
        assert wait_for(lambda: sha not in server.docs(INDEX))
        assert wait_for(lambda: outbox(conn) == [])
        health = client.get("/healthz").json()["checks"]["database"]["outbox"]
    assert health == {"depth": 0, "lag_s": 0.0}


def test_without_opensearch_the_triggers_queue_nothing(conn: Conn) -> None:
    conn.execute("DELETE FROM memory.nodes WHERE external_id = 'poimen:chat:1'")
    assert outbox(conn) == []
