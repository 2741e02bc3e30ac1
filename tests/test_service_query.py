"""GET /memory/query through the real app (Starlette TestClient) against the test cluster:
result content, level/project/limit filters, provenance, scores, fusion, the cascade's
by-ids stage, reranking and the query-embedding cache."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pytest
from pgvector.psycopg import register_vector
from psycopg.types.json import Jsonb
from starlette.testclient import TestClient

from doubles.embedding_server import EmbeddingServer, run_embedding_server
from doubles.rerank_server import RerankServer, run_rerank_server
from poimen_core.optimizer import optimize_query
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.retrieval.policy import read_policy
from service_client import KONG, make_key, query, serve

CASCADE = "kong buffer incidents in 2024"  # a year: routes LexicalFirst
KONG_MEMORY = "poimen:mem:1"  # the L1 memory about Kong's body buffer


def sources(body: dict[str, Any]) -> list[str]:
    return [r["source"] for r in body["results"]]


@pytest.fixture(scope="module")
def rerank_double() -> Iterator[RerankServer]:
    with run_rerank_server() as server:
        yield server


@pytest.fixture
def rerank(rerank_double: RerankServer) -> RerankServer:
    rerank_double.reset()
    return rerank_double


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


# -- a1, a3-a7: basic results, provenance, filters -----------------------------------------


def test_basic_query_finds_the_kong_memory(client: TestClient) -> None:
    body = query(client, query=KONG)
    assert body["search_strategy"] == "Hybrid"
    assert body["query"] == KONG and body["level_filter"] == ["L1", "L2"]
    top = body["results"][0]
    assert top["source"] == KONG_MEMORY and top["level"] == "L1"
    assert "client_body_buffer_size to 64k" in top["text"]
    assert len(top["sha256"]) == 64
    assert body["notes"].startswith(f"{len(body['results'])} results")


def test_l1_result_carries_its_l0_evidence(client: TestClient) -> None:
    body = query(client, query=KONG)
    kong = next(r for r in body["results"] if r["source"] == KONG_MEMORY)
    parents = kong["parents"]
    # Ordered by edge precedence: the chat turns in the order the memory cites them.
    assert [p["source"] for p in parents] == ["poimen:chat:1", "poimen:chat:2", "poimen:chat:3"]
    assert all(p["level"] == "L0" and p["parents"] == [] for p in parents)
    assert parents[0]["text"].startswith("Alice: Uploads larger than 10KB are failing with a 413")
    assert "client_body_buffer_size defaults to 8k" in parents[1]["text"]
    assert "nginx_http_client_body_buffer_size to 64k" in parents[2]["text"]
    assert parents[1]["title"] == "incident 2024-03-04"
    assert parents[1]["timestamp"].startswith("2024-03-04T09:20:00")


def test_l2_result_provenance_reaches_l0_through_l1(client: TestClient) -> None:
    body = query(client, query=KONG)
    synthesis = next(r for r in body["results"] if r["source"] == "poimen:syn:1")
    assert synthesis["level"] == "L2"
    l1 = synthesis["parents"]
    assert [p["source"] for p in l1] == ["poimen:mem:1", "poimen:mem:2"]
    assert all(p["level"] == "L1" for p in l1)
    evidence = {g["source"]: g["text"] for p in l1 for g in p["parents"]}
    assert set(evidence) == {f"poimen:chat:{i}" for i in range(1, 6)}
    assert "pgbouncer in transaction mode" in evidence["poimen:chat:5"]


def test_level_l0_returns_only_evidence(client: TestClient) -> None:
    body = query(client, query=KONG, level="L0")
    assert body["level_filter"] == ["L0"]
    assert body["results"] and {r["level"] for r in body["results"]} == {"L0"}
    # The chat turn that names the setting is among the evidence found.
    assert "poimen:chat:2" in sources(body)


def test_levels_l1_l2_exclude_evidence(client: TestClient) -> None:
    body = query(client, query=KONG, level="L1,L2", limit=10)
    levels = {r["level"] for r in body["results"]}
    assert body["results"] and "L0" not in levels and levels == {"L1", "L2"}


def test_project_filter(client: TestClient) -> None:
    unfiltered = query(client, query=KONG, limit=10)
    assert {r["project"] for r in unfiltered["results"]} == {"poimen", "atlas"}
    poimen = query(client, query=KONG, project="poimen", limit=10)
    assert poimen["project"] == "poimen"
    assert poimen["results"] and {r["project"] for r in poimen["results"]} == {"poimen"}
    atlas = query(client, query=KONG, project="atlas", limit=10)
    assert atlas["results"] and {r["project"] for r in atlas["results"]} == {"atlas"}
    assert atlas["results"][0]["source"] == "atlas:mem:1"


def test_limit(client: TestClient) -> None:
    body = query(client, query=KONG, limit=3)
    assert len(body["results"]) == 3
    assert body["metrics"]["final_count"] == 3
    assert len(query(client, query=KONG, limit=1)["results"]) == 1


# -- hybrid and cascade ----------------------------------------------------------------


def test_hybrid_fuses_both_legs(client: TestClient, fixture_url: str) -> None:
    # every fused candidate (-1: no floor holds one back; the floor is tested on its own)
    body = query(client, query=KONG, limit=10, fusion="rrf", min_cosine="-1")
    assert body["plan"]["engines"] == {
        "lexical": "postgres-bm25",
        "semantic": "hnsw",
        "rerank": None,
    }
    results = body["results"]
    assert any(r["semantic_rank"] is not None and r["lexical_rank"] is not None for r in results)
    assert all(r["fusion_method"] == "rrf" for r in results)
    # Ranks are those of the SQL legs.
    with psycopg.connect(fixture_url) as conn:
        lexical = conn.execute(
            "SELECT encode(n.sha256, 'hex'), l.rank "
            "FROM memory.lexical_search(%s, NULL, '{L1,L2}', 50) l "
            "JOIN memory.nodes n ON n.id = l.node_id",
            (KONG,),
        ).fetchall()
    assert {r["sha256"]: r["lexical_rank"] for r in results if r["lexical_rank"]} == dict(lexical)
    # No reranker: the fused score decided the order.
    finals = [r["final_score"] for r in results]
    assert finals == sorted(finals, reverse=True)
    assert all(r["rerank_score"] is None for r in results)
    with connect(fixture_url) as conn:
        k = read_policy(conn).rrf_k
    for r in results:
        expected = sum(1 / (k + rank) for rank in (r["semantic_rank"], r["lexical_rank"]) if rank)
        assert r["final_score"] == pytest.approx(expected)


def _minmax(scores: dict[str, float]) -> dict[str, float]:
    lo, hi = min(scores.values()), max(scores.values())
    return {k: 1.0 if hi == lo else (v - lo) / (hi - lo) for k, v in scores.items()}


def test_default_fusion_is_lexical_leaning_convex(client: TestClient, fixture_url: str) -> None:
    """The measured default (docs/benchmarks.md): convex, dense weight 0.4, lexical 0.6."""
    body = query(client, query=KONG, limit=10)
    results = body["results"]
    assert {r["fusion_method"] for r in results} == {"convex"}
    with psycopg.connect(fixture_url) as conn:
        lexical = dict(
            conn.execute(
                "SELECT encode(n.sha256, 'hex'), l.lexical_score "
                "FROM memory.lexical_search(%s, NULL, '{L1,L2}', 50) l "
                "JOIN memory.nodes n ON n.id = l.node_id",
                (KONG,),
            ).fetchall()
        )
    lex_norm = _minmax(lexical)
    with connect(fixture_url) as conn:
        w = read_policy(conn).dense_weight
    assert w == pytest.approx(0.4)
    for r in results:
        lex_part = (1 - w) * lex_norm.get(r["sha256"], 0.0)
        # The semantic part is w * minmax(cosine) over the semantic leg: bounded by w.
        assert lex_part - 1e-9 <= r["final_score"] <= lex_part + w + 1e-9
    finals = [r["final_score"] for r in results]
    assert finals == sorted(finals, reverse=True)


def test_convex_fusion_on_request(client: TestClient) -> None:
    body = query(client, query=KONG, fusion="convex", limit=10)
    assert {r["fusion_method"] for r in body["results"]} == {"convex"}
    finals = [r["final_score"] for r in body["results"]]
    assert finals == sorted(finals, reverse=True) and max(finals) <= 1.0


BY_IDS_SPY = """
ALTER FUNCTION memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz,
                                    timestamptz, jsonb, jsonb, timestamptz, timestamptz)
    RENAME TO search_by_ids_real;
