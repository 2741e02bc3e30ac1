"""Retrieval policy lives once, in the database (memory.policy()). These tests read it from
SQL and from the HTTP service and check both paths apply the same values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import ConfigError
from poimen_memory.retrieval.policy import Policy, read_policy
from poimen_memory.settings import Settings
from service_client import KONG, query, serve

QUERIES = [
    json.loads(line)["text"]
    for line in (Path(__file__).parent / "fixtures" / "eval_queries.jsonl").read_text().splitlines()
] + ["kong buffer incidents in 2024", "kong", "postgres"]  # LexicalFirst and LexicalOnly too


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


def _set(url: str, key: str, value: str) -> Policy:
    with connect(url, autocommit=True) as conn:
        conn.execute("SELECT memory.set_policy(%s, %s)", (key, value))
        return read_policy(conn)


def test_no_retrieval_default_is_left_in_the_service_settings() -> None:
    names = {f for f in vars(Settings()) if not f.startswith("_")}
    assert names.isdisjoint({"rrf_k", "dense_weight", "candidates", "fusion", "default_fusion"})


def test_old_policy_variables_are_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="POIMEN_RRF_K") as info:
        Settings.from_env({"POIMEN_RRF_K": "60"})
    assert info.value.hint == "SELECT memory.set_policy('rrf_k', '<value>');"


def test_the_service_applies_the_database_policy(client: TestClient, fixture_url: str) -> None:
    with connect(fixture_url) as conn:
        policy = read_policy(conn)
    assert (policy.fusion, policy.rrf_k, policy.dense_weight) == ("convex", 10, 0.4)
    body = query(client, query=KONG, limit=10)
    assert body["search_strategy"] == "Hybrid"
    assert {r["fusion_method"] for r in body["results"]} == {policy.fusion}

    # A DBA changes the policy in SQL; the next HTTP query follows, no restart.
    policy = _set(fixture_url, "fusion", "rrf")
    policy = _set(fixture_url, "rrf_k", "3")
    policy = _set(fixture_url, "candidates", "2")
    body = query(client, query=KONG, limit=10)
    assert body["metrics"]["semantic_candidates"] == 2
    assert body["metrics"]["lexical_candidates"] <= 2
    for r in body["results"]:
        assert r["fusion_method"] == "rrf"
        ranks = [x for x in (r["semantic_rank"], r["lexical_rank"]) if x]
        assert r["final_score"] == pytest.approx(sum(1 / (policy.rrf_k + x) for x in ranks))


@pytest.mark.parametrize("fusion", ["convex", "rrf"])
def test_sql_and_http_rank_alike(
    client: TestClient, fixture_url: str, embedder: LocalEmbedder, fusion: str
) -> None:
    """Same query, same vector, same policy: public.memory_query() and GET /memory/query return the
    same nodes in the same order, whatever strategy the optimizer picks."""
    _set(fixture_url, "fusion", fusion)
    strategies = set()
    with connect(fixture_url) as conn:
        for text in QUERIES:
            vec = embedder.embed_query(text)
            sql_rows: list[Any] = conn.execute(
                "SELECT sha256, search_strategy, fusion_method "
                "FROM public.memory_query(%s, %s, 'poimen', k => 10)",
                (text, vec),
            ).fetchall()
            body = query(client, query=text, project="poimen", limit=10)
            strategies.add(body["search_strategy"])
            assert [r[0] for r in sql_rows] == [r["sha256"] for r in body["results"]], text
            assert {r[1] for r in sql_rows} <= {body["search_strategy"]}
            assert [r[2] for r in sql_rows] == [r["fusion_method"] for r in body["results"]]
    assert len(strategies) >= 2  # the queries exercise more than one route
