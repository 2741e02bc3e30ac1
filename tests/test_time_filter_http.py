"""The time filter over HTTP: since/until/reference_time on GET /memory/query, typed 400s,
the plan's account of the filter, the same rows as memory_query(), and the lexical leg
leaving OpenSearch (whose documents have no timestamp) for Postgres BM25."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from starlette.testclient import TestClient

from doubles.opensearch_server import run_opensearch_server
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder
from service_client import query, serve
from timeline import FEB, PROJECT, QUERY, in_february, load


@pytest.fixture
def url(fixture_url: str, embedder: LocalEmbedder) -> str:
    with connect(fixture_url, autocommit=True) as conn:
        load(conn, embedder)
        # the time filter, not the relevance floor (tested in tests/test_query_grammar.py)
        conn.execute("SELECT memory.set_policy('min_cosine', '-1')")
    return fixture_url


@pytest.fixture
def client(url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": url}, embedder) as c:
        yield c


def _stamps(body: dict[str, Any]) -> list[datetime | None]:
    return [
        datetime.fromisoformat(r["timestamp"]) if r["timestamp"] else None for r in body["results"]
    ]


@pytest.mark.parametrize("strategy", ["LexicalOnly", "Hybrid", "SemanticOnly", "LexicalFirst"])
def test_filtered_query_fills_its_limit_and_matches_sql(
    client: TestClient, url: str, embedder: LocalEmbedder, strategy: str
) -> None:
    base = {"query": QUERY, "project": PROJECT, "level": "L0", "limit": 10, "strategy": strategy}
    assert not any(in_february(t) for t in _stamps(query(client, **base)))
    body = query(client, **base, since=FEB[0], until=FEB[1])
    assert len(body["results"]) == 10 and all(in_february(t) for t in _stamps(body))
    tf = body["plan"]["time_filter"]
    assert (tf["since"], tf["until"], tf["source"], tf["applied"]) == (*FEB, "argument", True)
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT sha256 FROM public.memory_query(%s, %s, %s, ARRAY['L0'], 10, %s,"
            " since => %s, until => %s)",
            (
                QUERY,
                None if strategy == "LexicalOnly" else embedder.embed_query(QUERY),
                PROJECT,
                strategy,
                *FEB,
            ),
        ).fetchall()
    assert [r[0] for r in rows] == [r["sha256"] for r in body["results"]]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"since": "last tuesday"}, "since must be an ISO date or timestamp"),
        ({"until": "2023-02-29"}, "until must be an ISO date or timestamp"),
        ({"since": "2023-03-01", "until": "2023-02-01"}, "since (2023-03-01) is after until"),
        ({"reference_time": "noon"}, "reference_time must be an ISO timestamp"),
        # Found by schemathesis: a valid timestamp with no UTC date (was a 500).
        (
            {"reference_time": "0001-01-01T00:00:01+20:10"},
            "reference_time must be an ISO timestamp",
        ),
        # "last week" at year 1 was an OverflowError, "last year" a ValueError: both 500s.
        (
            {"reference_time": "0001-01-01T00:00:00Z", "query": "kong notes from last week"},
            "reference_time must be an ISO timestamp within years 2..9998",
        ),
        (
            {"reference_time": "0001-03-01T00:00:00Z", "query": "kong notes from last year"},
            "reference_time must be an ISO timestamp within years 2..9998",
        ),
        ({"reference_time": "infinity"}, "reference_time must be an ISO timestamp"),
        (
            {"reference_time": "9999-12-31T00:00:00Z", "query": "kong notes from this month"},
            "reference_time must be an ISO timestamp within years 2..9998",
        ),
    ],
)
def test_bad_time_parameters_are_400_naming_them(
    client: TestClient, params: dict[str, str], named: str
) -> None:
    response = client.get("/memory/query", params={"query": QUERY, **params})
    assert response.status_code == 400, response.text
    # The connection stays usable after the refusal (it once reset the next request).
    assert response.headers.get("connection") != "close"
    body = response.json()
    assert body["error"] == "invalid_parameter" and body["detail"].startswith(named)


def test_extracted_dates_annotate_by_default_and_filter_under_the_policy(
    client: TestClient, url: str
) -> None:
    params = {
        "query": "kong gateway notes on 3 February 2023",
        "project": PROJECT,
        "level": "L0",
        "limit": 5,
    }
    body = query(client, **params)
    tf = body["plan"]["time_filter"]
    assert tf["applied"] is False and tf["source"] is None and "annotate" in tf["why"]
    assert tf["dates"][0]["since"] == tf["dates"][0]["until"] == "2023-02-03"
    assert len(body["results"]) == 5
    with connect(url, autocommit=True) as conn:
        conn.execute("SELECT memory.set_policy('extracted_dates', 'filter')")
    body = query(client, **params)
    tf = body["plan"]["time_filter"]
    assert (tf["since"], tf["until"], tf["source"], tf["applied"]) == (
        "2023-02-03",
        "2023-02-03",
        "extracted",
        True,
    )
    assert [t.day if t else None for t in _stamps(body)] == [3]


def test_relative_dates_count_from_reference_time(client: TestClient) -> None:
    body = query(
        client,
        query="kong notes from last week",
        project=PROJECT,
        level="L0",
        reference_time="2023-02-08T12:00:00Z",
    )
    tf = body["plan"]["time_filter"]
    assert tf["dates"][0]["since"] == "2023-01-30" and tf["dates"][0]["until"] == "2023-02-05"


def test_with_opensearch_a_filtered_lexical_leg_runs_on_postgres(
    url: str, embedder: LocalEmbedder
) -> None:
    with run_opensearch_server() as server:
        env = {
            "POIMEN_DATABASE_URL": url,
            "POIMEN_OPENSEARCH_URL": server.url,
            "POIMEN_OPENSEARCH_INDEX": "timeline",
        }
        with serve(env, embedder) as client:
            body = query(
                client,
                query=QUERY,
                project=PROJECT,
                level="L0",
                limit=10,
                strategy="LexicalOnly",
                since=FEB[0],
                until=FEB[1],
            )
        assert not server.requests_to("/_search")
    assert body["plan"]["engines"]["lexical"] == "postgres-bm25"
    assert len(body["results"]) == 10 and all(in_february(t) for t in _stamps(body))
