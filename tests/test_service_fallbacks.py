"""GET /memory/query when things are slow, down or missing: deadlines that really cancel
work in PostgreSQL, parallel legs, and every fallback with its degraded entry (embedder,
lexical engine, OpenSearch, reranker, database)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from doubles.embedding_server import EmbeddingServer, run_embedding_server
from doubles.opensearch_server import OpenSearchServer, run_opensearch_server
from doubles.rerank_server import RerankServer, run_rerank_server
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LOCAL_MODEL_NAME, LocalEmbedder
from poimen_memory.ingest.outbox import reindex
from poimen_memory.upstreams.opensearch import OpenSearchEngine
from service_client import KONG, query, serve

INDEX = "poimen-service-test"

# A request that a deadline or an upstream timeout cut short ends well before the 5-10 s
# hangs simulated here. The bound tells the two apart with room for a loaded CI machine;
# how fast the cut is belongs to the benchmarks, not to a test.
CUT_SHORT_S = 3.0

Conn = psycopg.Connection[Any]


def degraded(body: dict[str, Any], stage: str) -> list[str]:
    return [d["reason"] for d in body["degraded"] if d["stage"] == stage]


def pg_lexical_ranks(url: str, text: str, k: int = 50) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT encode(n.sha256, 'hex'), l.rank "
            "FROM memory.lexical_search(%s, NULL, '{L1,L2}', %s) l "
            "JOIN memory.nodes n ON n.id = l.node_id",
            (text, k),
        ).fetchall()
    return dict(rows)


def lexical_ranks(body: dict[str, Any]) -> dict[str, int]:
    return {r["sha256"]: r["lexical_rank"] for r in body["results"] if r["lexical_rank"]}


# -- slowed-down SQL legs (wrappers installed in the per-test clone) ----------------------

SLOW_SQL = {
    "lexical_search": """
        ALTER FUNCTION memory.lexical_search(text, text, text[], integer,
                                             double precision, double precision,
                                             timestamptz, timestamptz, boolean, jsonb,
                                             timestamptz, timestamptz)
            RENAME TO lexical_search_real;
        CREATE FUNCTION memory.lexical_search(query text, project text DEFAULT NULL,
                                              levels text[] DEFAULT NULL, k integer DEFAULT 50,
                                              k1 double precision DEFAULT 1.2,
                                              b double precision DEFAULT 0.75,
                                              since timestamptz DEFAULT NULL,
                                              before timestamptz DEFAULT NULL,
                                              exhaustive boolean DEFAULT false,
                                              filter jsonb DEFAULT NULL,
                                              as_of timestamptz DEFAULT NULL,
                                              valid_at timestamptz DEFAULT NULL)
        RETURNS TABLE (node_id bigint, rank integer, lexical_score double precision)
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_sleep({seconds});
            RETURN QUERY SELECT * FROM memory.lexical_search_real(query, project, levels, k, k1, b,
                                                                  since, before, exhaustive,
                                                                  filter, as_of, valid_at);
        END $$;""",
    "semantic_search": """
        ALTER FUNCTION memory.semantic_search(vector, text, text[], integer, integer,
                                              timestamptz, timestamptz, jsonb, jsonb,
                                              timestamptz, timestamptz)
            RENAME TO semantic_search_real;
        CREATE FUNCTION memory.semantic_search(query_embedding vector, project text DEFAULT NULL,
                                               levels text[] DEFAULT NULL, k integer DEFAULT 50,
                                               ef_search integer DEFAULT NULL,
                                               since timestamptz DEFAULT NULL,
                                               before timestamptz DEFAULT NULL,
                                               filter jsonb DEFAULT NULL,
                                               grammar jsonb DEFAULT NULL,
                                               as_of timestamptz DEFAULT NULL,
                                               valid_at timestamptz DEFAULT NULL)
        RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_sleep({seconds});
            RETURN QUERY SELECT * FROM memory.semantic_search_real(query_embedding, project,
                                                                   levels, k, ef_search,
                                                                   since, before, filter,
                                                                   grammar, as_of, valid_at);
        END $$;""",
}


def slow_down(url: str, function: str, seconds: float) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SLOW_SQL[function].replace("{seconds}", repr(seconds)))


def busy_backends(admin: Conn, url: str, settle_s: float = 0.5) -> list[tuple[Any, ...]]:
    """Backends of the test database doing anything but idling, after at most ``settle_s``
    (the server needs a moment to process a cancel; a leaked pg_sleep would stay busy)."""
    dbname = conninfo_to_dict(url)["dbname"]
    give_up = time.monotonic() + settle_s
    while True:
        rows = admin.execute(
            "SELECT pid, state, query FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid() AND state <> 'idle'",
            (dbname,),
        ).fetchall()
        if not rows or time.monotonic() > give_up:
            return rows
        time.sleep(0.02)


def test_the_legs_are_timed_where_they_ran(fixture_url: str, embedder: LocalEmbedder) -> None:
    """The database runs the lexical leg in the first statement (beside the embedding) and
    the semantic leg in the second, and times each there: the request takes both."""
    slow_down(fixture_url, "lexical_search", 0.5)
    slow_down(fixture_url, "semantic_search", 0.5)
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        body = query(client, query=KONG, evidence=0)
    m = body["metrics"]
    assert body["search_strategy"] == "Hybrid"
    assert m["lexical_time_ms"] >= 500 and m["semantic_time_ms"] >= 500
    assert m["database_time_ms"] >= m["semantic_time_ms"], m
    assert m["total_time_ms"] >= m["lexical_time_ms"] + m["semantic_time_ms"], m
    assert any(r["semantic_rank"] and r["lexical_rank"] for r in body["results"])


# -- deadlines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedding_double() -> Iterator[EmbeddingServer]:
    with run_embedding_server(dim=384) as server:
        yield server


@pytest.fixture
def embeddings(embedding_double: EmbeddingServer) -> EmbeddingServer:
    embedding_double.reset(dim=384)
    return embedding_double


def remote_env(url: str, server: EmbeddingServer, **extra: str) -> dict[str, str]:
    """The remote embedder (the test double) under the name and dim of the fixture
    database's model, so the service uses it; another name is a model_mismatch."""
    return {
        "POIMEN_DATABASE_URL": url,
        "POIMEN_EMBEDDINGS_URL": server.url,
        "POIMEN_EMBEDDINGS_MODEL": LOCAL_MODEL_NAME,
        "POIMEN_EMBEDDINGS_DIM": "384",
        **extra,
    }


