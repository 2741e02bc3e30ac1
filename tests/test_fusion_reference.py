"""memory.fuse and memory.fuse_legs against a plain, slow statement of the same rules (the
fusion as it was before memory._fuse_lists): seeded random lists with repeated and NULL ids,
missing, NULL and equal scores, ties, zero and negative weights, one to five lists, both
methods. Equal means equal to the last bit: ranks, scores, the fused score as text (-0
included) and the order."""

from __future__ import annotations

import json
import random
from typing import Any

import psycopg
import pytest

Conn = psycopg.Connection[Any]

# One slot per list; DISTINCT ON keeps an id's first position; ordered aggregates sum in
# list order; min-max per list with equal bounds -> 1.0.
REFERENCE = """
WITH l AS (
    SELECT (li.ord - 1)::integer AS list_no,
           coalesce((li.item ->> 'weight')::double precision, 1.0) AS weight, li.item
    FROM jsonb_array_elements(%(lists)s::jsonb) WITH ORDINALITY AS li(item, ord)
), entries AS (
    SELECT DISTINCT ON (l.list_no, e.id::bigint)
           l.list_no, l.weight, e.id::bigint AS id, e.pos::integer AS rank,
           (l.item -> 'scores' ->> (e.pos::integer - 1))::double precision AS score
    FROM l, jsonb_array_elements_text(coalesce(l.item -> 'ids', '[]')) WITH ORDINALITY AS e(id, pos)
    WHERE e.id IS NOT NULL
    ORDER BY l.list_no, e.id::bigint, e.pos
), normed AS (
    SELECT e.*,
           CASE WHEN max(e.score) OVER w = min(e.score) OVER w THEN 1.0
                ELSE (e.score - min(e.score) OVER w) / (max(e.score) OVER w - min(e.score) OVER w)
           END AS norm
    FROM entries e
    WINDOW w AS (PARTITION BY e.list_no)
), fused AS (
    SELECT n.id,
           array_agg(n.rank ORDER BY n.list_no) AS rank_by_list,
           array_agg(n.list_no ORDER BY n.list_no) AS list_nos,
           array_agg(n.score ORDER BY n.list_no) AS score_by_list,
           CASE WHEN %(method)s::text = 'rrf'
                THEN sum(n.weight / (%(k)s::integer + n.rank) ORDER BY n.list_no)
                ELSE sum(n.weight * coalesce(n.norm, 0) ORDER BY n.list_no) END AS fused,
           min(n.rank) AS best_rank
    FROM normed n
    GROUP BY n.id
)
SELECT f.id,
       ARRAY(SELECT f.rank_by_list[array_position(f.list_nos, i)]
             FROM generate_series(0, jsonb_array_length(%(lists)s::jsonb) - 1) i),
       ARRAY(SELECT f.score_by_list[array_position(f.list_nos, i)]
             FROM generate_series(0, jsonb_array_length(%(lists)s::jsonb) - 1) i),
       f.fused::text,
       %(method)s::text
FROM fused f
ORDER BY f.fused DESC, f.best_rank, f.id
LIMIT %(final_k)s::integer
"""

FUSE = (
    "SELECT node_id, ranks, scores, fused_score::text, fusion_method"
    " FROM memory.fuse(%(lists)s::jsonb, %(method)s, %(k)s, %(final_k)s)"
)


def _list(rnd: random.Random) -> dict[str, Any]:
    n = rnd.choice([0, 1, 2, 4, 8, 20])
    # few distinct ids: ids repeat within and across lists
    ids: list[int | None] = [
        None if rnd.random() < 0.08 else rnd.randint(1, rnd.choice([4, 12, 30])) for _ in range(n)
    ]
    item: dict[str, Any] = {"ids": ids}
    if rnd.random() < 0.8:
        shared = [rnd.choice([0.5, 1.0, 3.25]), round(rnd.uniform(-2, 2), 1)]
        item["scores"] = [
            None
            if rnd.random() < 0.1
            else rnd.choice(shared)
            if rnd.random() < 0.35
            else rnd.uniform(-3, 12)
            for _ in range(max(0, n + rnd.choice([0, 0, 0, -2, 3])))
        ]
    if rnd.random() < 0.7:
        item["weight"] = rnd.choice([0, 1, 0.4, 0.6, 2.5, -1, 1e-9, rnd.random()])
    return item


def _same(conn: Conn, params: dict[str, Any]) -> None:
    expected = conn.execute(REFERENCE, params).fetchall()
    assert conn.execute(FUSE, params).fetchall() == expected, params