CREATE TABLE memory.by_ids_calls (call serial PRIMARY KEY, ids bigint[], project text,
                                  levels text[], k integer);
CREATE FUNCTION memory.search_by_ids(query_embedding vector, ids bigint[],
                                     project text DEFAULT NULL, levels text[] DEFAULT NULL,
                                     k integer DEFAULT 50, since timestamptz DEFAULT NULL,
                                     before timestamptz DEFAULT NULL,
                                     filter jsonb DEFAULT NULL, grammar jsonb DEFAULT NULL,
                                     as_of timestamptz DEFAULT NULL,
                                     valid_at timestamptz DEFAULT NULL)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    INSERT INTO memory.by_ids_calls (ids, project, levels, k) VALUES (ids, project, levels, k);
    RETURN QUERY SELECT * FROM memory.search_by_ids_real(query_embedding, ids, project, levels, k,
                                                         since, before, filter, grammar,
                                                         as_of, valid_at);
END $$;
"""


@pytest.mark.parametrize("project", [None, "poimen"])
def test_cascade_ranks_exactly_the_lexical_ids(
    fixture_url: str, embedder: LocalEmbedder, project: str | None
) -> None:
    with psycopg.connect(fixture_url, autocommit=True) as conn:
        conn.execute(BY_IDS_SPY)
        lexical = [
            r[0]
            for r in conn.execute(
                "SELECT node_id FROM memory.lexical_search(%s, %s, '{L1,L2}', 200) ORDER BY rank",
                (CASCADE, project),
            )
        ]
    # fusion=rrf: the classic cascade, the by-ids cosine order alone.
    params = {"query": CASCADE, "fusion": "rrf"} | ({"project": project} if project else {})
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        body = query(client, **params)
    assert body["search_strategy"] == "LexicalFirst"
    assert body["plan"]["engines"]["semantic"] == "by-ids"
    with psycopg.connect(fixture_url) as conn:
        calls = conn.execute("SELECT ids, project, levels FROM memory.by_ids_calls").fetchall()
        lexical_shas: set[str] = {
            r[0]
            for r in conn.execute(
                "SELECT encode(sha256, 'hex') FROM memory.nodes WHERE id = ANY(%s)", (lexical,)
            )
        }
    assert len(lexical) >= 2
    assert calls == [(lexical, project, ["L1", "L2"])]  # one call, exactly the lexical leg's ids
    results = body["results"]
    assert results and all(r["fusion_method"] == "cascade" for r in results)
    assert {r["sha256"] for r in results} <= lexical_shas
    # The cascade's order is the by-ids cosine order.
    assert [r["semantic_rank"] for r in results] == list(range(1, len(results) + 1))
    scores = [r["query_score"] for r in results]
    assert scores == sorted(scores, reverse=True)


def test_convex_cascade_blends_cosine_and_bm25_over_the_lexical_ids(
    client: TestClient, fixture_url: str, embedder: LocalEmbedder
) -> None:
    body = query(client, query=CASCADE, limit=10)
    assert body["search_strategy"] == "LexicalFirst"
    results = body["results"]
    assert results and {r["fusion_method"] for r in results} == {"cascade+convex"}
    with connect(fixture_url) as conn:
        lex = conn.execute(
            "SELECT l.node_id, encode(n.sha256, 'hex'), l.lexical_score "
            "FROM memory.lexical_search(%s, NULL, '{L1,L2}', 200) l "
            "JOIN memory.nodes n ON n.id = l.node_id",
            (CASCADE,),
        ).fetchall()
        cos = conn.execute(
            "SELECT encode(n.sha256, 'hex'), b.query_score FROM memory.search_by_ids(%s, %s) b "
            "JOIN memory.nodes n ON n.id = b.node_id",
            (embedder.embed_query(CASCADE), [r[0] for r in lex]),
        ).fetchall()
        w = read_policy(conn).dense_weight
    lex_n, cos_n = _minmax({r[1]: r[2] for r in lex}), _minmax(dict(cos))
    expected = {sha: w * cos_n[sha] + (1 - w) * lex_n[sha] for sha in lex_n}
    for r in results:
        assert r["final_score"] == pytest.approx(expected[r["sha256"]], abs=1e-6)
    want = sorted(expected, key=lambda sha: -expected[sha])[: len(results)]
    assert [r["sha256"] for r in results] == want


# -- scores, metrics ----------------------------------------------------------------------


def stored_vectors(url: str, shas: list[str]) -> dict[str, np.ndarray[Any, Any]]:
    with psycopg.connect(url) as conn:
        register_vector(conn)
        rows = conn.execute(
            "SELECT encode(sha256, 'hex'), embedding FROM memory.nodes "
            "WHERE encode(sha256, 'hex') = ANY(%s)",
            (shas,),
        ).fetchall()
    return {sha: np.asarray(vec.to_numpy(), dtype=np.float64) for sha, vec in rows}


def cosine(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_query_score_is_the_cosine_of_query_and_stored_vector(
    client: TestClient, fixture_url: str, embedder: LocalEmbedder
) -> None:
    body = query(client, query=KONG, level="L0,L1,L2", limit=8)
    q = embedder.embed_query(KONG).astype(np.float64)
    vectors = stored_vectors(fixture_url, [r["sha256"] for r in body["results"]])
    for r in body["results"]:
        assert r["query_score"] == pytest.approx(cosine(q, vectors[r["sha256"]]), abs=1e-5)


def test_metrics_are_populated(client: TestClient) -> None:
    body = query(client, query=KONG)
    m = body["metrics"]
    stages = ("embed_time_ms", "lexical_time_ms", "semantic_time_ms", "fusion_time_ms")
    assert all(isinstance(m[k], float) and m[k] > 0 for k in (*stages, "total_time_ms"))
    assert m["total_time_ms"] >= max(m[k] for k in stages)
    assert body["latency_ms"] >= m["total_time_ms"]
    assert m["rerank_time_ms"] is None  # no reranker configured: the stage did not run
    assert m["final_count"] == len(body["results"]) <= 5
    assert m["semantic_candidates"] == 10  # every L1/L2 node with an embedding (limit 50)
    assert m["lexical_candidates"] > 0
    assert m["embedding_cache_hit"] is False


def test_a_leg_that_did_not_run_reports_null(client: TestClient, fixture_url: str) -> None:
    """Null, not 0: a leg the plan did not run has no time and no candidates (0 would say it
    ran and found nothing), over HTTP and in the SQL answer alike."""
    # a caller's forced LexicalOnly embeds nothing, default floor or not (the floor is off
    # for it: no cosine is computed behind the caller's back)
    m = query(client, query=KONG, strategy="LexicalOnly")["metrics"]
    assert m["semantic_time_ms"] is None and m["semantic_candidates"] is None
    assert m["embed_time_ms"] is None
    m = query(client, query=KONG, strategy="LexicalOnly", min_cosine="-1")["metrics"]
    assert m["semantic_time_ms"] is None and m["semantic_candidates"] is None
    assert m["embed_time_ms"] is None and m["embedding_cache_hit"] is None
    assert m["rerank_time_ms"] is None and m["opensearch_time_ms"] is None
    assert m["lexical_time_ms"] > 0 and m["lexical_candidates"] > 0
    with psycopg.connect(fixture_url) as conn:
        row = conn.execute(
            "SELECT memory.answer(%s, strategy => 'LexicalOnly', min_cosine => -1)", (KONG,)
        ).fetchone()
    assert row is not None
    doc = row[0]
    assert doc["counts"]["semantic_candidates"] is None and doc["counts"]["lexical_candidates"]
    assert "semantic_time_ms" not in doc["stages"] and doc["stages"]["lexical_time_ms"] > 0


# -- reranking (rerank double) ---------------------------------------------------------------


def rerank_env(url: str, server: RerankServer, **extra: str) -> dict[str, str]:
    return {"POIMEN_DATABASE_URL": url, "POIMEN_RERANK_URL": server.url, **extra}


def test_reranked_scores_are_in_unit_interval(
    fixture_url: str, embedder: LocalEmbedder, rerank: RerankServer
) -> None:
    with serve(rerank_env(fixture_url, rerank), embedder) as client:
        body = query(client, query=KONG, min_cosine="-1")  # every candidate: no floor
    assert body["plan"]["engines"]["rerank"] == "remote"
    assert not [d for d in body["degraded"] if d["stage"] == "rerank"]
    assert len(body["results"]) == 5
    for r in body["results"]:
        for key in ("query_score", "rerank_score"):
            assert isinstance(r[key], float) and 0.0 <= r[key] <= 1.0, (key, r[key])


def test_reranker_reorders_the_fused_list(
    fixture_url: str, embedder: LocalEmbedder, rerank: RerankServer
) -> None:
    limit = 3
    rerank.reset(scores=[0.5] * 50)  # all equal: the fused order survives, and we see it
    with serve(rerank_env(fixture_url, rerank), embedder) as client:
        # the reranker's depth in full: no floor holds a candidate back
        baseline = query(client, query=KONG, limit=limit, min_cosine="-1")
        fused_docs = rerank.requests[-1].body["documents"]
        n = len(fused_docs)
        assert n == limit * 3  # the reranker sees limit x POIMEN_RERANK_DEPTH_FACTOR candidates
        assert [r["text"] for r in baseline["results"]] == fused_docs[:limit]
        # Now the last fused candidate gets the best score, the others keep their order.
        scores = [0.6 - 0.05 * i for i in range(n - 1)] + [0.95]
        rerank.reset(scores=scores)
        body = query(client, query=KONG, limit=limit, min_cosine="-1")
    assert rerank.requests[-1].body["documents"] == fused_docs
    results = body["results"]
    assert [r["text"] for r in results] == [fused_docs[-1], fused_docs[0], fused_docs[1]]
    assert [r["rerank_score"] for r in results] == pytest.approx([0.95, 0.6, 0.55])
    # Order follows rerank_score, not the fused score: the new top was fused last.
    assert results[0]["final_score"] < results[1]["final_score"]
    assert body["metrics"]["final_count"] == limit
    assert f"reranker reduced {n} candidates to {limit}" in body["notes"]
    # query_score stays the pre-rerank cosine.
    q = embedder.embed_query(KONG).astype(np.float64)
    vectors = stored_vectors(fixture_url, [r["sha256"] for r in results])
    for r in results:
        assert r["query_score"] == pytest.approx(cosine(q, vectors[r["sha256"]]), abs=1e-5)


def test_reranked_results_sorted_by_rerank_score_and_depth(
    fixture_url: str, embedder: LocalEmbedder, rerank: RerankServer
) -> None:
    with serve(rerank_env(fixture_url, rerank), embedder) as client:
        for text, limit, level in (
            (KONG, 2, "L1,L2"),
            (KONG, 4, "L0,L1,L2"),
            ("kong", 2, "L1,L2"),  # LexicalOnly
            (CASCADE, 2, "L1,L2"),  # LexicalFirst
        ):
            body = query(client, query=text, limit=limit, level=level)
            sent = rerank.requests[-1].body
            assert sent["query"] == text and sent["top_n"] == len(sent["documents"])
            assert limit <= len(sent["documents"]) <= limit * 3
            results = body["results"]
            assert len(results) == body["metrics"]["final_count"] <= limit
            scores = [r["rerank_score"] for r in results]
            assert scores == sorted(scores, reverse=True), (text, limit, level)
            assert body["metrics"]["rerank_time_ms"] > 0


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize(
    ("scale", "expected"),
    [("unit", lambda raw: raw), ("percent", lambda raw: raw / 100), ("logit", _sigmoid)],
)
def test_rerank_scale_is_normalised_by_the_service(
    fixture_url: str, embedder: LocalEmbedder, rerank: RerankServer, scale: str, expected: Any
) -> None:
    rerank.reset(score_scale=scale)
    q = "kong body buffer upload limits"
    with serve(rerank_env(fixture_url, rerank), embedder) as client:
        body = query(client, query=q, limit=4, level="L0,L1,L2")
    docs = rerank.requests[-1].body["documents"]
    raw_batch = sorted((rerank.raw_score(q, d) for d in docs), reverse=True)
    # Each batch is on its own scale; the auto-detection needs these to tell them apart.
    assert {"unit": raw_batch[0] <= 1, "percent": raw_batch[0] > 1, "logit": raw_batch[-1] < 0}[
        scale
    ]
    results = body["results"]
    raw = [rerank.raw_score(q, r["text"]) for r in results]
    assert raw == raw_batch[: len(results)]  # the best raw scores won
    for r, x in zip(results, raw, strict=True):
        assert 0.0 <= r["rerank_score"] <= 1.0
        assert r["rerank_score"] == pytest.approx(expected(x))
    # Monotone: a higher raw score never gets a lower normalised one.
    pairs = sorted(zip(raw, (r["rerank_score"] for r in results), strict=True))
    assert [s for _, s in pairs] == sorted(s for _, s in pairs)


# -- the query-embedding cache --------------------------------------------------------------


def test_embedding_cache_with_local_embedder(fixture_url: str, embedder: LocalEmbedder) -> None:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        first = query(client, query=KONG)
        second = query(client, query=KONG)
        stats = client.get("/healthz").json()["checks"]["embedding_cache"]
    assert first["metrics"]["embedding_cache_hit"] is False
    assert second["metrics"]["embedding_cache_hit"] is True
    assert sources(first) == sources(second)
    assert [r["query_score"] for r in first["results"]] == [
        r["query_score"] for r in second["results"]
    ]
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["size"] == 1


def test_embedding_cache_keeps_each_api_key_apart(
    fixture_url: str, embedder: LocalEmbedder
) -> None:
    """Shared, a hit told a key that another tenant had just asked the same question (a
    helper's attack): each key has its own entries; the same key hits its own."""
    mine, theirs = make_key(fixture_url, ["poimen"]), make_key(fixture_url, ["atlas"])
    hit = "embedding_cache_hit"
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        asked = [
            client.get(
                "/memory/query",
                params={"query": KONG, "project": p},
                headers={"Authorization": f"Bearer {k}"},
            ).json()
            for k, p in ((theirs, "atlas"), (mine, "poimen"), (mine, "poimen"), (theirs, "atlas"))
        ]
        stats = client.get("/healthz").json()["checks"]["embedding_cache"]
    assert [a["metrics"][hit] for a in asked] == [False, False, True, True]
    assert stats["size"] == 2


@pytest.fixture
def embedding_double() -> Iterator[EmbeddingServer]:
    # dim 384 matches the fixture database's configured model, so the SQL accepts the
    # vectors (they are hashed bags of words: rankings are meaningless, plumbing is not).
    with run_embedding_server(dim=384) as server:
        yield server


def test_embedding_cache_skips_the_remote_embedder(
    fixture_url: str, embedding_double: EmbeddingServer
) -> None:
    env = {
        "POIMEN_DATABASE_URL": fixture_url,
        "POIMEN_EMBEDDINGS_URL": embedding_double.url,
        "POIMEN_EMBEDDINGS_MODEL": "test-bag-of-words",
        "POIMEN_EMBEDDINGS_DIM": "384",
    }
    with psycopg.connect(fixture_url, autocommit=True) as conn:
        # The double stands in for the model the vectors were stored with (same 384 dims).
        conn.execute("UPDATE memory.embedding_model SET model = 'test-bag-of-words'")
    with serve(env) as client:
        first = query(client, query=KONG)
        second = query(client, query=KONG)
        assert len(embedding_double.embedding_requests) == 1
        other = query(client, query="postgres connection pool exhausted during deploys")
        health = client.get("/healthz").json()["checks"]
    assert first["search_strategy"] == second["search_strategy"] == "Hybrid"
    assert first["metrics"]["embedding_cache_hit"] is False
    assert second["metrics"]["embedding_cache_hit"] is True
    assert other["metrics"]["embedding_cache_hit"] is False
    inputs = [r.body["input"] for r in embedding_double.embedding_requests]
    # /healthz probes the embedder for real, with its own text (never cached).
    assert inputs == [
        [KONG],
        ["postgres connection pool exhausted during deploys"],
        ["health check"],
    ]
    assert health["embedder"] == {"ok": True, "model": "test-bag-of-words", "dim": 384}
    # The remote vector is what the query was scored with.
    vec = embedding_double.vector_for(KONG).astype(np.float64)
    vectors = stored_vectors(fixture_url, [r["sha256"] for r in first["results"]])
    for r in first["results"]:
        assert r["query_score"] == pytest.approx(
            min(1.0, max(0.0, cosine(vec, vectors[r["sha256"]]))), abs=1e-5
        )


def _plans_made(
    conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...]
) -> tuple[int, Any]:
    """Calls of memory._plan one statement made, and its value."""
    counts = (
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
        " WHERE schemaname = 'memory' AND funcname = '_plan'"
    )
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        before = conn.execute(counts).fetchone()
        row = conn.execute(sql, params).fetchone()
        after = conn.execute(counts).fetchone()
    assert before is not None and after is not None and row is not None
    return int(after[0] - before[0]), row[0]