def test_slow_embedder_times_out_and_leaves_nothing_running(
    fixture_url: str, admin: Conn, embeddings: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    embeddings.reset(dim=384, delay_s=10)
    # The lexical leg starts while the query is embedded; make it still be running in
    # PostgreSQL when the deadline passes.
    slow_down(fixture_url, "lexical_search", 5)
    with serve(remote_env(fixture_url, embeddings)) as client:
        started = time.monotonic()
        response = client.get("/memory/query", params={"query": KONG, "timeout_seconds": 1})
        elapsed = time.monotonic() - started
        assert busy_backends(admin, fixture_url) == []
        # The app is healthy afterwards: the pool got its connections back.
        assert client.get("/healthz").json()["checks"]["database"]["ok"] is True
    assert response.status_code == 503
    body = response.json()
    # The embedder gets the deadline less the fallback reserve and gives up first; the
    # lexical fallback is hung too, so the deadline ends the request.
    # Whichever fires first (PostgreSQL's statement_timeout or the service's own), the
    # detail names the stage the request was waiting for.
    assert body["error"] == "timeout" and "lexical" in body["detail"], body
    assert 0.95 <= elapsed < CUT_SHORT_S
    # One query embedding, and the /healthz probe's own.
    assert [r.body["input"] for r in embeddings.embedding_requests] == [[KONG], ["health check"]]
    # The abandoned lexical leg was cancelled, not left to fail unobserved.
    assert "Task exception was never retrieved" not in caplog.text


def test_slow_sql_is_cancelled_at_the_deadline(
    fixture_url: str, embedder: LocalEmbedder, admin: Conn
) -> None:
    slow_down(fixture_url, "semantic_search", 10)
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        started = time.monotonic()
        response = client.get("/memory/query", params={"query": KONG, "timeout_seconds": 1})
        elapsed = time.monotonic() - started
        assert busy_backends(admin, fixture_url) == []
        assert query(client, query="kong")["results"]  # LexicalOnly: no semantic leg, still works
    assert response.status_code == 503 and response.json()["error"] == "timeout"
    assert "semantic" in response.json()["detail"]
    assert 0.95 <= elapsed < CUT_SHORT_S


# -- embedder failures ------------------------------------------------------------------------


def test_a_forced_semantic_query_whose_embedder_fails_answers_from_opensearch(
    fixture_url: str, embeddings: EmbeddingServer, opensearch: OpenSearchServer
) -> None:
    """SemanticOnly names no lexical leg, so the first plan asks nothing of OpenSearch; when
    the embedder then fails, the plan becomes LexicalOnly and its lexical leg OpenSearch's,
    which the service then asks (one statement more, on this path only)."""
    embeddings.reset(dim=384, fail_status=500)
    env = {**remote_env(fixture_url, embeddings), **opensearch_env(fixture_url, opensearch)}
    with serve(env) as client:
        body = query(client, query=KONG, project="poimen", strategy="SemanticOnly")
    assert body["search_strategy"] == "LexicalOnly" and body["results"]
    assert body["plan"]["engines"]["lexical"] == "opensearch"
    assert degraded(body, "embed") and not degraded(body, "lexical")
    assert len(opensearch.requests_to("/_search")) == 1


def test_a_hung_embedder_degrades_to_the_lexical_answer_before_the_deadline(
    fixture_url: str, embeddings: EmbeddingServer
) -> None:
    embeddings.reset(dim=384, delay_s=10)
    with serve(remote_env(fixture_url, embeddings)) as client:
        started = time.monotonic()
        body = query(client, query=KONG, timeout_seconds=1)
        elapsed = time.monotonic() - started
    # A 200 at all means the answer beat the 1 s deadline (else a 503 timeout).
    assert elapsed < CUT_SHORT_S
    assert body["search_strategy"] == "LexicalOnly" and body["results"]
    assert degraded(body, "embed") == ["timeout"]


def test_embedder_failure_falls_back_to_lexical_only(
    fixture_url: str, embeddings: EmbeddingServer
) -> None:
    embeddings.reset(dim=384, fail_status=500)
    with serve(remote_env(fixture_url, embeddings)) as client:
        body = query(client, query=KONG, limit=10)
    assert body["plan"]["optimizer_strategy"] == "Hybrid"
    assert body["search_strategy"] == "LexicalOnly"
    assert degraded(body, "embed") == ["http_500"]
    assert "embedder unavailable (http_500): fell back to LexicalOnly" in body["notes"]
    results = body["results"]
    assert results and results[0]["source"] == "poimen:mem:1"
    assert all(r["query_score"] is None and r["semantic_rank"] is None for r in results)
    assert lexical_ranks(body) == {
        sha: rank for sha, rank in pg_lexical_ranks(fixture_url, KONG).items() if rank <= 10
    }
    assert body["plan"]["engines"] == {"lexical": "postgres-bm25", "rerank": None}


def test_embedder_failure_without_lexical_engine_is_503(
    fixture_url: str, embeddings: EmbeddingServer
) -> None:
    embeddings.reset(dim=384, fail_status=502)
    with serve(remote_env(fixture_url, embeddings, POIMEN_PG_LEXICAL="off")) as client:
        response = client.get("/memory/query", params={"query": KONG})
    assert response.status_code == 503
    body = response.json()
    assert body["error"] == "embedding_service_unavailable"
    assert "no lexical engine" in body["detail"] and "502" in body["context"]


# -- lexical engine selection -----------------------------------------------------------------


def test_without_opensearch_postgres_does_the_lexical_leg(
    fixture_url: str, embedder: LocalEmbedder
) -> None:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        body = query(client, query=KONG, limit=10, min_cosine=-1)  # every lexical rank
    assert body["search_strategy"] == "Hybrid"
    assert body["plan"]["engines"]["lexical"] == "postgres-bm25"
    assert not degraded(body, "lexical")
    assert lexical_ranks(body) == {
        sha: rank for sha, rank in pg_lexical_ranks(fixture_url, KONG).items() if rank <= 10
    }


@pytest.mark.parametrize("text", [KONG, "kong"])  # routed Hybrid, routed LexicalOnly
def test_no_lexical_engine_means_semantic_only(
    fixture_url: str, embedder: LocalEmbedder, text: str
) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_PG_LEXICAL": "off"}
    with serve(env, embedder) as client:
        body = query(client, query=text)
        engines = client.get("/healthz").json()["engines"]
    assert body["search_strategy"] == "SemanticOnly"
    assert degraded(body, "lexical") == ["no_lexical_engine"]
    assert "became SemanticOnly" in body["notes"]
    assert body["results"]
    assert all(r["lexical_rank"] is None and r["semantic_rank"] for r in body["results"])
    assert "lexical" not in body["plan"]["engines"]
    assert body["metrics"]["lexical_time_ms"] is None
    assert body["metrics"]["lexical_candidates"] is None
    assert engines["lexical"] is None


# -- OpenSearch (REST double) -----------------------------------------------------------------


@pytest.fixture
def opensearch(fixture_url: str) -> Iterator[OpenSearchServer]:
    """The double, holding the fixture's documents (rebuilt from Postgres by reindex)."""
    with run_opensearch_server() as server:
        with (
            connect(fixture_url, autocommit=True) as conn,
            OpenSearchEngine(server.url, INDEX) as engine,
        ):
            assert reindex(conn, engine, progress=False) == 21
        server.requests.clear()
        yield server


def opensearch_env(url: str, server: OpenSearchServer, **extra: str) -> dict[str, str]:
    return {
        "POIMEN_DATABASE_URL": url,
        "POIMEN_OPENSEARCH_URL": server.url,
        "POIMEN_OPENSEARCH_INDEX": INDEX,
        **extra,
    }


def test_opensearch_does_the_lexical_leg_with_the_seed_body(
    fixture_url: str, embedder: LocalEmbedder, opensearch: OpenSearchServer
) -> None:
    with serve(opensearch_env(fixture_url, opensearch), embedder) as client:
        body = query(client, query=KONG, project="poimen", limit=10)
    assert body["plan"]["engines"]["lexical"] == "opensearch"
    assert not degraded(body, "lexical")
    searches = opensearch.requests_to("/_search")
    assert len(searches) == 1
    sent = searches[0]
    assert sent.path == f"/{INDEX}/_search" and sent.params == {"_source": "false"}
    assert sent.body == {
        "size": 50,
        "query": {
            "bool": {
                "must": [
                    {
                        "multi_match": {
                            "query": KONG,
                            "fields": ["content^2", "section_title^1.5", "breadcrumb", "source"],
                            "fuzziness": "AUTO",
                        }
                    }
                ],
                "filter": [
                    {"term": {"project_id": "poimen"}},
                    {"terms": {"level": ["L1", "L2"]}},
                ],
            }
        },
    }
    # Lexical ranks and scores are the double's, joined back to nodes by sha256.
    hits = opensearch.search(INDEX, sent.body, source=False)["hits"]["hits"]
    assert body["results"] and all(r["project"] == "poimen" for r in body["results"])
    for r in body["results"]:
        if r["lexical_rank"] is not None:
            hit = hits[r["lexical_rank"] - 1]
            assert hit["_id"] == r["sha256"] and hit["_score"] == r["lexical_score"]
    assert any(r["lexical_rank"] and r["semantic_rank"] for r in body["results"])


def test_the_semantic_leg_runs_while_opensearch_answers(
    fixture_url: str, embedder: LocalEmbedder, opensearch: OpenSearchServer
) -> None:
    """The legs run side by side with OpenSearch too: the semantic leg (slowed to 1 s) does
    not wait for OpenSearch's answer (delayed 1 s), and fusion waits for both. So the legs'
    share of the request (the request less its other stages) lasts about as long as the
    longer leg, not the two together (2 s), and lexical_time_ms is the OpenSearch call's
    time (with the join of its hits). The legs one after the other would last their sum;
    side by side they stay half a leg under it, a margin a busy machine's slower statements
    (each leg measured as it ran) do not use up."""
    slow_down(fixture_url, "semantic_search", 1.0)
    opensearch.search_delay_s = 1.0
    with serve(opensearch_env(fixture_url, opensearch), embedder) as client:
        query(client, query=KONG, evidence=0)  # warm: connections, plans, the embedder
        body = query(client, query=KONG, evidence=0)
    m = body["metrics"]
    assert body["search_strategy"] == "Hybrid"
    assert body["plan"]["engines"]["lexical"] == "opensearch"
    assert not degraded(body, "lexical") and not degraded(body, "semantic")
    assert m["lexical_time_ms"] >= m["opensearch_time_ms"] >= 1000
    assert m["semantic_time_ms"] >= 1000
    # The embedding runs beside the first statement, so it is no stage to take out: the
    # warm-up made it a cache hit. Fusion and provenance run after both legs.
    assert m["embedding_cache_hit"] is True
    legs = m["total_time_ms"] - m["fusion_time_ms"] - (m.get("provenance_time_ms") or 0)
    longer = max(m["semantic_time_ms"], m["lexical_time_ms"])
    assert longer <= legs < m["semantic_time_ms"] + m["lexical_time_ms"] - 500, m
    assert any(r["semantic_rank"] and r["lexical_rank"] for r in body["results"])


@pytest.mark.parametrize("failure", ["down", "slow"])
def test_opensearch_failure_falls_back_to_postgres(
    fixture_url: str, embedder: LocalEmbedder, opensearch: OpenSearchServer, failure: str
) -> None:
    env = opensearch_env(fixture_url, opensearch, POIMEN_OPENSEARCH_TIMEOUT_S="0.3")
    with serve(env, embedder) as client:
        assert query(client, query=KONG)["plan"]["engines"]["lexical"] == "opensearch"
        if failure == "down":
            opensearch.down = True
        else:
            opensearch.delay_s = 6.0
        started = time.monotonic()
        body = query(client, query=KONG, limit=10, min_cosine=-1)  # every lexical rank
        elapsed = time.monotonic() - started
    assert degraded(body, "lexical") == [
        "opensearch_http_503" if failure == "down" else "opensearch_timeout"
    ]
    assert "OpenSearch unavailable, used Postgres lexical" in body["notes"]
    assert body["plan"]["engines"]["lexical"] == "postgres-bm25"
    assert body["search_strategy"] == "Hybrid"
    assert lexical_ranks(body) == {
        sha: rank for sha, rank in pg_lexical_ranks(fixture_url, KONG).items() if rank <= 10
    }
    assert elapsed < CUT_SHORT_S  # POIMEN_OPENSEARCH_TIMEOUT_S, not the double's 6 s delay


def test_opensearch_down_and_no_postgres_lexical(
    fixture_url: str, embedder: LocalEmbedder, opensearch: OpenSearchServer
) -> None:
    opensearch.down = True
    env = opensearch_env(fixture_url, opensearch, POIMEN_PG_LEXICAL="off")
    with serve(env, embedder) as client:
        body = query(client, query=KONG)
    assert body["search_strategy"] == "Hybrid"
    assert degraded(body, "lexical") == ["opensearch_http_503"]
    assert body["results"] and all(r["lexical_rank"] is None for r in body["results"])
    assert body["metrics"]["lexical_candidates"] is None  # no lexical leg ran


# -- reranker failures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rerank_double() -> Iterator[RerankServer]:
    with run_rerank_server() as server:
        yield server


@pytest.fixture
def rerank(rerank_double: RerankServer) -> RerankServer:
    rerank_double.reset()
    return rerank_double


def test_rerank_not_configured(fixture_url: str, embedder: LocalEmbedder) -> None:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        body = query(client, query=KONG)
    assert degraded(body, "rerank") == ["not_configured"]
    assert body["plan"]["engines"]["rerank"] is None
    assert all(r["rerank_score"] is None for r in body["results"])
    assert "reranker" not in body["notes"]


def fused_order(url: str, embedder: LocalEmbedder, **params: Any) -> list[str]:
    with serve({"POIMEN_DATABASE_URL": url}, embedder) as client:
        return [r["sha256"] for r in query(client, **params)["results"]]


@pytest.mark.parametrize(
    ("knobs", "env", "timeout_s", "reason"),
    [
        # POIMEN_RERANK_TIMEOUT_S bounds the call well inside the request's deadline.
        ({"delay_s": 5.0}, {"POIMEN_RERANK_TIMEOUT_S": "0.3"}, 5, "timeout"),
        # A short request deadline: the rerank gives up in time to still answer. The
        # answer's reserve is raised from 0.25 s so that three test workers on two cores
        # cannot eat it (CI once needed more than 0.25 s for provenance and evidence); the
        # deadline stays below CUT_SHORT_S, so the bound below can never meet it.
        ({"delay_s": 5.0}, {"POIMEN_RERANK_MIN_REMAINING_S": "1.0"}, 2, "timeout"),
        ({"fail_status": 500}, {}, 5, "http_500"),
        ({"malformed": True}, {}, 5, "bad_response"),
    ],
)
def test_rerank_failure_keeps_the_fused_order(
    fixture_url: str,
    embedder: LocalEmbedder,
    rerank: RerankServer,
    knobs: dict[str, Any],
    env: dict[str, str],
    timeout_s: float,
    reason: str,
) -> None:
    # The floor off (min_cosine -1): the reranker is sent its whole depth of candidates,
    # not the few of the fixture's 21 nodes above the relevance floor.
    expected = fused_order(fixture_url, embedder, query=KONG, min_cosine=-1)
    rerank.reset(**knobs)
    full_env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_RERANK_URL": rerank.url, **env}
    with serve(full_env, embedder) as client:
        started = time.monotonic()
        body = query(client, query=KONG, timeout_seconds=timeout_s, min_cosine=-1)
        elapsed = time.monotonic() - started
    assert degraded(body, "rerank") == [reason]
    assert f"reranker failed ({reason}): kept the fused order" in body["notes"]
    assert [r["sha256"] for r in body["results"]] == expected
    assert all(r["rerank_score"] is None for r in body["results"])
    finals = [r["final_score"] for r in body["results"]]
    assert finals == sorted(finals, reverse=True)
    assert elapsed < CUT_SHORT_S
    assert len(rerank.requests) == 1 and 5 < len(rerank.requests[0].body["documents"]) <= 15


def test_rerank_scores_missing_for_some_candidates(
    fixture_url: str, embedder: LocalEmbedder, rerank: RerankServer
) -> None:
    """A reranker may return fewer results than documents: the scored ones lead, the rest
    follow in fused order without a rerank_score."""
    expected = fused_order(fixture_url, embedder, query=KONG, limit=9)
    rerank.reset(scores=[0.2, 0.9])  # only the first two documents get a score
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_RERANK_URL": rerank.url}
    with serve(env, embedder) as client:
        body = query(client, query=KONG, limit=3)
    got = [(r["sha256"], r["rerank_score"]) for r in body["results"]]
    assert got == [(expected[1], 0.9), (expected[0], 0.2), (expected[2], None)]


def test_a_query_embedded_by_another_model_is_not_scored_semantically(
    fixture_url: str, embeddings: EmbeddingServer
) -> None:
    env = {**remote_env(fixture_url, embeddings), "POIMEN_EMBEDDINGS_MODEL": "other-model"}
    with serve(env) as client:
        first = query(client, query=KONG)
        body = query(client, query=KONG + " again")
    for b in (first, body):
        assert b["search_strategy"] == "LexicalOnly" and b["results"]
        assert degraded(b, "embed") == ["model_mismatch"]
        assert all(r["semantic_rank"] is None for r in b["results"])
    # The first query's embedding started beside its plan (the service had not seen the
    # database's model yet) and was dropped; once seen, no query is embedded for nothing.
    assert [r.body["input"] for r in embeddings.embedding_requests] in ([], [[KONG]])


# -- the database ------------------------------------------------------------------------------


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_database_unreachable_is_503(embedder: LocalEmbedder) -> None:
    url = f"postgresql://postgres@127.0.0.1:{unused_port()}/nowhere?connect_timeout=1"
    with serve({"POIMEN_DATABASE_URL": url}, embedder) as client:  # starts: the pool is lazy
        started = time.monotonic()
        response = client.get("/memory/query", params={"query": KONG, "timeout_seconds": 1})
        elapsed = time.monotonic() - started
        post = client.post(
            "/memory/nodes", content='{"project": "p", "level": "L0", "text": "evidence"}'
        )
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "database_unavailable"
    assert elapsed < CUT_SHORT_S
    assert post.status_code == 503 and post.json()["error"] == "database_unavailable"


def test_a_hung_embedder_holds_an_ingest_slot_only_for_the_writes_time(
    fixture_url: str, embeddings: EmbeddingServer
) -> None:
    """A write behind an embedding server that never answers gets the write's time
    (POIMEN_INGEST_TIMEOUT_S), retries included, not attempts x timeout (10 s x 4 was
    42.5 s): with 1 s for the write and 10 s for each attempt, the server sees one attempt
    per write, each write is a 503 that wrote nothing, and the one ingest slot is free again
    for the next (no 503 busy)."""
    env = remote_env(
        fixture_url, embeddings,
        POIMEN_INGEST_TIMEOUT_S="1", POIMEN_EMBEDDINGS_TIMEOUT_S="10",
        POIMEN_INGEST_WORKERS="1", POIMEN_INGEST_QUEUE="0",
    )  # fmt: skip
    node = {"id": "hung:1", "level": "L0", "project": "poimen", "text": "never embedded"}
    with serve(env) as client:
        embeddings.reset(dim=384, delay_s=30)
        bodies = []
        for i in range(2):
            r = client.post("/memory/nodes", json=[{**node, "id": f"hung:{i}"}])
            assert r.status_code == 503, r.text
            bodies.append(r.json())
        sent = embeddings.embedding_requests
        documents = [r for r in sent if r.body["input"] != ["health check"]]
    assert [b["error"] for b in bodies] == ["embedding_service_unavailable"] * 2, bodies
    assert len(documents) == 2, [r.body["input"] for r in documents]
    with connect(fixture_url) as conn:
        gone = conn.execute("SELECT count(*) FROM memory.nodes WHERE external_id LIKE 'hung:%'")
        assert gone.fetchone() == (0,)
