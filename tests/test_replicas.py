"""Read replicas: a real streaming standby of the test cluster (made by the same code as
`poimen-memory db replica start`: pg_basebackup -R), the service reading from it, and every
fallback to the primary (replica stopped, replica lagging) as a degraded entry, never a 5xx."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from starlette.testclient import TestClient

from conftest import free_port
from poimen_memory.db.cluster import Cluster
from poimen_memory.embedders.local import LocalEmbedder
from service_client import KONG, query, serve

WAIT_S = 30.0


def wait_for(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll ``probe`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def standby(cluster: Cluster) -> Iterator[Cluster]:
    base = cluster.data_dir.parent / "standby"
    s = Cluster(base / "data", base / "run", free_port(), cluster.bin_dir)
    s.make_standby_of(cluster)
    s.start(fast=True)
    yield s
    s.destroy()


@pytest.fixture
def replica_url(standby: Cluster, fixture_url: str) -> str:
    """The standby's URL for this test's database, once its creation has been replayed."""
    url = standby.url(conninfo_to_dict(fixture_url)["dbname"])

    def connects() -> bool:
        try:
            with psycopg.connect(url, connect_timeout=2) as c:
                c.execute("SELECT 1 FROM memory.nodes LIMIT 1")
            return True
        except psycopg.Error:
            return False

    wait_for("the database on the standby", connects)
    return url


def env(primary: str, replica: str, **extra: str) -> dict[str, str]:
    return {
        "POIMEN_DATABASE_URL": primary,
        "POIMEN_READ_URLS": replica,
        "POIMEN_REPLICA_CHECK_S": "0.1",
        **extra,
    }


def replica_reasons(body: dict[str, Any]) -> list[str]:
    return [d["reason"] for d in body["degraded"] if d["stage"] == "replica"]


def served_by(client: TestClient, who: str, **params: Any) -> dict[str, Any]:
    """Query until ``metrics.served_by`` is ``who`` (the monitor's next check); every answer
    on the way must be a 200."""
    return wait_for(  # type: ignore[no-any-return]
        f"served_by={who}",
        lambda: (b := query(client, **params))["metrics"]["served_by"] == who and b,
    )


def sha_order(body: dict[str, Any]) -> list[str]:
    return [r["sha256"] for r in body["results"]]


def test_the_standby_is_real(standby: Cluster, cluster: Cluster) -> None:
    with psycopg.connect(standby.url("postgres")) as c:
        assert c.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        # pg_ctl returns once the standby accepts connections, a moment before its WAL
        # receiver streams.
        wait_for(
            "the WAL receiver to stream",
            lambda: (
                c.execute("SELECT status FROM pg_stat_wal_receiver").fetchone() == ("streaming",)
            ),
        )
    with psycopg.connect(cluster.url("postgres")) as c:
        wait_for(
            "the primary to see a streaming standby",
            lambda: ("streaming",) in c.execute("SELECT state FROM pg_stat_replication").fetchall(),
        )


def test_queries_are_served_by_the_replica_and_see_a_write(
    fixture_url: str, replica_url: str, embedder: LocalEmbedder
) -> None:
    text = "The zephyr quokka runbook: restart the flux capacitor before the migration."
    with serve(env(fixture_url, replica_url), embedder) as client:
        before = served_by(client, "replica", query=KONG)
        assert replica_reasons(before) == []
        # A write goes to the primary (the replica is read-only: it would fail there).
        node = {"id": "zq-1", "level": "L1", "project": "poimen", "title": "zq", "text": text}
        response = client.post("/memory/nodes", json=[node])
        assert response.status_code == 201, response.text
        # ... and the replica answers with it once replayed.
        found = wait_for(
            "the new node on the replica",
            lambda: (
                (b := query(client, query="zephyr quokka flux capacitor"))["metrics"]["served_by"]
                == "replica"
                and any(r["text"] == text for r in b["results"])
                and b
            ),
        )
        assert replica_reasons(found) == []
        health = client.get("/healthz")
        assert health.status_code == 200
        replicas = health.json()["checks"]["replicas"]
        scrape = client.get("/metrics").text
    port = str(conninfo_to_dict(replica_url)["port"])
    assert any(
        line.startswith("poimen_replica_usable{") and port in line and line.endswith(" 1.0")
        for line in scrape.splitlines()
    ), scrape
    assert "poimen_replica_lag_seconds{" in scrape
    assert replicas["ok"] is True and replicas["max_lag_s"] == 5.0
    (server,) = replicas["servers"]
    assert server["ok"] is True and server["reason"] is None
    assert 0.0 <= server["lag_s"] <= 5.0 and server["replay_paused"] is False
    assert str(conninfo_to_dict(replica_url)["port"]) in server["server"]
    with psycopg.connect(fixture_url) as p, psycopg.connect(replica_url) as r:
        count = "SELECT count(*) FROM memory.nodes"
        assert p.execute(count).fetchone() == r.execute(count).fetchone() == (22,)


def test_a_stopped_replica_falls_back_to_the_primary(
    fixture_url: str, replica_url: str, standby: Cluster, embedder: LocalEmbedder
) -> None:
    # The monitor checks once at start-up and then not for an hour: the first query after
    # the stop is sent to the replica, fails there, and must be answered by the primary.
    slow = env(fixture_url, replica_url, POIMEN_REPLICA_CHECK_S="3600")
    try:
        with serve(slow, embedder) as client:
            # The start-up check must have found the replica fit (it is checked again only
            # in an hour); polling spares a slow first request.
            on_replica = served_by(client, "replica", query=KONG)
            standby.stop()
            for _ in range(2):  # mid-request fallback, then the replica rests
                body = query(client, query=KONG)
                assert body["metrics"]["served_by"] == "primary"
                assert replica_reasons(body) == ["failed"]
                assert sha_order(body) == sha_order(on_replica)
        # A service started while the replica is down reads from the primary at once, and
        # /healthz says the replica is down: degraded, still 200.
        with serve(env(fixture_url, replica_url), embedder) as client:
            body = query(client, query=KONG)
            assert body["metrics"]["served_by"] == "primary"
            assert replica_reasons(body) == ["unavailable"]
            health = client.get("/healthz")
            assert health.status_code == 200
            assert health.json()["status"] == "degraded"
            assert "replicas" in health.json()["down"]
            (server,) = health.json()["checks"]["replicas"]["servers"]
            assert server["ok"] is False and server["reason"] == "unavailable"
            scrape = client.get("/metrics").text
            assert 'reason="unavailable",stage="replica"' in scrape, scrape
            assert any(
                line.startswith("poimen_replica_usable{") and line.endswith(" 0.0")
                for line in scrape.splitlines()
            )
            # The replica comes back: the monitor notices and queries return to it.
            standby.start(fast=True)
            back = served_by(client, "replica", query=KONG)
            assert replica_reasons(back) == [] and sha_order(back) == sha_order(on_replica)
    finally:
        standby.start(fast=True)


def test_a_lagging_replica_falls_back_to_the_primary(
    fixture_url: str, replica_url: str, standby: Cluster, embedder: LocalEmbedder
) -> None:
    bound = env(fixture_url, replica_url, POIMEN_MAX_REPLICA_LAG_S="0.5")
    with (
        serve(bound, embedder) as client,
        psycopg.connect(standby.url("postgres"), autocommit=True) as sb,
    ):
        on_replica = served_by(client, "replica", query=KONG)
        sb.execute("SELECT pg_wal_replay_pause()")
        try:
            with psycopg.connect(fixture_url, autocommit=True) as p:
                p.execute("CREATE TABLE public.lag_probe (x int)")  # a commit to replay
            lagging = served_by(client, "primary", query=KONG)
            assert replica_reasons(lagging) == ["lagging"]
            assert sha_order(lagging) == sha_order(on_replica)
            health = client.get("/healthz")
            assert health.status_code == 200
            (server,) = health.json()["checks"]["replicas"]["servers"]
            assert server["reason"] == "lagging" and server["replay_paused"] is True
            assert server["lag_s"] > 0.5 and server["behind_bytes"] > 0
        finally:
            sb.execute("SELECT pg_wal_replay_resume()")
        back = served_by(client, "replica", query=KONG)
        assert replica_reasons(back) == []


def test_a_project_not_yet_replayed_is_asked_of_the_primary(
    fixture_url: str, replica_url: str, standby: Cluster, embedder: LocalEmbedder
) -> None:
    """Within the lag bound a replica may miss a project created a moment ago: the primary
    answers for it instead of a 404; a project that exists nowhere is still a 404."""
    lenient = env(fixture_url, replica_url, POIMEN_MAX_REPLICA_LAG_S="3600")
    with (
        serve(lenient, embedder) as client,
        psycopg.connect(standby.url("postgres"), autocommit=True) as sb,
    ):
        served_by(client, "replica", query=KONG)
        sb.execute("SELECT pg_wal_replay_pause()")
        try:
            node = {"id": "n-1", "level": "L1", "project": "fresh", "text": "walrus ledger"}
            response = client.post("/memory/nodes", json=[node])
            assert response.status_code == 201, response.text
            body = query(client, query="walrus ledger", project="fresh")
            assert body["metrics"]["served_by"] == "primary"
            assert replica_reasons(body) == ["project_not_replayed"]
            assert [r["text"] for r in body["results"]] == ["walrus ledger"]
            # Still within the bound: other projects keep reading from the replica.
            other = query(client, query=KONG, project="poimen")
            assert other["metrics"]["served_by"] == "replica"
            missing = client.get("/memory/query", params={"query": KONG, "project": "nope"})
            assert missing.status_code == 404
        finally:
            sb.execute("SELECT pg_wal_replay_resume()")


def test_without_read_urls_everything_is_the_primary(
    fixture_url: str, embedder: LocalEmbedder
) -> None:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        body = query(client, query=KONG)
        health = client.get("/healthz").json()
    assert body["metrics"]["served_by"] == "primary" and replica_reasons(body) == []
    assert health["checks"]["replicas"] == {"ok": None, "status": "not_configured"}


def test_a_replica_pool_that_skips_row_level_security_is_named(
    fixture_url: str, replica_url: str, embedder: LocalEmbedder
) -> None:
    """Both URLs here are the tests' superuser: /healthz names each pool, the replica too."""
    with serve(env(fixture_url, replica_url, POIMEN_HEALTH_CACHE_S="0"), embedder) as client:
        warnings = wait_for(
            "a warning for both pools",
            lambda: len(w := client.get("/healthz").json()["warnings"]) == 2 and w,
        )
    port = str(conninfo_to_dict(replica_url)["port"])
    assert any(w.startswith("read replica") and port in w for w in warnings), warnings
    assert all("'postgres' (superuser)" in w for w in warnings), warnings