def test_the_query_statement_takes_back_the_first_statements_plan(
    conn: psycopg.Connection[Any], embedder: LocalEmbedder
) -> None:
    """memory._serve plans again only when its request or caps differ from those
    memory._serve_start planned for (a failed embedding changes the caps): one plan an
    answer, and the same answer as a fresh plan gives."""
    register_vector(conn)
    req = {"query": KONG, "project": "poimen", "k": 5, "routing": optimize_query(KONG).to_dict()}
    caps = {"vector": True, "lexical": ["postgres"]}
    emb = np.asarray(embedder.embed_query(KONG), dtype=np.float32)
    made, start = _plans_made(conn, "SELECT memory._serve_start(%s, %s)", (Jsonb(req), Jsonb(caps)))
    assert made == 1
    prefetched = start["prefetched"]
    assert prefetched["plan"] == {k: v for k, v in start.items() if k != "prefetched"}
    serve_sql = "SELECT memory._serve(%s, %s, %s, NULL, 'answer', %s)"
    made, taken = _plans_made(conn, serve_sql, (Jsonb(req), Jsonb(caps), emb, Jsonb(prefetched)))
    assert made == 0
    made, fresh = _plans_made(conn, serve_sql, (Jsonb(req), Jsonb(caps), emb, None))
    assert made == 1
    for doc in (taken, fresh):
        doc.pop("stages")
    assert taken["results"] and taken == fresh
    # a reranker's path: the candidates, then the finish in the reranker's order, both
    # with the first statement's plan
    made, cands = _plans_made(
        conn,
        "SELECT memory._serve(%s, %s, %s, NULL, 'candidates', %s)",
        (Jsonb(req), Jsonb(caps), emb, Jsonb(prefetched)),
    )
    assert made == 0
    order = [int(f["node_id"]) for f in cands["state"]["fused"]][::-1]
    finish_sql = "SELECT memory._serve_finish(%s, %s, %s, %s, %s, NULL)"
    made, reranked = _plans_made(
        conn, finish_sql, (Jsonb(req), Jsonb(caps), Jsonb(cands["state"]), emb, order)
    )
    assert made == 0
    unplanned = {k: v for k, v in cands["state"].items() if k != "planned_for"}
    made, replanned = _plans_made(
        conn, finish_sql, (Jsonb(req), Jsonb(caps), Jsonb(unplanned), emb, order)
    )
    assert made == 1
    for doc in (reranked, replanned):
        doc.pop("stages")
    assert [r["node_id"] for r in reranked["results"]] == order[: len(reranked["results"])]
    assert reranked == replanned
    # other caps (the embedding failed since): planned again, and routed without the vector
    failed = {**caps, "vector": False, "embed_failed": "test"}
    made, degraded = _plans_made(
        conn, serve_sql, (Jsonb(req), Jsonb(failed), None, Jsonb(prefetched))
    )
    assert made == 1
    assert degraded["search_strategy"] == "LexicalOnly"
