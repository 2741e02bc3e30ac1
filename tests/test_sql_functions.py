"""Every SQL function against a real cluster: results, scores, edge cases and errors."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import numpy as np
import psycopg
import pytest

from poimen_memory.embedders.local import LocalEmbedder

Conn = psycopg.Connection[Any]


def ext_ids(conn: Conn, ids: list[int]) -> list[str]:
    rows = dict(
        conn.execute(
            "SELECT id, external_id FROM memory.nodes WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    )
    return [rows[i] for i in ids]


def node_id(conn: Conn, ext: str) -> int:
    row = conn.execute("SELECT id FROM memory.nodes WHERE external_id = %s", (ext,)).fetchone()
    assert row is not None
    return int(row[0])


# --- lexical (BM25) ---------------------------------------------------------------------


def test_lexical_finds_the_kong_memory(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT node_id, rank, lexical_score FROM "
        "memory.lexical_search('kong body buffer', 'poimen', '{L1}')"
    ).fetchall()
    assert ext_ids(conn, [r[0] for r in rows])[0] == "poimen:mem:1"
    assert [r[1] for r in rows] == list(range(1, len(rows) + 1))
    scores = [r[2] for r in rows]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)


def _reference_bm25(
    conn: Conn, query: str, project: str, k1: float = 1.2, b: float = 0.75
) -> dict[int, float]:
    """Okapi BM25 recomputed in Python from the raw tsvectors, not from our statistics."""
    docs = conn.execute(
        "SELECT n.id, n.tsv::text FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
        " WHERE p.name = %s",
        (project,),
    ).fetchall()
    tf: dict[int, Counter[str]] = {}
    for nid, tsv in docs:
        c: Counter[str] = Counter()
        for part in tsv.split(" "):
            lex, _, pos = part.rpartition(":")
            c[lex.strip("'")] = len(pos.split(","))
        tf[nid] = c
    terms = conn.execute(
        "SELECT tsvector_to_array(to_tsvector('english', %s))", (query,)
    ).fetchone()[0]  # type: ignore[index]
    n = len(tf)
    avgdl = sum(sum(c.values()) for c in tf.values()) / n
    out: dict[int, float] = {}
    for nid, c in tf.items():
        dl = sum(c.values())
        s = 0.0
        for t in terms:
            df = sum(1 for d in tf.values() if t in d)
            if c[t]:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                s += idf * c[t] * (k1 + 1) / (c[t] + k1 * (1 - b + b * dl / avgdl))
        if s > 0:
            out[nid] = s
    return out


@pytest.mark.parametrize(
    "query", ["kong body buffer", "postgres connection pool timeouts", "readiness probe port 8080"]
)
def test_lexical_scores_equal_reference_bm25(conn: Conn, query: str) -> None:
    ref = _reference_bm25(conn, query, "poimen")
    got = dict(
        (r[0], r[1])
        for r in conn.execute(
            "SELECT node_id, lexical_score FROM memory.lexical_search(%s, 'poimen', NULL, 100)",
            (query,),
        ).fetchall()
    )
    assert got.keys() == ref.keys()
    for nid, score in ref.items():
        assert got[nid] == pytest.approx(score, rel=1e-9)


def test_term_statistics_stay_exact_after_delete_and_update(conn: Conn) -> None:
    conn.execute("DELETE FROM memory.nodes WHERE external_id = 'poimen:chat:2'")
    conn.execute(
        "UPDATE memory.nodes SET text = 'kong kong kong body' WHERE external_id = 'poimen:chat:6'"
    )
    stored = dict(
        ((p, lx), df)
        for p, lx, df in conn.execute(
            "SELECT project_id, lexeme, df FROM memory.term_stats"
        ).fetchall()
    )
    recomputed = dict(
        ((p, lx), df)
        for p, lx, df in conn.execute(
            "SELECT n.project_id, u.lexeme, count(*) FROM memory.nodes n, unnest(n.tsv) u "
            "GROUP BY 1, 2"
        ).fetchall()
    )
    assert stored == recomputed
    corpus = conn.execute(
        "SELECT project_id, n_docs, total_len FROM memory.corpus_stats ORDER BY 1"
    ).fetchall()
    truth = conn.execute(
        "SELECT project_id, count(*), sum(lex_len) FROM memory.nodes GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert corpus == truth
    postings = conn.execute("SELECT count(*) FROM memory.postings").fetchone()
    assert (
        postings == conn.execute("SELECT count(*) FROM memory.nodes n, unnest(n.tsv) u").fetchone()
    )


def test_lexical_edge_cases(conn: Conn) -> None:
    assert conn.execute("SELECT * FROM memory.lexical_search('the and of')").fetchall() == []
    assert conn.execute("SELECT * FROM memory.lexical_search('zyzzyva')").fetchall() == []
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT * FROM memory.lexical_search('  ')")
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT * FROM memory.lexical_search('kong', 'nope')")
    assert exc.value.sqlstate == "PM404" and exc.value.diag.message_hint
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT * FROM memory.lexical_search('kong', NULL, '{L3}')")


def test_lexical_level_and_project_filters(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT n.level, p.name FROM memory.lexical_search('kong', 'atlas', '{L0}') l"
        " JOIN memory.nodes n ON n.id = l.node_id"
        " JOIN memory.projects p ON p.id = n.project_id"
    ).fetchall()
    assert rows and all(r == ("L0", "atlas") for r in rows)


# --- vectors ----------------------------------------------------------------------------


def test_semantic_search_ranks_by_cosine(conn: Conn, embedder: LocalEmbedder) -> None:
    q = embedder.embed_query("why did uploads bigger than ten kilobytes fail at the gateway?")
    rows = conn.execute(
        "SELECT node_id, rank, query_score FROM memory.semantic_search(%s, 'poimen', '{L1}', 3)",
        (q,),
    ).fetchall()
    assert ext_ids(conn, [r[0] for r in rows])[0] == "poimen:mem:1"
    stored = dict(
        conn.execute(
            "SELECT id, embedding FROM memory.nodes WHERE id = ANY(%s)", ([r[0] for r in rows],)
        ).fetchall()
    )
    for nid, _, score in rows:
        v = np.asarray(stored[nid].to_list())
        expected = float(v @ q / (np.linalg.norm(v) * np.linalg.norm(q)))
        assert score == pytest.approx(expected, abs=1e-5)
        assert 0.0 <= score <= 1.0


def test_semantic_search_rejects_wrong_dimension(conn: Conn) -> None:
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(
            "SELECT * FROM memory.semantic_search(%s)", (np.array([1, 2, 3], dtype=np.float32),)
        )
    assert exc.value.sqlstate == "PM409"


def test_search_by_ids_ranks_exactly_the_given_ids(conn: Conn, embedder: LocalEmbedder) -> None:
    q = embedder.embed_query("kong body buffer")
    ids = [node_id(conn, e) for e in ("poimen:mem:2", "poimen:mem:1", "atlas:mem:1")]
    rows = conn.execute(
        "SELECT node_id, rank, query_score FROM memory.search_by_ids(%s, %s)", (q, [*ids, 999_999])
    ).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    only_poimen = conn.execute(
        "SELECT node_id FROM memory.search_by_ids(%s, %s, 'poimen')", (q, ids)
    ).fetchall()
    assert {r[0] for r in only_poimen} == set(ids[:2])
    assert conn.execute("SELECT * FROM memory.search_by_ids(%s, '{}')", (q,)).fetchall() == []


# --- fusion -----------------------------------------------------------------------------


def fuse(
    conn: Conn, lists: list[dict[str, Any]], method: str = "rrf", k: int = 60, final_k: int = 50
) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT node_id, ranks, fused_score, fusion_method FROM memory.fuse(%s, %s, %s, %s)",
        (json.dumps(lists), method, k, final_k),
    ).fetchall()


def test_rrf_scores_and_ranks(conn: Conn) -> None:
    rows = fuse(conn, [{"ids": [10, 20, 30]}, {"ids": [30, 40]}])
    by_id = {r[0]: r for r in rows}
    assert by_id[30][2] == pytest.approx(1 / 63 + 1 / 61)
    assert by_id[30][1] == [3, 1] and by_id[40][1] == [None, 2]
    assert rows[0][0] == 30 and all(r[3] == "rrf" for r in rows)


def test_rrf_ties_break_deterministically(conn: Conn) -> None:
    rows = fuse(conn, [{"ids": [7, 5]}, {"ids": [5, 7]}])
    assert rows[0][2] == pytest.approx(rows[1][2])
    assert [r[0] for r in rows] == [5, 7]  # equal score, equal best rank: lower id first


def test_rrf_weights_k_and_final_k(conn: Conn) -> None:
    rows = fuse(
        conn, [{"ids": [1, 2], "weight": 0.0}, {"ids": [2, 1], "weight": 2.0}], k=10, final_k=1
    )
    assert len(rows) == 1 and rows[0][0] == 2 and rows[0][2] == pytest.approx(2 / 11)


def test_convex_combination_normalises_each_list(conn: Conn) -> None:
    lists = [
        {"ids": [1, 2, 3], "scores": [0.9, 0.5, 0.1], "weight": 0.6},
        {"ids": [3, 1], "scores": [12.0, 2.0], "weight": 0.4},
    ]
    rows = fuse(conn, lists, method="convex")
    by_id = {r[0]: r[2] for r in rows}
    assert by_id[1] == pytest.approx(0.6 * 1.0 + 0.4 * 0.0)
    assert by_id[3] == pytest.approx(0.6 * 0.0 + 0.4 * 1.0)
    assert by_id[2] == pytest.approx(0.6 * 0.5)


def test_fuse_errors(conn: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        fuse(conn, [{"ids": [1]}], method="borda")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT * FROM memory.fuse('{}'::jsonb)")
    assert fuse(conn, [{"ids": []}, {"ids": []}]) == []


# --- provenance -------------------------------------------------------------------------


def test_provenance_tree_reaches_l0_in_precedence_order(conn: Conn) -> None:
    tree = conn.execute(
        "SELECT memory.provenance_tree(%s)", (node_id(conn, "poimen:syn:1"),)
    ).fetchone()[0]  # type: ignore[index]
    assert [p["level"] for p in tree] == ["L1", "L1"]
    assert tree[0]["text"].startswith("Requests with bodies over 10KB")
    l0_texts = [g["text"] for g in tree[0]["parents"]]
    assert l0_texts[0].startswith("Alice: Uploads larger than 10KB")  # precedence 0 first
    assert any("client_body_buffer_size" in t for t in l0_texts)
    assert all(g["parents"] == [] for g in tree[0]["parents"])


def test_provenance_walk_survives_cycles_and_respects_depth(conn: Conn) -> None:
    syn, mem, chat = (node_id(conn, e) for e in ("poimen:syn:1", "poimen:mem:1", "poimen:chat:1"))
    conn.execute(
        "INSERT INTO memory.edges (child_id, parent_id, project_id)"
        " SELECT %s, %s, project_id FROM memory.nodes WHERE id = %s",
        (chat, syn, syn),
    )
    rows = conn.execute(
        "SELECT depth, parent_id FROM memory.provenance_walk(%s, 10)", ([syn],)
    ).fetchall()
    assert max(r[0] for r in rows) <= 3 and mem in {r[1] for r in rows}
    shallow = conn.execute(
        "SELECT max(depth) FROM memory.provenance_walk(%s, 1)", ([syn],)
    ).fetchone()
    assert shallow == (1,)
    tree = conn.execute("SELECT memory.provenance_tree(%s)", (syn,)).fetchone()[0]  # type: ignore[index]
    assert tree[0]["level"] == "L1"
    # Through the cycle chat:1 -> syn:1 -> mem:1 -> chat:1, the walk stops before revisiting.
    cyc = conn.execute("SELECT memory.provenance_tree(%s)", (chat,)).fetchone()[0]  # type: ignore[index]
    assert [p["source"] for p in cyc] == ["poimen:syn:1"]
    assert "poimen:chat:1" not in json.dumps(cyc)


def test_provenance_of_l0_and_unknown_is_empty(conn: Conn) -> None:
    assert conn.execute(
        "SELECT memory.provenance_tree(%s)", (node_id(conn, "poimen:chat:1"),)
    ).fetchone() == ([],)
    assert conn.execute("SELECT memory.provenance_tree(-1)").fetchone() == ([],)


def _stats_match(conn: Conn) -> None:
    stored = set(conn.execute("SELECT project_id, lexeme, df FROM memory.term_stats").fetchall())
    recomputed = set(
        conn.execute(
            "SELECT n.project_id, u.lexeme, count(*) FROM memory.nodes n, unnest(n.tsv) u"
            " GROUP BY 1, 2"
        ).fetchall()
    )
    assert stored == recomputed
    postings = set(conn.execute("SELECT node_id, lexeme, project_id, level FROM memory.postings"))
    truth = set(
        conn.execute(
            "SELECT n.id, u.lexeme, n.project_id, n.level FROM memory.nodes n, unnest(n.tsv) u"
        )
    )
    assert postings == truth


def test_stats_follow_project_and_level_changes(conn: Conn) -> None:
    atlas = conn.execute("SELECT id FROM memory.projects WHERE name = 'atlas'").fetchone()
    move = (
        "UPDATE memory.nodes SET project_id = %s, level = 'L0' WHERE external_id = 'poimen:mem:1'"
    )
    with pytest.raises(psycopg.errors.ForeignKeyViolation):  # its provenance stays in poimen
        conn.execute(move, (atlas[0] if atlas else None,))
    mem = node_id(conn, "poimen:mem:1")
    conn.execute("DELETE FROM memory.edges WHERE %s IN (child_id, parent_id)", (mem,))
    conn.execute(move, (atlas[0] if atlas else None,))
    _stats_match(conn)
    rows = conn.execute("SELECT node_id FROM memory.lexical_search('client_body_buffer_size', "
                        "'atlas', '{L0}')").fetchall()  # fmt: skip
    assert node_id(conn, "poimen:mem:1") in {r[0] for r in rows}


def test_embedding_only_update_leaves_postings_alone(conn: Conn) -> None:
    before = conn.execute("SELECT xmin::text, node_id, lexeme FROM memory.postings").fetchall()
    conn.execute("UPDATE memory.nodes SET embedding = embedding")
    assert (
        conn.execute("SELECT xmin::text, node_id, lexeme FROM memory.postings").fetchall() == before
    )


def test_truncate_resets_statistics(conn: Conn) -> None:
    conn.execute("TRUNCATE memory.nodes CASCADE")
    for table in ("postings", "term_stats", "corpus_stats"):
        assert conn.execute(f"SELECT count(*) FROM memory.{table}").fetchone() == (0,)


def test_semantic_search_skips_nodes_without_embedding(conn: Conn, embedder: LocalEmbedder) -> None:
    conn.execute("UPDATE memory.nodes SET embedding = NULL WHERE project_id = "
                 "(SELECT id FROM memory.projects WHERE name = 'poimen')")  # fmt: skip
    with conn.transaction():
        conn.execute("SET LOCAL enable_indexscan = off")  # the plan that used to leak NULLs
        rows = conn.execute("SELECT node_id, query_score FROM memory.semantic_search(%s, NULL, "
                            "NULL, 50)", (embedder.embed_query("kong"),)).fetchall()  # fmt: skip
    assert rows and all(score is not None for _, score in rows)
    assert {r[0] for r in rows}.isdisjoint({node_id(conn, "poimen:mem:1")})


def test_fuse_rejects_null_method_and_ignores_null_ids(conn: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT * FROM memory.fuse('[{\"ids\":[1]}]', NULL)")
    rows = fuse(conn, [{"ids": [None, 4]}])
    assert [r[0] for r in rows] == [4]
