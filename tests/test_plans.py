"""Plans a DBA can read: the HNSW, primary-key and BM25 btree indexes are really used, and the
iterative scan keeps a selective filter from starving the HNSW result (pgvector #259)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from conftest import force_parallel, prepare_conn, prepare_database
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate

Conn = psycopg.Connection[Any]
DIM = 32
# Raw pgvector SQL written by a client (not our functions) needs the operator on its path.
CLIENT_PATH = "SET LOCAL search_path = public, extensions"
N = 6000


@pytest.fixture(scope="module")
def synthetic(cluster: Any, admin: Conn, plpython_root: Path) -> Iterator[Conn]:
    """6,000 random unit vectors; project 'rare' holds 1% of them, spread over the graph."""
    name = "t_plans"
    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.execute(f"CREATE DATABASE {name}")
    with connect(cluster.url(name), autocommit=True) as conn:
        prepare_database(conn)
        migrate(conn, plpython_root)
        conn.execute("SELECT memory.configure_embedding('synthetic', %s)", (DIM,))
        conn.execute("INSERT INTO memory.projects (name) VALUES ('big'), ('rare')")
        rng = np.random.default_rng(7)
        vecs = rng.normal(size=(N, DIM)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        with conn.cursor().copy(
            "COPY memory.nodes (sha256, project_id, level, text, embedding) FROM STDIN"
        ) as copy:
            for i, v in enumerate(vecs):
                project = 2 if i % 100 == 0 else 1
                level = ("L0", "L1", "L2")[i % 3]
                words = f"topic{i % 50} word{i % 7} item{i}"
                vec = "[" + ",".join(f"{x:.6f}" for x in v) + "]"
                copy.write_row((i.to_bytes(32, "big"), project, level, words, vec))
        conn.execute("ANALYZE memory.nodes")
        conn.execute("ANALYZE memory.postings")
        yield prepare_conn(conn)
    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _nested_plans(conn: Conn, sql: str, params: tuple[Any, ...]) -> list[str]:
    """Run ``sql`` with auto_explain so the plans of the statements *inside* our functions
    come back as NOTICEs, exactly as a DBA would capture them (docs/sql-api.md)."""
    notices: list[str] = []

    def handler(d: psycopg.errors.Diagnostic) -> None:
        notices.append(d.message_primary or "")

    conn.add_notice_handler(handler)
    with conn.transaction():
        conn.execute("LOAD 'auto_explain'")
        for k, v in [
            ("log_min_duration", "0"),
            ("log_nested_statements", "on"),
            ("log_level", "notice"),
            ("log_format", "json"),
        ]:
            conn.execute(f"SET LOCAL auto_explain.{k} = '{v}'")
        conn.execute("SET LOCAL client_min_messages = notice")
        # A forced Gather would run the function in a worker, whose auto_explain output goes
        # to the server log, not to this client (the SQL-mode run sets it cluster-wide).
        conn.execute(f"SET LOCAL {force_parallel(conn)} = off")
        conn.execute(sql, params).fetchall()
    conn.remove_notice_handler(handler)
    return notices


def _index_names(plans: list[str]) -> set[str]:
    import json

    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "Index Name" in node:
            found.add(node["Index Name"])
        for child in node.get("Plans", []):
            walk(child)

    for text in plans:
        body = text[text.index("{") :] if "{" in text else ""
        if body:
            walk(json.loads(body)["Plan"])
    return found


def _query_vec(seed: int) -> str:
    v = np.random.default_rng(seed).normal(size=DIM)
    return "[" + ",".join(str(x) for x in v / np.linalg.norm(v)) + "]"


def test_semantic_search_uses_hnsw(synthetic: Conn) -> None:
    plans = _nested_plans(
        synthetic,
        "SELECT * FROM memory.semantic_search(%s, NULL, NULL, 10)",
        (_query_vec(1),),
    )
    assert "nodes_embedding_hnsw" in _index_names(plans)


def test_explain_format_json_of_the_recall_statement(synthetic: Conn) -> None:
    """The same ORDER BY distance LIMIT k statement, through plain EXPLAIN (FORMAT JSON)."""
    with synthetic.transaction():
        synthetic.execute(CLIENT_PATH)
        plan = synthetic.execute(
            "EXPLAIN (FORMAT JSON) SELECT id FROM memory.nodes ORDER BY embedding <=> %s LIMIT 10",
            (_query_vec(2),),
        ).fetchone()[0]  # type: ignore[index]
    assert "nodes_embedding_hnsw" in _index_names([__import__("json").dumps(plan[0])])


def test_search_by_ids_uses_primary_key(synthetic: Conn) -> None:
    plans = _nested_plans(
        synthetic,
        "SELECT * FROM memory.search_by_ids(%s, %s)",
        (_query_vec(3), list(range(1, 200, 7))),
    )
    assert "nodes_pkey" in _index_names(plans)


def test_lexical_search_uses_postings_btree(synthetic: Conn) -> None:
    # 'rare' holds topic0 and word0..word6 (every 100th node); terms without postings in
    # the project are dropped from term_stats before any posting is read.
    for exhaustive in (False, True):
        plans = _nested_plans(
            synthetic,
            "SELECT * FROM memory.lexical_search('topic0 word3 item42', 'rare', exhaustive => %s)",
            (exhaustive,),
        )
        assert "postings_pkey" in _index_names(plans)


@pytest.mark.parametrize("seed", range(5))
def test_selective_filter_still_fills_limit(synthetic: Conn, seed: int) -> None:
    matching = synthetic.execute(
        "SELECT count(*) FROM memory.nodes WHERE project_id = 2"
    ).fetchone()
    assert matching == (N // 100,)  # 1% of rows
    rows = synthetic.execute(
        "SELECT node_id FROM memory.semantic_search(%s, 'rare', NULL, 50)",
        (_query_vec(seed),),
    ).fetchall()
    assert len(rows) == 50
    exact = synthetic.execute(
        "SELECT node_id FROM memory.exact_search(%s, 'rare', NULL, 50)", (_query_vec(seed),)
    ).fetchall()
    assert len({r[0] for r in rows} & {r[0] for r in exact}) >= 45  # recall@50 >= 0.9


def test_without_iterative_scan_the_filter_starves(synthetic: Conn) -> None:
    """The failure mode our function avoids: plain HNSW + filter returns far fewer rows."""
    with synthetic.transaction():
        synthetic.execute(CLIENT_PATH)
        synthetic.execute("SET LOCAL hnsw.iterative_scan = off")
        synthetic.execute("SET LOCAL enable_seqscan = off")
        # project_id + 0 hides the btree, so only the HNSW path is left to the planner.
        rows = synthetic.execute(
            "SELECT id FROM memory.nodes WHERE project_id + 0 = 2"
            " ORDER BY embedding <=> %s LIMIT 50",
            (_query_vec(0),),
        ).fetchall()
    assert len(rows) < 50


def test_iterative_scan_fills_limit_on_the_hnsw_path(synthetic: Conn) -> None:
    """With the btrees out of the way the 1% filter is served by HNSW itself, and the
    iterative scan still returns the full limit (the failure case above returns less).
    Everything is rolled back afterwards."""
    plans: list[str] = []
    rows: list[tuple[Any, ...]] = []

    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), synthetic.transaction():
        # Leave the planner no other path: no btree with project_id in it, no seq scan.
        synthetic.execute("DROP INDEX memory.nodes_project_level_idx")
        synthetic.execute(
            "ALTER TABLE memory.nodes DROP CONSTRAINT nodes_external_id_revision_key,"
            " DROP CONSTRAINT nodes_sha256_key, DROP CONSTRAINT nodes_pkey CASCADE"
        )
        synthetic.execute("DROP INDEX memory.nodes_current_external_id")
        synthetic.execute("SET LOCAL enable_seqscan = off")
        plans = _nested_plans(
            synthetic,
            "SELECT * FROM memory.semantic_search(%s, 'rare', NULL, 50)",
            (_query_vec(0),),
        )
        rows = synthetic.execute(
            "SELECT node_id FROM memory.semantic_search(%s, 'rare', NULL, 50)",
            (_query_vec(0),),
        ).fetchall()
        raise Rollback
    assert "nodes_embedding_hnsw" in _index_names(plans)
    assert len(rows) == 50
    assert synthetic.execute(
        "SELECT count(*) FROM pg_indexes WHERE indexname = 'nodes_project_level_idx'"
    ).fetchone() == (1,)


def test_explain_query_shows_the_l1_l2_hnsw_index_at_the_default_levels(synthetic: Conn) -> None:
    """memory.explain_query returns the plan of the semantic stage the query ran: at the
    default levels (L1,L2) in one project the partial HNSW index serves it."""
    rows = synthetic.execute(
        "SELECT stage, search_strategy, plan, time_ms FROM memory.explain_query("
        "'topic1', %s, 'big', k => 10, strategy => 'SemanticOnly', actual => true, evidence => 0)",
        (_query_vec(4),),
    ).fetchall()
    assert [(r[0], r[1]) for r in rows] == [
        ("plan", "SemanticOnly"),
        ("semantic", "SemanticOnly"),
        ("fusion", "SemanticOnly"),
        ("provenance", "SemanticOnly"),
    ]
    assert rows[0][2]["semantic"] == {"engine": "hnsw", "depth": 10}
    assert all(r[3] is not None and r[3] >= 0 for r in rows[1:])
    plan = rows[1][2]
    assert _index_names([json.dumps(plan)]) == {"nodes_embedding_hnsw_l1_l2"}
    assert plan["Execution Time"] > 0  # actual => true: EXPLAIN ANALYZE


def test_explain_query_runs_under_the_semantic_stage_settings(synthetic: Conn) -> None:
    """The hnsw settings memory.semantic_search declares are explain_query's too (copied to its
    implementation, memory._explain, by sql/075_explain.sql), so the semantic plan it shows is
    the one run."""
    config = dict(
        synthetic.execute(
            "SELECT p.proname, ARRAY(SELECT c FROM unnest(p.proconfig) c WHERE c LIKE 'hnsw.%%')"
            " FROM pg_proc p WHERE p.pronamespace = 'memory'::regnamespace"
            " AND p.proname IN ('semantic_search', '_explain')"
        ).fetchall()
    )
    assert config["semantic_search"] == ["hnsw.iterative_scan=relaxed_order", "hnsw.ef_search=100"]
    assert config["_explain"] == config["semantic_search"]


def test_explain_query_of_a_lexical_first_cascade_shows_the_by_ids_stage(synthetic: Conn) -> None:
    rows = synthetic.execute(
        "SELECT stage, search_strategy, plan FROM memory.explain_query("
        "'topic0 word3', %s, 'rare', strategy => 'LexicalFirst', evidence => 0)",
        (_query_vec(5),),
    ).fetchall()
    stages = dict((r[0], r[2]) for r in rows)
    assert list(stages) == ["plan", "lexical", "by_ids", "fusion", "provenance"]
    assert {r[1] for r in rows} == {"LexicalFirst"}
    assert stages["by_ids"]["Plan"]["Node Type"] == "Limit"
