"""memory_query(), the SQL user's entry point, and the optimizer inside PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from poimen_core.optimizer import optimize_query
from poimen_memory.embedders.local import LocalEmbedder

Conn = psycopg.Connection[Any]


def test_default_search_path_text_answer(conn: Conn) -> None:
    conn.execute("RESET search_path")
    rows = conn.execute(
        "SELECT level, text, search_strategy, fusion_method, provenance "
        "FROM memory_query('kong body buffer')"
    ).fetchall()
    assert rows and all(r[0] in ("L1", "L2") for r in rows)
    # No embedding given: memory.embed computes one, and the optimizer routes as over HTTP.
    assert rows[0][2] == optimize_query("kong body buffer").search_strategy.value
    top_provenance = rows[0][4]
    l0 = [p for p in top_provenance if p["level"] == "L0"]
    assert any("client_body_buffer_size" in p["text"] or "body buffer" in p["text"] for p in l0)


def test_hybrid_with_embedding_fuses_both_legs(conn: Conn, embedder: LocalEmbedder) -> None:
    q = "how do I fix uploads over 10KB failing through the kong gateway"
    rows = conn.execute(
        "SELECT sha256, semantic_rank, lexical_rank, final_score, query_score, "
        "fusion_method, search_strategy, project FROM public.memory_query(%s, %s, 'poimen')",
        (q, embedder.embed_query(q)),
    ).fetchall()
    # The fusion comes from memory.policy(): convex by default, as over HTTP.
    assert rows[0][6] == "Hybrid" and rows[0][5] == "convex"
    assert any(r[1] is not None and r[2] is not None for r in rows)
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    assert all(r[7] == "poimen" for r in rows) and all(0 <= r[4] <= 1 for r in rows)


def test_cascade_only_returns_lexical_hits(conn: Conn, embedder: LocalEmbedder) -> None:
    q = "kong buffer incidents in 2024"
    lexical = {
        r[0]
        for r in conn.execute(
            "SELECT encode(n.sha256, 'hex') FROM memory.lexical_search(%s, NULL, '{L1,L2}', 200) l "
            "JOIN memory.nodes n ON n.id = l.node_id",
            (q,),
        ).fetchall()
    }
    rows = conn.execute(
        "SELECT sha256, search_strategy, fusion_method, query_score "
        "FROM public.memory_query(%s, %s, fusion => 'rrf')",
        (q, embedder.embed_query(q)),
    ).fetchall()
    # fusion rrf: the classic cascade, the cosine order of the lexical ids alone.
    assert rows and rows[0][1] == "LexicalFirst" and rows[0][2] == "cascade"
    assert {r[0] for r in rows} <= lexical
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)


def test_levels_k_and_project(conn: Conn) -> None:
    l0 = conn.execute("SELECT level FROM public.memory_query('kong', levels => '{L0}')").fetchall()
    assert l0 and {r[0] for r in l0} == {"L0"}
    assert len(conn.execute("SELECT 1 FROM public.memory_query('kong', k => 1)").fetchall()) == 1
    many = conn.execute(
        "SELECT 1 FROM public.memory_query('postgres kong', levels => '{L0,L1,L2}', k => 50)"
    ).fetchall()
    assert 1 < len(many) <= 50
    atlas = conn.execute(
        "SELECT DISTINCT project FROM public.memory_query('kong', project => 'atlas')"
    ).fetchall()
    assert atlas == [("atlas",)]


@pytest.mark.parametrize(
    ("call", "sqlstate"),
    [
        ("SELECT * FROM public.memory_query('')", "22023"),
        ("SELECT * FROM public.memory_query(NULL)", "22023"),
        ("SELECT * FROM public.memory_query('kong', project => 'nope')", "PM404"),
        ("SELECT * FROM public.memory_query('kong', levels => '{L9}')", "22023"),
        ("SELECT * FROM public.memory_query('kong', levels => '{}')", "22023"),
        ("SELECT * FROM public.memory_query('kong', strategy => 'Magic')", "22023"),
    ],
)
def test_errors_have_sqlstate_and_hint(conn: Conn, call: str, sqlstate: str) -> None:
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(call)
    assert exc.value.sqlstate == sqlstate
    assert exc.value.diag.message_primary


def test_wrong_dimension_is_pm409(conn: Conn) -> None:
    import numpy as np

    with pytest.raises(psycopg.Error) as exc:
        conn.execute(
            "SELECT * FROM public.memory_query('kong', %s)", (np.array([1, 2], dtype=np.float32),)
        )
    assert exc.value.sqlstate == "PM409" and exc.value.diag.message_hint


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ("k => 0", "k"),
        ("k => 51", "k"),
        ("k => NULL", "k"),
        ("levels => NULL", "levels"),
        ("fusion => 'borda'", "fusion"),
        ("strategy => 'Magic'", "strategy"),
        ("rrf_k => -1", "rrf_k"),
        ("candidates => 0", "candidates"),
        ("candidates => 1001", "candidates"),
        ("dense_weight => 1.5", "dense_weight"),
    ],
)
def test_every_argument_is_validated_by_name(conn: Conn, args: str, name: str) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue) as exc:
        conn.execute(f"SELECT * FROM public.memory_query('kong', {args})")
    assert name in (exc.value.diag.message_primary or "")


def test_result_carries_the_row_identity(conn: Conn) -> None:
    rows = conn.execute(
        'SELECT q.node_id, q.external_id, q.sha256, q."timestamp", n.id, n.external_id,'
        " encode(n.sha256, 'hex'), n.ts"
        " FROM public.memory_query('kong body buffer', project => 'poimen') q"
        " JOIN memory.nodes n ON n.id = q.node_id"
    ).fetchall()
    assert rows
    for r in rows:
        assert r[:4] == r[4:]
    assert rows[0][1] == "poimen:mem:1"


def test_final_score_is_the_leg_score_for_one_leg(conn: Conn, embedder: LocalEmbedder) -> None:
    lexical = conn.execute(
        "SELECT final_score, lexical_score"
        " FROM public.memory_query('kong body buffer', project => 'poimen',"
        " strategy => 'LexicalOnly')"
    ).fetchall()
    assert lexical and all(f == lx and f > 0 for f, lx in lexical)
    q = "uploads failing through the gateway"
    semantic = conn.execute(
        "SELECT final_score, query_score FROM public.memory_query(%s, %s, 'poimen', "
        "strategy => 'SemanticOnly')",
        (q, embedder.embed_query(q)),
    ).fetchall()
    assert semantic and all(f == pytest.approx(s) and 0 < f <= 1 for f, s in semantic)


@pytest.mark.parametrize(
    "query",
    [
        "deployment failures in 2024",
        "fix port",
        "How do I fix kubernetes port 8080?",
        "#networking @devops policy",
        "Compare Docker and Kubernetes",
        "where is the TLS runbook",
    ],
)
def test_sql_optimizer_matches_python(conn: Conn, query: str) -> None:
    in_db = conn.execute("SELECT public.memory_optimize_query(%s)", (query,)).fetchone()[0]  # type: ignore[index]
    assert in_db == optimize_query(query).to_dict()


def test_sql_optimizer_error_is_typed(conn: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue) as exc:
        conn.execute("SELECT public.memory_optimize_query('   ')")
    assert exc.value.diag.message_hint


def test_stale_plpython_module_is_reloaded(conn: Conn, work_dir: Any) -> None:
    """After a deploy moves the module path, a live backend re-imports instead of reusing it."""
    import shutil

    from poimen_memory.db.migrate import PLPYTHON_SRC

    conn.execute("SELECT public.memory_optimize_query('warm up the cache')")
    new = work_dir / "stale-test"
    shutil.copytree(PLPYTHON_SRC, new / "poimen_core")
    opt = new / "poimen_core" / "optimizer.py"
    opt.write_text(
        opt.read_text().replace('OPTIMIZER_VERSION = "', 'OPTIMIZER_VERSION = "stale-test-')
    )
    for p in (new, new / "poimen_core"):
        p.chmod(0o755)
    conn.execute("UPDATE memory.config SET value = %s WHERE key = 'plpython_path'", (str(new),))
    out = conn.execute("SELECT public.memory_optimize_query('after the deploy')").fetchone()[0]  # type: ignore[index]
    assert out["optimizer_version"].startswith("stale-test-")


def test_sql_convex_uses_the_lexical_leaning_weights(conn: Conn, embedder: LocalEmbedder) -> None:
    q = "how do I fix uploads over 10KB failing through the kong gateway"
    emb = embedder.embed_query(q)
    rows = conn.execute(
        "SELECT sha256, final_score, fusion_method FROM public.memory_query(%s, %s, 'poimen', "
        "fusion => 'convex', k => 10, min_cosine => -1)",  # the fusion, not the floor
        (q, emb),
    ).fetchall()
    assert rows and {r[2] for r in rows} == {"convex"}
    lex = dict(conn.execute(
        "SELECT encode(n.sha256, 'hex'), l.lexical_score FROM memory.lexical_search(%s, 'poimen', "
        "'{L1,L2}', 50) l JOIN memory.nodes n ON n.id = l.node_id", (q,)).fetchall())  # fmt: skip
    sem = dict(conn.execute(
        "SELECT encode(n.sha256, 'hex'), s.query_score FROM memory.semantic_search(%s, 'poimen', "
        "'{L1,L2}', 50) s JOIN memory.nodes n ON n.id = s.node_id", (emb,)).fetchall())  # fmt: skip

    def norm(d: dict[str, float]) -> dict[str, float]:
        lo, hi = min(d.values()), max(d.values())
        return {k: 1.0 if hi == lo else (v - lo) / (hi - lo) for k, v in d.items()}

    ln, sn = norm(lex), norm(sem)
    for sha, score, _ in rows:
        assert score == pytest.approx(0.4 * sn.get(sha, 0.0) + 0.6 * ln.get(sha, 0.0), abs=1e-9)
    conn.execute("SELECT memory.set_policy('dense_weight', '1.0')")
    only_dense = conn.execute(
        "SELECT sha256 FROM public.memory_query(%s, %s, 'poimen', fusion => 'convex', k => 3, "
        "min_cosine => -1)",
        (q, emb),
    ).fetchall()
    assert [r[0] for r in only_dense] == sorted(sn, key=lambda k: -sn[k])[:3]


def test_policy_is_validated_and_applies_to_memory_query(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    """memory.set_policy rejects bad values with 22023; a valid one changes memory.query."""
    for key, value in (
        ("fusion", "borda"),
        ("dense_weight", "1.5"),
        ("rrf_k", "-1"),
        # issue 28's keys
        ("filtered_ef_search", "0"),
        ("project_graph_min_nodes", "-1"),
        # issue 42's cap
        ("project_graphs_max", "1001"),
        ("project_graphs_max", "-1"),
        ("large_store_nodes", "0"),
        ("large_store_ef_search", "1001"),
        ("nope", "1"),
    ):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute("SELECT memory.set_policy(%s, %s)", (key, value))
    q = "how do I fix uploads over 10KB failing through the kong gateway"
    conn.execute("SELECT memory.set_policy('fusion', 'rrf')")
    rows = conn.execute(
        "SELECT fusion_method FROM public.memory_query(%s, %s, 'poimen')",
        (q, embedder.embed_query(q)),
    ).fetchall()
    assert {r[0] for r in rows} == {"rrf"}
    conn.execute("SELECT memory.reset_policy()")
    assert conn.execute("SELECT fusion FROM memory.policy()").fetchone() == ("convex",)
    with pytest.raises(
        psycopg.errors.InvalidParameterValue, match="fusion must be one of rrf, convex"
    ):
        conn.execute("SELECT * FROM public.memory_query(%s, fusion => 'borda')", (q,))


def test_the_policy_reads_its_defaults_from_the_one_table_of_keys(conn: Conn) -> None:
    # memory._policy_defaults is a constant made from memory._policy_keys() at migrate: it
    # must hold every key's default, and a value set must win over it in both readers.
    assert conn.execute(
        "SELECT memory._policy_defaults() = jsonb_object_agg(p.key, p.default_value)"
        " FROM memory._policy_keys() p"
    ).fetchone() == (True,)
    try:
        conn.execute("SELECT memory.set_policy('evidence_budget', '7')")
        conn.execute("INSERT INTO memory.config (key, value) VALUES ('not_a_policy_key', 'x')")
        assert conn.execute(
            "SELECT evidence_budget, fusion, min_cosine FROM memory.policy()"
        ).fetchone() == (7, "convex", None)
        assert conn.execute(
            "SELECT memory._policy_value('evidence_budget'), memory._policy_value('rrf_k'),"
            " memory._policy_value('min_cosine'), memory._policy_value('not_a_policy_key')"
        ).fetchone() == ("7", "10", None, "x")
    finally:
        conn.execute("DELETE FROM memory.config WHERE key = 'not_a_policy_key'")
        conn.execute("SELECT memory.reset_policy()")
    assert conn.execute("SELECT evidence_budget FROM memory.policy()").fetchone() == (20,)


@pytest.mark.parametrize("min_cosine", [-1, 0.2])
def test_the_fused_state_holds_the_fused_rows_fields(
    conn: Conn, embedder: LocalEmbedder, min_cosine: float
) -> None:
    """The state memory._run_legs hands memory._finish (and, through memory._serve's
    candidates, the service's reranker) lists each fused candidate with exactly the fields of
    memory.fused_row, in the fused order, whether the relevance floor runs (min_cosine 0.2:
    memory._after_fusion judges every candidate) or not (-1: the first k handed on)."""
    q = "how do I fix uploads over 10KB failing through the kong gateway"
    plan = conn.execute(
        "SELECT memory._plan(memory._request(%s, 'poimen', ARRAY['L0', 'L1', 'L2'], 5,"
        " 'Hybrid', 'convex', NULL, NULL, NULL, NULL, NULL, NULL, 0)"
        " || jsonb_build_object('min_cosine', %s::float8))",
        (q, min_cosine),
    ).fetchone()[0]
    assert plan["floor"]["applied"] is (min_cosine > -1), plan["floor"]
    state = conn.execute(
        "SELECT memory._run_legs(%s::jsonb, %s)", (json.dumps(plan), embedder.embed_query(q))
    ).fetchone()[0]
    fused, order = state["fused"], state["fused_order"]
    assert 0 < len(fused) <= 5
    for row in fused:
        assert set(row) == {"node_id", "ranks", "scores", "fused_score", "fusion_method"}, row
        assert row["fusion_method"] == "convex" and len(row["ranks"]) == len(row["scores"]) == 2
    ids = [r["node_id"] for r in fused]
    # in the fused order: its first k without the floor, a subsequence with it
    if min_cosine == -1:
        assert ids == order[: len(ids)]
    else:
        at = [order.index(i) for i in ids]
        assert at == sorted(at) and set(state["withheld_ids"]).isdisjoint(ids)
