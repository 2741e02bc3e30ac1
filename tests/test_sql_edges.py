"""SQL edge inputs answer with 22023 and a message naming the argument, never with NaN
scores or an error from inside PL/Python: NaN/Infinity weights and scores, the zero
query embedding, exact_search's cap on k, whitespace-only queries."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import psycopg
import pytest

from poimen_memory.embedders.local import LocalEmbedder

Conn = psycopg.Connection[Any]


def _fails(conn: Conn, sql: str, params: tuple[Any, ...] = (), *, names: str) -> None:
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(sql, params).fetchall()
    assert exc.value.sqlstate == "22023", (sql, exc.value)
    assert names in (exc.value.diag.message_primary or ""), exc.value


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_fuse_refuses_non_finite_weights_and_scores(conn: Conn, bad: str) -> None:
    weight = [{"ids": [1, 2]}, {"ids": [2, 3], "weight": bad}]
    scores = [{"ids": [1, 2], "scores": [0.5, bad]}, {"ids": [2], "scores": [1]}]
    _fails(conn, "SELECT * FROM memory.fuse(%s)", (json.dumps(weight),), names="lists[1].weight")
    _fails(
        conn,
        "SELECT * FROM memory.fuse(%s, 'convex')",
        (json.dumps(scores),),
        names="lists[0].scores",
    )
    # Finite values still fuse.
    ok = [{"ids": [1, 2], "scores": [0.5, 0.25]}, {"ids": [2], "scores": [1], "weight": 0.5}]
    rows = conn.execute(
        "SELECT node_id, fused_score FROM memory.fuse(%s, 'convex')", (json.dumps(ok),)
    )
    assert rows.fetchall() == [(1, 1.0), (2, 0.5)]  # min-max per list, then 1*1.0 vs 1*0 + 0.5*1


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1.5"])
def test_dense_weight_must_be_finite_within_0_1(conn: Conn, bad: str) -> None:
    leg = '{"ids":[1],"scores":[1]}'
    _fails(
        conn,
        "SELECT * FROM memory.fuse_legs(%s, %s, 'Hybrid', 'convex', %s::float8)",
        (leg, leg, bad),
        names="dense_weight",
    )
    _fails(
        conn,
        "SELECT * FROM public.memory_query('kong', dense_weight => %s::float8)",
        (bad,),
        names="dense_weight",
    )


@pytest.mark.parametrize("arg", ["k1", "b"])
def test_lexical_search_refuses_non_finite_bm25_parameters(conn: Conn, arg: str) -> None:
    for bad in ("NaN", "Infinity"):
        _fails(
            conn,
            f"SELECT * FROM memory.lexical_search('kong', {arg} => %s::float8)",
            (bad,),
            names=arg,
        )


def test_the_zero_query_embedding_is_refused_everywhere(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    zero = np.zeros(embedder.dim, dtype=np.float32)  # typed by pgvector's adapter
    ids = [r[0] for r in conn.execute("SELECT id FROM memory.nodes LIMIT 3").fetchall()]
    for sql, params in (
        ("SELECT * FROM memory.semantic_search(%s)", (zero,)),
        ("SELECT * FROM memory.exact_search(%s)", (zero,)),
        ("SELECT * FROM memory.search_by_ids(%s, %s)", (zero, ids)),
        ("SELECT * FROM memory.hydrate(%s, %s)", (ids, zero)),
        ("SELECT * FROM public.memory_query('kong', %s)", (zero,)),
        (
            "SELECT * FROM public.memory_query('kong', %s, strategy => 'Hybrid')",
            (zero,),
        ),
    ):
        _fails(conn, sql, params, names="query_embedding is the zero vector")


def test_exact_search_caps_k_and_the_owner_sets_the_cap(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    vec = embedder.embed_query("kong")
    sql = "SELECT count(*) FROM memory.exact_search(%s, k => %s)"
    assert conn.execute(sql, (vec, 1000)).fetchone() is not None
    _fails(conn, sql, (vec, 1001), names="k must be within 1..1000, got 1001")
    _fails(conn, sql, (vec, 0), names="k must be within 1..1000")
    conn.execute("SELECT memory.set_policy('exact_search_max_k', '5')")
    _fails(conn, sql, (vec, 6), names="k must be within 1..5, got 6")
    assert conn.execute(sql, (vec, 5)).fetchone() == (5,)
    for bad in ("0", "100001", "x"):
        _fails(
            conn,
            "SELECT memory.set_policy('exact_search_max_k', %s)",
            (bad,),
            names="exact_search_max_k",
        )
    conn.execute("SELECT memory.reset_policy('exact_search_max_k')")
    _fails(conn, sql, (vec, 1001), names="1..1000")


@pytest.mark.parametrize("query", ["", " ", "\t", "\n \t\r", "\u3000"])
def test_whitespace_only_queries_fail_in_sql(
    conn: Conn, embedder: LocalEmbedder, query: str
) -> None:
    vec = embedder.embed_query("kong")
    for sql, params in (
        ("SELECT * FROM public.memory_query(%s)", (query,)),
        ("SELECT * FROM public.memory_query(%s, %s)", (query, vec)),  # would reach PL/Python
        ("SELECT * FROM memory.lexical_search(%s)", (query,)),
        ("SELECT * FROM memory.lexical_search(%s, exhaustive => true)", (query,)),
    ):
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(sql, params).fetchall()
        assert exc.value.sqlstate == "22023"
        assert exc.value.diag.message_primary == "query must not be empty"
        assert "PL/Python" not in (exc.value.diag.context or ""), exc.value.diag.context
