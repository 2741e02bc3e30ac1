"""GET /metrics: Prometheus text that the official parser reads, and that moves with real
queries against the real app and database."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from poimen_memory.api.app import create_app
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.settings import Settings
from service_client import KONG, LoopbackClient, query

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

STAGES = ("embed", "lexical", "semantic", "fusion", "provenance", "total")


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def stage_count(samples: Samples, stage: str) -> float:
    return value(samples, "poimen_query_stage_duration_seconds_count", stage=stage)


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    app = create_app(Settings.from_env({"POIMEN_DATABASE_URL": fixture_url}), embedder=embedder)
    with LoopbackClient(app) as c:
        yield c


def test_metrics_parse_and_histograms_move_with_queries(client: TestClient) -> None:
    before = scrape(client)
    bodies: list[dict[str, Any]] = [
        query(client, query=KONG, project="poimen"),
        query(client, query=KONG, project="poimen"),  # the same text: an embedding-cache hit
        query(client, query="kong body buffer", project="poimen", strategy="LexicalOnly"),
    ]
    assert [b["search_strategy"] for b in bodies] == ["Hybrid", "Hybrid", "LexicalOnly"]
    after = scrape(client)

    # Every answered query observes `total`; stages only when they ran.
    assert stage_count(after, "total") - stage_count(before, "total") == 3
    for stage in ("embed", "semantic"):
        assert stage_count(after, stage) - stage_count(before, stage) == 2, stage
    for stage in ("lexical", "fusion", "provenance", "evidence"):
        assert stage_count(after, stage) - stage_count(before, stage) == 3, stage
    assert stage_count(after, "rerank") == 0  # no reranker configured: never ran
    # The histogram holds the same numbers the responses reported.
    total_sum = value(after, "poimen_query_stage_duration_seconds_sum", stage="total") - value(
        before, "poimen_query_stage_duration_seconds_sum", stage="total"
    )
    reported = sum(b["metrics"]["total_time_ms"] for b in bodies) / 1000
    assert total_sum == pytest.approx(reported, rel=1e-6, abs=1e-9)
    # Buckets are cumulative and end at +Inf with the count.
    inf = value(after, "poimen_query_stage_duration_seconds_bucket", stage="total", le="+Inf")
    assert inf == stage_count(after, "total")

    assert value(after, "poimen_query_strategy_total", strategy="Hybrid") == 2
    assert value(after, "poimen_query_strategy_total", strategy="LexicalOnly") == 1
    assert value(after, "poimen_query_degraded_total", stage="rerank", reason="not_configured") == 3
    assert (
        value(after, "poimen_embedding_cache_misses_total")
        - value(before, "poimen_embedding_cache_misses_total")
        == 1
    )
    assert (
        value(after, "poimen_embedding_cache_hits_total")
        - value(before, "poimen_embedding_cache_hits_total")
        == 1
    )

    route = {"method": "GET", "route": "/memory/query", "status": "200"}
    assert value(after, "poimen_http_requests_total", **route) == 3
    assert value(after, "poimen_http_request_duration_seconds_count", route="/memory/query") == 3
    # The first scrape is counted by the time of the second.
    assert value(after, "poimen_http_requests_total", method="GET", route="/metrics", status="200")


def test_request_counts_by_status_and_route_template(client: TestClient) -> None:
    assert client.get("/memory/query", params={"query": ""}).status_code == 400
    assert client.get("/memory/query", params={"query": KONG, "project": "nope"}).status_code == 404
    assert client.get("/no/such/path/123").status_code == 404
    assert client.get("/healthz").status_code == 200
    s = scrape(client)
    assert value(s, "poimen_http_requests_total", method="GET", route="/memory/query", status="400")
    assert value(s, "poimen_http_requests_total", method="GET", route="/memory/query", status="404")
    # Unknown paths share one label value, so they cannot grow the series without bound.
    assert value(s, "poimen_http_requests_total", method="GET", route="unmatched", status="404")
    assert not any("/no/such" in str(labels) for _, labels in s)
    assert value(s, "poimen_http_requests_total", method="GET", route="/healthz", status="200")
    # Failed queries observe no stage.
    assert stage_count(s, "total") == 0


def test_pool_and_outbox_backlog(client: TestClient, fixture_url: str) -> None:
    query(client, query=KONG, project="poimen")
    s = scrape(client)
    assert value(s, "poimen_database_up") == 1
    assert value(s, "poimen_opensearch_outbox_backlog") == 0
    assert value(s, "poimen_db_pool_max") == Settings().pool_max
    in_use = value(s, "poimen_db_pool_connections", state="in_use")
    idle = value(s, "poimen_db_pool_connections", state="idle")
    assert in_use >= 0 and idle >= 1 and in_use + idle <= Settings().pool_max
    assert ("poimen_db_pool_requests_waiting", frozenset()) in s

    with psycopg.connect(fixture_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO memory.opensearch_outbox (node_id, op)"
            " SELECT id, 'index' FROM memory.nodes ORDER BY id LIMIT 3"
        )
    assert value(scrape(client), "poimen_opensearch_outbox_backlog") == 3


def test_each_app_has_its_own_registry(fixture_url: str, embedder: LocalEmbedder) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url}
    with (
        LoopbackClient(create_app(Settings.from_env(env), embedder=embedder)) as a,
        LoopbackClient(create_app(Settings.from_env(env), embedder=embedder)) as b,
    ):
        query(a, query=KONG, project="poimen")
        query(a, query=KONG, project="poimen")
        assert stage_count(scrape(a), "total") == 2
        assert stage_count(scrape(b), "total") == 0
