"""poimen_lab.eval.rm3, the RM3 measurement (docs/benchmarks.md: measured, not built), on
the fixture database: the SQL it measures, and its report."""

from __future__ import annotations

from typing import Any

import psycopg

from poimen_lab.eval.rm3 import RM3_SQL, measure

Conn = psycopg.Connection[Any]
QUESTIONS = ["kong upload body buffer", "postgres connection pool timeouts", "backup s3 bucket"]


def test_without_expansion_rm3_ranks_as_bm25(conn: Conn) -> None:
    """With the query's own terms at full weight the expansion weighs nothing, and every
    query weight is the same constant: the ranking must be BM25's, node for node."""
    conn.execute(RM3_SQL)
    for text in QUESTIONS:
        plain = conn.execute(
            "SELECT node_id FROM memory.lexical_search(%s, 'poimen', NULL, 10)", (text,)
        ).fetchall()
        rm3 = conn.execute(
            "SELECT node_id FROM pg_temp.rm3(%s, 'poimen', NULL, 10, 5, 10, 1.0)", (text,)
        ).fetchall()
        assert plain and rm3 == plain


def test_expansion_reaches_nodes_the_query_terms_do_not(conn: Conn) -> None:
    conn.execute(RM3_SQL)
    text = "kong upload"
    plain = {
        r[0]
        for r in conn.execute(
            "SELECT node_id FROM memory.lexical_search(%s, 'poimen', NULL, 50)", (text,)
        ).fetchall()
    }
    expanded = {
        r[0]
        for r in conn.execute(
            "SELECT node_id FROM pg_temp.rm3(%s, 'poimen', NULL, 50, 3, 10, 0.5)", (text,)
        ).fetchall()
    }
    assert plain < expanded  # the feedback terms (buffer, body, ...) match more


def test_measure_reports_plain_and_each_setting(fixture_url: str, conn: Conn) -> None:
    ids = dict(conn.execute("SELECT text, external_id FROM memory.nodes").fetchall())
    kong = next(ext for text, ext in ids.items() if text.startswith("Bob: Kong"))
    queries = [{"id": "q1", "text": "kong body buffer size", "project": "poimen", "category": 4}]
    out = measure(fixture_url, queries, {"q1": {kong: 1}}, ["L0"], [(3, 10, 0.5)])
    assert list(out) == ["plain", "3,10,0.5"]
    assert set(out["plain"]) == {"all", "4"}
    assert out["plain"]["all"][1] == 1.0 and out["plain"]["all"][2] == 1  # found, one query
    assert 0 < out["3,10,0.5"]["all"][0] <= 1