@pytest.mark.parametrize("seed", range(3))
def test_fuse_equals_the_reference(conn: Conn, seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(120):
        lists = [_list(rnd) for _ in range(rnd.choice([1, 2, 2, 2, 3, 5]))]
        _same(
            conn,
            {
                "lists": json.dumps(lists),
                "method": rnd.choice(["rrf", "convex"]),
                "k": rnd.choice([0, 1, 60]),
                "final_k": rnd.choice([1, 3, 50, 1000]),
            },
        )


def test_fuse_equals_the_reference_on_ties(conn: Conn) -> None:
    """Equal fused scores, equal best ranks, equal scores in a list, a list of one score
    and lists without scores."""
    cases = [
        [{"ids": [7, 5]}, {"ids": [5, 7]}],
        [{"ids": [1, 2, 3], "scores": [2, 2, 2]}, {"ids": [3, 2, 1], "scores": [1, 1, 1]}],
        [{"ids": [4, 4, 9], "scores": [None, 8, 8]}, {"ids": [9], "scores": [5]}],
        [{"ids": [1, 2]}, {"ids": [2, 1], "weight": 0}, {"ids": [3, 1, 2], "scores": [1, 2, 3]}],
        [{"ids": [3, 1], "weight": -0.0}, {"ids": [], "scores": []}],
    ]
    for lists in cases:
        for method in ("rrf", "convex"):
            _same(conn, {"lists": json.dumps(lists), "method": method, "k": 0, "final_k": 50})


LEGS = (
    "SELECT node_id, ranks, scores, fused_score::text, fusion_method FROM memory.fuse_legs("
    "%(semantic)s::jsonb, %(lexical)s::jsonb, %(strategy)s, %(fusion)s, %(dense_weight)s,"
    " %(k)s, %(final_k)s)"
)


def test_fuse_legs_equals_the_reference(conn: Conn) -> None:
    """The legs weighted as the strategy says, fused by the reference; the reported method
    and the cascade's filter as memory.fuse_legs documents them."""
    rnd = random.Random(42)
    for _ in range(150):
        strategy = rnd.choice(["Hybrid", "LexicalFirst", "SemanticOnly", "LexicalOnly"])
        fusion = rnd.choice(["rrf", "convex"])
        dense = rnd.choice([0.4, 0.0, 1.0, round(rnd.random(), 3)])
        semantic, lexical = _list(rnd), _list(rnd)
        convex = fusion == "convex" and strategy in ("Hybrid", "LexicalFirst")
        weights = (
            0 if strategy == "LexicalOnly" else dense if convex else 1,
            0
            if strategy == "SemanticOnly"
            else 1 - dense
            if convex
            else 0
            if strategy == "LexicalFirst"
            else 1,
        )
        params = {
            "semantic": json.dumps(semantic),
            "lexical": json.dumps(lexical),
            "strategy": strategy,
            "fusion": fusion,
            "dense_weight": dense,
            "k": rnd.choice([0, 10, 60]),
            "final_k": rnd.choice([1, 5, 50, 1000]),
        }
        ref = {
            "lists": json.dumps(
                [semantic | {"weight": weights[0]}, lexical | {"weight": weights[1]}]
            ),
            "method": fusion if strategy in ("Hybrid", "LexicalFirst") else "rrf",
            "k": params["k"],
            "final_k": params["final_k"],
        }
        shown = {
            "Hybrid": ref["method"],
            "LexicalFirst": "cascade+convex" if fusion == "convex" else "cascade",
        }.get(strategy, "none")
        expected = [
            (*r[:4], shown)
            for r in conn.execute(REFERENCE, ref).fetchall()
            if strategy != "LexicalFirst" or r[1][0] is not None
        ]
        assert conn.execute(LEGS, params).fetchall() == expected, params


def _outcome(conn: Conn, sql: str, params: dict[str, Any]) -> Any:
    try:
        with conn.transaction():
            return conn.execute(sql, params).fetchall()
    except psycopg.Error as exc:
        return (exc.sqlstate, exc.diag.message_primary)


def test_fuse_reads_odd_lists_as_the_reference_does(conn: Conn) -> None:
    """Lists JSON allows but the documented shape does not: "scores" a single value (read
    as the first id's score, as it always was), "ids" an object, null, or holding a text
    that is no id. The same rows, or the same error, as the reference."""
    cases: list[Any] = [
        [{"ids": [1, 2], "scores": 5}],
        [{"ids": [1, 2], "scores": "3.5"}, {"ids": [2, 1], "scores": [1, 2]}],
        [{"ids": [1, 2], "scores": True}],
        [{"ids": {"a": 1}}],
        [{"ids": None}],
        [{"ids": 3}],
        [{"ids": [1, "x"]}],
        [{"scores": [1, 2]}, {"ids": [4]}],
    ]
    for lists in cases:
        for method in ("rrf", "convex"):
            params = {"lists": json.dumps(lists), "method": method, "k": 60, "final_k": 50}
            assert _outcome(conn, FUSE, params) == _outcome(conn, REFERENCE, params), params
