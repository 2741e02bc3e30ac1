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
from poimen_memory.db.connect import connect, ensure_service_login
from poimen_memory.db.migrate import (
    build_project_graphs,
    check,
    migrate,
    missing_project_graphs,
)
from poimen_memory.db.migrate.locks import BUILD_LOCK_KEY
from poimen_memory.errors import MigrationError

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
        # Loaded as a DBA bulk-loads: both HNSW graphs built after the COPY, by the
        # product's own memory._ensure_indexes (migrate's). Each row's insert into them
        # cost 16 of the COPY's 17 s of backend CPU; built afterwards, 2.7 s.
        conn.execute("DROP INDEX memory.nodes_embedding_hnsw, memory.nodes_embedding_hnsw_l1_l2")
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
        conn.execute("SELECT memory._ensure_indexes()")
        conn.execute("ANALYZE memory.nodes")
        conn.execute("ANALYZE memory.postings")
        yield prepare_conn(conn)
    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _nested_plans(
    conn: Conn, sql: str, params: tuple[Any, ...], setup: tuple[str, ...] = ()
) -> list[str]:
    """Run ``sql`` with auto_explain so the plans of the statements *inside* our functions
    come back as NOTICEs, exactly as a DBA would capture them (docs/sql-api.md). setup:
    statements run first in the same transaction, after auto_explain is loaded (which only
    a superuser may: SET LOCAL ROLE then runs ``sql`` as another role)."""
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
        for statement in setup:
            conn.execute(statement)
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
        # nor the current versions' metadata index (migration 0021), a full scan of which
        # is the only path left once the seq scan is off
        synthetic.execute("DROP INDEX memory.nodes_metadata_current_gin")
        synthetic.execute("SET LOCAL enable_seqscan = off")
        # 'rare' (60 nodes) would take the exact stage (issue 28): this test is the HNSW one.
        synthetic.execute("SELECT memory.set_policy('exact_scan_max_nodes', '0')")
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


# pgvector costs an HNSW scan in proportion to hnsw.ef_search: at filtered_ef_search's 400
# the planner finds an exact sort of 'big''s 3,960 L1/L2 rows cheaper (a sound choice at
# this size). The tests about the graph's plan search at 200, where the graph is cheaper.
GRAPH_EF = "200"


def test_explain_query_shows_the_l1_l2_hnsw_index_at_the_default_levels(
    synthetic: Conn, policy: Any
) -> None:
    """memory.explain_query returns the plan of the semantic stage the query ran: at the
    default levels (L1,L2) in one project the partial HNSW index serves it."""
    policy("filtered_ef_search", GRAPH_EF)
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
    workers = dict(
        synthetic.execute(
            "SELECT p.proname, ARRAY(SELECT c FROM unnest(p.proconfig) c"
            " WHERE c LIKE 'max_parallel%%') FROM pg_proc p"
            " WHERE p.pronamespace = 'memory'::regnamespace"
            " AND p.proname IN ('semantic_search', '_explain')"
        ).fetchall()
    )
    # No workers: a parallel brute-force plan would undo memory._semantic_stage's choice of
    # the graph at filtered_ef_search (issue 28; tests/test_sql_modes.py's parallel mode).
    assert workers["semantic_search"] == ["max_parallel_workers_per_gather=0"]
    assert workers["_explain"] == workers["semantic_search"]


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


# --- issue 28: the exact stage for small named projects, filtered_ef_search ----------------


def _semantic_plan(conn: Conn, project: str | None, seed: int = 6) -> dict[str, Any]:
    """explain_query's semantic row (the stage memory.semantic_search runs) at the default
    levels, SemanticOnly, k 10."""
    rows = conn.execute(
        "SELECT stage, plan FROM memory.explain_query("
        "'topic1', %s, %s, k => 10, strategy => 'SemanticOnly', evidence => 0)",
        (_query_vec(seed), project),
    ).fetchall()
    (plan,) = [r[1] for r in rows if r[0] == "semantic"]
    return dict(plan)


def _brute_force(conn: Conn, project: str, vec: str, k: int) -> list[int]:
    """numpy's exact top k of the project's current L1/L2 nodes by cosine distance."""
    rows = conn.execute(
        "SELECT n.id, n.embedding::text FROM memory.nodes n JOIN memory.projects p"
        " ON p.id = n.project_id WHERE p.name = %s AND n.level IN ('L1', 'L2')"
        " AND n.expired_at IS NULL AND n.embedding IS NOT NULL",
        (project,),
    ).fetchall()
    ids = np.array([r[0] for r in rows])
    mat = np.array([json.loads(r[1]) for r in rows], dtype=np.float64)
    q = np.array(json.loads(vec), dtype=np.float64)
    dist = 1 - (mat @ q) / (np.linalg.norm(mat, axis=1) * np.linalg.norm(q))
    order = np.lexsort((ids, dist))[:k]
    return [int(i) for i in ids[order]]


def _assert_exact(conn: Conn, project: str, seeds: range) -> None:
    """memory.semantic_search at the default levels returns numpy's top 10 for each seed."""
    for seed in seeds:
        vec = _query_vec(seed)
        got = conn.execute(
            "SELECT node_id FROM memory.semantic_search(%s, %s, '{L1,L2}', 10)", (vec, project)
        ).fetchall()
        assert [r[0] for r in got] == _brute_force(conn, project, vec, 10)


@pytest.fixture
def policy(synthetic: Conn) -> Iterator[Any]:
    """memory.set_policy for one test; every key it set is reset afterwards."""
    keys: list[str] = []

    def set_policy(key: str, value: str) -> None:
        keys.append(key)
        synthetic.execute("SELECT memory.set_policy(%s, %s)", (key, value))

    yield set_policy
    for key in keys:
        synthetic.execute("SELECT memory.reset_policy(%s)", (key,))


def test_a_small_named_project_takes_the_exact_stage(synthetic: Conn) -> None:
    """'rare' (60 nodes, under exact_scan_max_nodes 5000) is read through the project btree
    and ranked exactly: no HNSW index in the plan, and the answer is numpy's top 10. A plain
    search of the current versions takes the stage planned once a session; one with any
    other test (here as_of) the stage whose visibility folds per call: the same answer."""
    plan = _semantic_plan(synthetic, "rare")
    assert plan["Stage"] == "semantic_exact_current" and plan["hnsw.ef_search"] is None
    indexes = _index_names([json.dumps(plan)])
    assert not {i for i in indexes if "hnsw" in i}, indexes
    assert indexes == {"nodes_project_level_idx"}, indexes
    # explained as the plan the stage keeps for the session: parameters, not constants
    assert "($3).project_id" in json.dumps(plan), plan
    _assert_exact(synthetic, "rare", range(100, 105))
    (past,) = [
        dict(r[1])
        for r in synthetic.execute(
            "SELECT stage, plan FROM memory.explain_query('topic1', %s, 'rare', k => 10,"
            " strategy => 'SemanticOnly', evidence => 0, as_of => now())",
            (_query_vec(6),),
        ).fetchall()
        if r[0] == "semantic"
    ]
    assert past["Stage"] == "semantic_exact", past["Stage"]
    assert _index_names([json.dumps(past)]) == {"nodes_project_level_idx"}
    for seed in range(100, 103):
        vec = _query_vec(seed)
        got = synthetic.execute(
            "SELECT node_id FROM memory.semantic_search(%s, 'rare', '{L1,L2}', 10, as_of => now())",
            (vec,),
        ).fetchall()
        assert [r[0] for r in got] == _brute_force(synthetic, "rare", vec, 10)
    # levels named twice are one level: each node once
    vec = _query_vec(104)
    got = synthetic.execute(
        "SELECT node_id FROM memory.semantic_search(%s, 'rare', '{L1,L2,L1}', 10)", (vec,)
    ).fetchall()
    assert [r[0] for r in got] == _brute_force(synthetic, "rare", vec, 10)


def test_only_a_plain_search_of_the_current_versions_takes_the_kept_plan(synthetic: Conn) -> None:
    """memory._vector_stage: semantic_exact_current for named levels and nothing else tested;
    any other test of the visibility (a time window, a filter, valid time, the past, the
    grammar) or every level (NULL) keeps semantic_exact, whose visibility folds per call."""
    stage = (
        "SELECT memory._vector_stage(memory._with_grammar(memory._leg_visibility("
        "memory.project_id('rare'), %s, %s, NULL, %s::jsonb, NULL, %s, %s),"
        " memory.parse_query(%s)))"
    )
    plain = (["L1", "L2"], None, None, None, None, "topic1")
    assert synthetic.execute(stage, plain).fetchone() == ("semantic_exact_current",)
    for changed in (
        {0: None},  # every level
        {1: "2000-01-01"},  # since
        {2: '{"a": 1}'},  # filter
        {3: "2020-01-01"},  # as_of
        {4: "2020-01-01"},  # valid_at
        {5: "topic1 -word2"},  # an exclusion
    ):
        args = tuple(changed.get(i, v) for i, v in enumerate(plain))
        assert synthetic.execute(stage, args).fetchone() == ("semantic_exact",), changed
    # an expired version and a node without a vector are not ranked, however near
    vec = _query_vec(120)
    with synthetic.transaction(force_rollback=True):
        rows = synthetic.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, text, embedding)"
            " VALUES (%s, 2, 'L1', 'old version', %s), (%s, 2, 'L2', 'no vector', NULL)"
            " RETURNING id",
            (b"\x01" * 32, vec, b"\x02" * 32),
        ).fetchall()
        synthetic.execute(
            "UPDATE memory.nodes SET expired_at = now(), end_reason = 'retired' WHERE id = %s",
            (rows[0][0],),
        )
        got = synthetic.execute(
            "SELECT node_id FROM memory.semantic_search(%s, 'rare', '{L1,L2}', 10)", (vec,)
        ).fetchall()
        assert rows[0][0] not in [r[0] for r in got]
        assert [r[0] for r in got] == _brute_force(synthetic, "rare", vec, 10)


def test_the_exact_stage_keeps_one_plan_on_the_project_index(synthetic: Conn, policy: Any) -> None:
    """semantic_exact_current's statement runs a plan made once for the session (its project
    and each level index conditions on parameters, not constants), and that plan stays on
    the (project_id, level) btree however the planner sizes an unknown project: here 'big'
    holds 99% of the store, where a plan made for any project would otherwise read the
    table for 'rare' too. Both answers are numpy's. The plan is made again (DISCARD PLANS)
    where reading pages at random is priced as it is for a project of millions of rows:
    without the stage's enable_seqscan off, that plan reads the table."""
    policy("exact_scan_max_nodes", "10000")  # 'big' ranked exactly as well
    synthetic.execute("DISCARD PLANS")
    try:
        _the_exact_plans_stay_on_the_index(synthetic)
    finally:
        # the plans made under that price would outlive the test in this session
        synthetic.execute("DISCARD PLANS")


def _the_exact_plans_stay_on_the_index(synthetic: Conn) -> None:
    sql = "SELECT node_id FROM memory.semantic_search(%s, %s, '{L1,L2}', 10)"
    dear = ("SET LOCAL random_page_cost = 100000",)
    for project, seed in (("rare", 110), ("big", 111), ("rare", 112)):
        plans = [
            p
            for p in _nested_plans(synthetic, sql, (_query_vec(seed), project), dear)
            if "n.level = lv.level" in p
        ]
        assert len(plans) == 1, plans
        root = json.loads(plans[0][plans[0].index("{") :])["Plan"]
        nodes = list(_plan_nodes(root))
        reads = [n["Node Type"] for n in nodes if n.get("Relation Name") == "nodes"]
        assert reads in (["Index Scan"], ["Bitmap Heap Scan"]), reads
        (cond,) = [n["Index Cond"] for n in nodes if "Index Name" in n]
        assert [n["Index Name"] for n in nodes if "Index Name" in n] == ["nodes_project_level_idx"]
        assert "($3).project_id" in cond and "level = l.level" in cond, cond
        vec = _query_vec(seed)
        got = synthetic.execute(sql, (vec, project)).fetchall()
        assert [r[0] for r in got] == _brute_force(synthetic, project, vec, 10)


def test_the_threshold_is_the_policy(synthetic: Conn, policy: Any) -> None:
    """With exact_scan_max_nodes above its size, 'big' (5,940 nodes) is ranked exactly too,
    and memory_query's semantic leg returns numpy's exact top 10."""
    policy("exact_scan_max_nodes", "10000")
    plan = _semantic_plan(synthetic, "big")
    assert plan["Stage"] == "semantic_exact_current"
    assert not {i for i in _index_names([json.dumps(plan)]) if "hnsw" in i}
    vec = _query_vec(200)
    got = synthetic.execute(
        "SELECT node_id FROM memory.semantic_search(%s, 'big', '{L1,L2}', 10)", (vec,)
    ).fetchall()
    assert [r[0] for r in got] == _brute_force(synthetic, "big", vec, 10)


def test_a_project_above_the_threshold_and_no_project_take_hnsw(
    synthetic: Conn, policy: Any
) -> None:
    assert _semantic_plan(synthetic, "big")["hnsw.ef_search"] == 400  # filtered_ef_search
    policy("filtered_ef_search", GRAPH_EF)
    big = _semantic_plan(synthetic, "big")
    assert big["Stage"] == "semantic" and big["hnsw.ef_search"] == 200
    assert _index_names([json.dumps(big)]) == {"nodes_embedding_hnsw_l1_l2"}
    every = _semantic_plan(synthetic, None)
    assert every["Stage"] == "semantic" and every["hnsw.ef_search"] == 100  # the function's own
    assert _index_names([json.dumps(every)]) == {"nodes_embedding_hnsw_l1_l2"}


def test_a_large_store_widens_the_unfiltered_beam(synthetic: Conn, policy: Any) -> None:
    """Past large_store_nodes (the table's planner estimate, 6,000 rows here) a scan naming
    no project runs at large_store_ef_search; a named project keeps filtered_ef_search and a
    caller's ef_search still wins. The warning names the store's graphs."""
    sql = "SELECT * FROM memory.semantic_search(%s, %s, NULL, 10)"
    vec = _query_vec(310)
    policy("large_store_nodes", "1000")
    assert _stage_notices(synthetic, sql, (vec, None)) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 200"
    ]
    assert _semantic_plan(synthetic, None)["hnsw.ef_search"] == 200
    policy("large_store_ef_search", "321")
    assert _stage_notices(synthetic, sql, (vec, None)) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 321"
    ]
    assert _stage_notices(synthetic, sql, (vec, "big")) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 400"
    ]
    assert _stage_notices(
        synthetic, "SELECT * FROM memory.semantic_search(%s, %s, NULL, 10, 40)", (vec, None)
    ) == ["memory.semantic_search: stage semantic, hnsw.ef_search 40"]
    rows = synthetic.execute("SELECT what, hint FROM memory.scale_warnings()").fetchall()
    assert [r[0] for r in rows] == ["hnsw_graph"], rows
    assert "past large_store_nodes = 1000" in rows[0][1] and "= 321" in rows[0][1], rows
    policy("large_store_nodes", "500000")
    assert _stage_notices(synthetic, sql, (vec, None)) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 100"
    ]


def test_policy_zero_turns_the_exact_path_off(synthetic: Conn, policy: Any) -> None:
    policy("exact_scan_max_nodes", "0")
    plan = _semantic_plan(synthetic, "rare")
    assert plan["Stage"] == "semantic" and plan["hnsw.ef_search"] == 400
    assert synthetic.execute("SELECT memory._semantic_stage(2)").fetchone() == ("semantic",)
    # 'big' takes HNSW with the project's ef as before.
    policy("filtered_ef_search", GRAPH_EF)
    assert _index_names([json.dumps(_semantic_plan(synthetic, "big"))]) == {
        "nodes_embedding_hnsw_l1_l2"
    }


def _stage_notices(conn: Conn, sql: str, params: tuple[Any, ...]) -> list[str]:
    """memory.semantic_search's DEBUG line (its stage and the hnsw.ef_search it set, read
    with current_setting inside it) for the call ``sql``."""
    notices: list[str] = []

    def handler(d: psycopg.errors.Diagnostic) -> None:
        if (d.message_primary or "").startswith("memory.semantic_search:"):
            notices.append(d.message_primary or "")

    conn.add_notice_handler(handler)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL client_min_messages = debug1")
            # A forced Gather would run the function in a worker: its DEBUG goes to the log.
            conn.execute(f"SET LOCAL {force_parallel(conn)} = off")
            conn.execute(sql, params).fetchall()
    finally:
        conn.remove_notice_handler(handler)
    return notices


def test_filtered_ef_search_is_in_effect(synthetic: Conn, policy: Any) -> None:
    sql = "SELECT * FROM memory.semantic_search(%s, %s, NULL, 10)"
    vec = _query_vec(300)
    assert _stage_notices(synthetic, sql, (vec, "big")) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 400"
    ]
    assert _stage_notices(synthetic, sql, (vec, None)) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 100"
    ]
    assert _stage_notices(synthetic, sql, (vec, "rare")) == [
        "memory.semantic_search: stage semantic_exact, hnsw.ef_search 100"
    ]
    # The caller's ef_search wins; the policy moves the filtered default.
    assert _stage_notices(
        synthetic, "SELECT * FROM memory.semantic_search(%s, %s, NULL, 10, 40)", (vec, "big")
    ) == ["memory.semantic_search: stage semantic, hnsw.ef_search 40"]
    policy("filtered_ef_search", "321")
    assert _stage_notices(synthetic, sql, (vec, "big")) == [
        "memory.semantic_search: stage semantic, hnsw.ef_search 321"
    ]
    assert _semantic_plan(synthetic, "big")["hnsw.ef_search"] == 321


def test_scale_warnings_flag_a_project_past_the_exact_path(synthetic: Conn, policy: Any) -> None:
    """'rare' (1% of the store) past a tiny exact_scan_max_nodes is flagged; 'big' (99%, over
    half of the store, so not filtered in effect) is not; nothing at the defaults."""
    assert synthetic.execute("SELECT * FROM memory.scale_warnings()").fetchall() == []
    policy("exact_scan_max_nodes", "10")
    rows = synthetic.execute("SELECT project, what, hint FROM memory.scale_warnings()").fetchall()
    assert [(r[0], r[1]) for r in rows] == [("rare", "filtered_hnsw")]
    assert "project rare holds 60 nodes (1.0% of 6000)" in rows[0][2]
    # project_graph_min_nodes (5000) keeps 'rare' on the shared graph: the hint says so.
    assert "set project_graph_min_nodes (now 5000) below its size" in rows[0][2]


class _Rollback(Exception):
    """Raised to roll a test's transaction back (the indexes it built go with it)."""


def _rare_id(conn: Conn) -> int:
    row = conn.execute("SELECT id FROM memory.projects WHERE name = 'rare'").fetchone()
    assert row is not None
    return int(row[0])


def _graph_names(rid: int) -> list[str]:
    return [f"nodes_embedding_hnsw_p{rid}", f"nodes_embedding_hnsw_l1_l2_p{rid}"]


def _graphs_valid(conn: Conn, rid: int) -> list[tuple[str, bool]]:
    rows = conn.execute(
        "SELECT c.relname::text, i.indisvalid FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'memory.nodes'::regclass AND c.relname = ANY (%s) ORDER BY 1 DESC",
        (_graph_names(rid),),
    ).fetchall()
    return [(str(n), bool(v)) for n, v in rows]


@pytest.fixture
def rare_graphs(synthetic: Conn, policy: Any) -> Iterator[int]:
    """'rare' past both thresholds, so it is to have graphs of its own; they are built
    outside any transaction now (CONCURRENTLY), so dropped by hand afterwards."""
    rid = _rare_id(synthetic)
    policy("exact_scan_max_nodes", "10")
    policy("project_graph_min_nodes", "10")
    try:
        yield rid
    finally:
        for name in _graph_names(rid):
            synthetic.execute(f"DROP INDEX IF EXISTS memory.{name}")


def test_a_large_project_gets_hnsw_graphs_of_its_own(
    synthetic: Conn, policy: Any, rare_graphs: int
) -> None:
    """Past both thresholds and under half of the store, 'rare' is named by
    memory._project_graphs; migrate's transaction builds none of its graphs but names them
    (memory._missing_project_graphs), and build_project_graphs builds the pair concurrently
    after it; the planner reads them for its queries (all levels and the default L1/L2), the
    answer is numpy's, and the scale warning goes. 'big' (99% of the store) never gets one."""
    rid = rare_graphs
    graphs = synthetic.execute("SELECT project_id, n_docs FROM memory._project_graphs()")
    assert graphs.fetchall() == [(rid, 60)]
    (hint,) = synthetic.execute("SELECT hint FROM memory.scale_warnings()").fetchone() or ("",)
    assert (
        "run poimen-memory migrate: it builds the project HNSW graphs of its own "
        f"(nodes_embedding_hnsw_p{rid})"
    ) in hint
    with pytest.raises(_Rollback), synthetic.transaction():
        assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
        missing = synthetic.execute(
            "SELECT index_name, project_id, state, statement FROM memory._missing_project_graphs()"
        ).fetchall()
        assert [r[:3] for r in missing] == [(n, rid, "missing") for n in _graph_names(rid)]
        assert missing[1][3].startswith(
            f"CREATE INDEX CONCURRENTLY nodes_embedding_hnsw_l1_l2_p{rid} ON memory.nodes"
            " USING hnsw"
        ), missing[1][3]
        raise _Rollback
    built = build_project_graphs(synthetic)
    assert [(b.index, b.project_id, b.was) for b in built] == [
        (n, rid, "missing") for n in _graph_names(rid)
    ]
    assert _graphs_valid(synthetic, rid) == [(n, True) for n in _graph_names(rid)]
    (indexdef,) = synthetic.execute(
        "SELECT indexdef FROM pg_indexes WHERE indexname = %s",
        (f"nodes_embedding_hnsw_l1_l2_p{rid}",),
    ).fetchone() or ("",)
    assert indexdef.endswith(
        f"WHERE ((project_id = {rid}) AND (level = ANY (ARRAY['L1'::text, 'L2'::text])))"
    ), indexdef
    synthetic.execute("ANALYZE memory.nodes")
    plan = _semantic_plan(synthetic, "rare")
    assert plan["Stage"] == "semantic" and plan["hnsw.ef_search"] == 400
    assert _index_names([json.dumps(plan)]) == {f"nodes_embedding_hnsw_l1_l2_p{rid}"}
    # memory.semantic_search itself (auto_explain inside it), at every level.
    plans = _nested_plans(
        synthetic,
        "SELECT * FROM memory.semantic_search(%s, 'rare', NULL, 10)",
        (_query_vec(11),),
    )
    assert f"nodes_embedding_hnsw_p{rid}" in _index_names(plans)
    _assert_exact(synthetic, "rare", range(300, 303))
    assert synthetic.execute("SELECT * FROM memory.scale_warnings()").fetchall() == []
    # A second pass builds nothing.
    assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
    assert build_project_graphs(synthetic) == []
    # Within the looser bounds a project keeps its graphs (no build-drop flapping).
    synthetic.execute("SELECT memory.set_policy('project_graph_min_nodes', '70')")
    assert synthetic.execute("SELECT count(*) FROM memory._project_graphs()").fetchone() == (0,)
    assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
    assert missing_project_graphs(synthetic) == []
    synthetic.execute("SELECT memory.set_policy('project_graph_min_nodes', '10')")
    # reembed's reset drops every graph, the project's too (one left behind would block the
    # column's retyping); configure rebuilds the shared ones in its transaction, and the
    # project's are named missing, for reembed's last step (build_project_graphs, after the
    # commit) or the next migrate to build.
    with pytest.raises(_Rollback), synthetic.transaction():
        synthetic.execute("SELECT memory.reset_embedding('synthetic-2', %s)", (DIM,))
        assert _graphs_valid(synthetic, rid) == []
        shared = synthetic.execute(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'memory'"
            " AND indexname IN ('nodes_embedding_hnsw', 'nodes_embedding_hnsw_l1_l2')"
        ).fetchone()
        assert shared == (2,)
        assert [r[:3] for r in missing_project_graphs(synthetic)] == [
            (n, rid, "missing") for n in _graph_names(rid)
        ]
        raise _Rollback
    assert _graphs_valid(synthetic, rid) == [(n, True) for n in _graph_names(rid)]
    # Turning the policy off drops the pair, in the transaction (a drop is quick); not
    # under migrate --check, which changes nothing.
    synthetic.execute("SELECT memory.set_policy('project_graph_min_nodes', '0')")
    with pytest.raises(_Rollback), synthetic.transaction():
        synthetic.execute("SELECT set_config('poimen.migrate_check', 'on', true)")
        assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
        raise _Rollback
    (dropped,) = synthetic.execute("SELECT memory._ensure_indexes()").fetchone() or ([],)
    assert sorted(dropped) == sorted("-" + n for n in _graph_names(rid))
    # (the planner reads 60 nodes through the project btree once the graph is gone)
    gone = _index_names([json.dumps(_semantic_plan(synthetic, "rare"))])
    assert gone and not {i for i in gone if i.endswith(f"_p{rid}")}, gone
    assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
    assert build_project_graphs(synthetic) == []
    # 'big' holds 99% of the store: a graph of its own would be the shared one again.
    policy("exact_scan_max_nodes", "5000")
    assert synthetic.execute("SELECT count(*) FROM memory._project_graphs()").fetchone() == (0,)


def test_migrate_builds_a_project_graph_after_its_commit(
    synthetic: Conn, cluster: Any, plpython_root: Path, rare_graphs: int
) -> None:
    """migrate's transaction has committed when the project's graphs are built: at the
    first build's progress line its backend holds no transaction id, the graphs do not
    exist yet, and another session's INSERT into memory.nodes is not kept waiting; once
    migrate returns both are there and valid, and its report says so."""
    rid = rare_graphs
    seen: list[tuple[bool, str, list[tuple[str, bool]]]] = []
    pid = synthetic.info.backend_pid
    with connect(cluster.url("t_plans"), autocommit=True) as other:

        def progress(line: str) -> None:
            if not line.startswith("building ") or seen:
                return
            row = other.execute(
                "SELECT backend_xid IS NULL AND state = 'idle' FROM pg_stat_activity"
                " WHERE pid = %s",
                (pid,),
            ).fetchone()
            assert row is not None
            with pytest.raises(_Rollback), other.transaction():
                other.execute("SET LOCAL lock_timeout = '200ms'")
                other.execute(
                    "INSERT INTO memory.nodes (sha256, project_id, level, text)"
                    " VALUES (%s, %s, 'L0', 'written while migrate builds')",
                    (b"\xff" * 32, rid),
                )
                raise _Rollback
            seen.append((bool(row[0]), line, _graphs_valid(other, rid)))

        report = migrate(synthetic, plpython_root, progress=progress)
    assert seen and seen[0][0], seen
    assert seen[0][2] == [], seen
    assert seen[0][1].startswith(f"building memory.nodes_embedding_hnsw_p{rid} (project {rid}")
    assert [(g.index, g.was) for g in report.project_graphs] == [
        (n, "missing") for n in _graph_names(rid)
    ]
    assert _graphs_valid(synthetic, rid) == [(n, True) for n in _graph_names(rid)]
    assert not [w for w in report.scale_warnings if "filtered_hnsw" in w]
    # The next migrate finds them and builds nothing.
    assert migrate(synthetic, plpython_root).project_graphs == []


def test_an_interrupted_build_leaves_an_invalid_graph_the_next_migrate_mends(
    synthetic: Conn, cluster: Any, plpython_root: Path, rare_graphs: int
) -> None:
    """A CREATE INDEX CONCURRENTLY that gives up (here: a writer's transaction is open past
    the build's lock timeout) leaves its index INVALID; migrate --check names it, the scale
    warning stays, and the next migrate drops it and builds it again."""
    rid = rare_graphs
    with connect(cluster.url("t_plans"), autocommit=True) as writer, writer.transaction():
        writer.execute("LOCK TABLE memory.nodes IN ROW EXCLUSIVE MODE")
        with pytest.raises(MigrationError) as failed:
            build_project_graphs(synthetic, lock_timeout_s=0.3)
    assert f"building the project graph memory.nodes_embedding_hnsw_p{rid} failed" in str(
        failed.value
    )
    assert "which the next migrate drops and builds again" in str(failed.value.detail)
    assert _graphs_valid(synthetic, rid) == [(f"nodes_embedding_hnsw_p{rid}", False)]
    # The planner never reads an invalid index; the project is still flagged.
    assert synthetic.execute("SELECT count(*) FROM memory.scale_warnings()").fetchone() == (1,)
    assert check(synthetic).project_graphs == [
        f"memory.nodes_embedding_hnsw_p{rid} (project {rid}): invalid",
        f"memory.nodes_embedding_hnsw_l1_l2_p{rid} (project {rid}): missing",
    ]
    report = migrate(synthetic, plpython_root)
    assert [(g.index, g.was) for g in report.project_graphs] == [
        (f"nodes_embedding_hnsw_p{rid}", "invalid"),
        (f"nodes_embedding_hnsw_l1_l2_p{rid}", "missing"),
    ]
    assert _graphs_valid(synthetic, rid) == [(n, True) for n in _graph_names(rid)]
    # One marked invalid by hand (as a crash mid-build leaves it) is mended the same way.
    synthetic.execute(
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass",
        (f"memory.nodes_embedding_hnsw_l1_l2_p{rid}",),
    )
    report = migrate(synthetic, plpython_root)
    assert [(g.index, g.was) for g in report.project_graphs] == [
        (f"nodes_embedding_hnsw_l1_l2_p{rid}", "invalid")
    ]
    assert _graphs_valid(synthetic, rid) == [(n, True) for n in _graph_names(rid)]
    assert check(synthetic).project_graphs == []


def test_migrate_check_builds_no_project_graph(synthetic: Conn, rare_graphs: int) -> None:
    """migrate --check rolls back: it builds none of the graphs, names them, and its scale
    warning says the next migrate builds them."""
    rid = rare_graphs
    drift = check(synthetic)
    assert drift.project_graphs == [
        f"memory.{n} (project {rid}): missing" for n in _graph_names(rid)
    ]
    assert any("run poimen-memory migrate: it builds" in w for w in drift.scale_warnings)
    assert _graphs_valid(synthetic, rid) == []


def test_project_graphs_are_not_built_inside_a_transaction_block(
    synthetic: Conn, rare_graphs: int
) -> None:
    """CREATE INDEX CONCURRENTLY cannot run in a transaction block: a caller holding one
    open is told so, and nothing is built."""
    with pytest.raises(_Rollback), synthetic.transaction():
        with pytest.raises(MigrationError, match="cannot run inside a transaction block"):
            build_project_graphs(synthetic)
        raise _Rollback
    assert _graphs_valid(synthetic, rare_graphs) == []


def test_a_second_migrate_waits_for_the_first_ones_builds(
    synthetic: Conn, cluster: Any, rare_graphs: int
) -> None:
    """While another session builds (holds the build lock), build_project_graphs waits for
    it rather than dropping an index that looks invalid only because it is being built;
    past its lock timeout it says who holds it, and builds nothing."""
    lines: list[str] = []
    with connect(cluster.url("t_plans"), autocommit=True) as first:
        pid = first.info.backend_pid
        first.execute("SELECT pg_advisory_lock(%s)", (BUILD_LOCK_KEY,))
        with pytest.raises(MigrationError, match=rf"another migrate \(pid {pid}\)"):
            build_project_graphs(synthetic, lock_timeout_s=0.3, progress=lines.append)
    assert lines == [f"waiting for pid {pid}, which is building project graphs"]
    assert _graphs_valid(synthetic, rare_graphs) == []


def _add_project(conn: Conn, name: str, n: int, start: int) -> int:
    """A project of n random nodes (sha256 from start on), in the caller's transaction."""
    (pid,) = conn.execute(
        "INSERT INTO memory.projects (name) VALUES (%s) RETURNING id", (name,)
    ).fetchone() or (0,)
    _grow(conn, pid, n, start)
    return int(pid)


def _grow(conn: Conn, pid: int, n: int, start: int) -> None:
    rng = np.random.default_rng(start)
    vecs = rng.normal(size=(n, DIM)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    with conn.cursor().copy(
        "COPY memory.nodes (sha256, project_id, level, text, embedding) FROM STDIN"
    ) as copy:
        for i, v in enumerate(vecs):
            vec = "[" + ",".join(f"{x:.6f}" for x in v) + "]"
            copy.write_row(((start + i).to_bytes(32, "big"), pid, "L0", f"extra{i}", vec))


def _build_in_transaction(conn: Conn) -> list[int]:
    """What build_project_graphs does, inside the test's transaction (no CONCURRENTLY, so
    that the rollback takes the graphs away): the projects whose graphs it built."""
    built = []
    for _name, pid, _state, stmt in missing_project_graphs(conn):
        conn.execute(stmt.replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX", 1))
        built.append(pid)
    return sorted(set(built))


def _with_graphs(conn: Conn) -> list[int]:
    rows = conn.execute(
        "SELECT DISTINCT substring(c.relname from '_p([0-9]+)$')::integer FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'memory.nodes'::regclass AND memory._is_project_graph(c.relname)"
        " ORDER BY 1"
    ).fetchall()
    return [int(r[0]) for r in rows]


def test_project_graphs_max_caps_the_projects_with_graphs(synthetic: Conn) -> None:
    """More projects qualify than project_graphs_max: only the largest get graphs (ties by
    id); scale_warnings says why the others have none; raising the cap names the next for
    migrate to build; a project that has its graphs keeps them against a newcomer up to 1.25x
    its size (no build-drop flapping at the cap) and loses them past it; 0 drops them all."""
    rid = _rare_id(synthetic)
    with pytest.raises(_Rollback), synthetic.transaction():
        for key, value in [("exact_scan_max_nodes", "10"), ("project_graph_min_nodes", "10"),
                           ("project_graphs_max", "2")]:  # fmt: skip
            synthetic.execute("SELECT memory.set_policy(%s, %s)", (key, value))
        a = _add_project(synthetic, "cap-a", 40, 10_000_000)
        b = _add_project(synthetic, "cap-b", 30, 11_000_000)
        c = _add_project(synthetic, "cap-c", 30, 12_000_000)
        assert b < c
        graphs = synthetic.execute("SELECT project_id, n_docs FROM memory._project_graphs()")
        assert graphs.fetchall() == [(rid, 60), (a, 40)]
        warned = dict(synthetic.execute(
            "SELECT project, hint FROM memory.scale_warnings() WHERE what = 'filtered_hnsw'"
        ).fetchall())  # fmt: skip
        assert set(warned) == {"rare", "cap-a", "cap-b", "cap-c"}
        assert "it builds the project HNSW graphs of its own" in warned["cap-a"]
        assert (
            "the project_graphs_max = 2 largest have theirs: raise project_graphs_max"
            in (warned["cap-b"])
        )
        assert _build_in_transaction(synthetic) == [rid, a]
        assert _with_graphs(synthetic) == [rid, a]
        assert missing_project_graphs(synthetic) == []
        # Raising the cap: the next largest (the tie goes to the lower id), at the next migrate.
        synthetic.execute("SELECT memory.set_policy('project_graphs_max', '3')")
        assert [r[1] for r in missing_project_graphs(synthetic)] == [b, b]
        assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
        assert _build_in_transaction(synthetic) == [b]
        assert _with_graphs(synthetic) == sorted([rid, a, b])
        # c grows past b, within 1.25x of it: b keeps its graphs, nothing is built or dropped.
        _grow(synthetic, c, 7, 13_000_000)
        fresh = synthetic.execute("SELECT project_id FROM memory._project_graphs()").fetchall()
        assert [r[0] for r in fresh] == [rid, a, c]
        held = synthetic.execute("SELECT project_id FROM memory._project_graphs(true)").fetchall()
        assert [r[0] for r in held] == [rid, a, b]
        assert synthetic.execute("SELECT memory._ensure_indexes()").fetchone() == ([],)
        assert missing_project_graphs(synthetic) == []
        # Past 1.25x (38 > 37.5) c takes b's place: b's pair is dropped, c's named missing.
        _grow(synthetic, c, 1, 13_100_000)
        (dropped,) = synthetic.execute("SELECT memory._ensure_indexes()").fetchone() or ([],)
        assert sorted(dropped) == sorted("-" + n for n in _graph_names(b))
        assert _build_in_transaction(synthetic) == [c]
        assert _with_graphs(synthetic) == sorted([rid, a, c])
        # 0: no project graphs; the warning says how to turn them on.
        synthetic.execute("SELECT memory.set_policy('project_graphs_max', '0')")
        (dropped,) = synthetic.execute("SELECT memory._ensure_indexes()").fetchone() or ([],)
        assert len(dropped) == 6 and _with_graphs(synthetic) == []
        hints = [r[0] for r in synthetic.execute(
            "SELECT hint FROM memory.scale_warnings() WHERE what = 'filtered_hnsw'"
        ).fetchall()]  # fmt: skip
        assert len(hints) == 4
        assert all("project_graphs_max is 0: none" in h for h in hints), hints
        raise _Rollback
    assert _with_graphs(synthetic) == []


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_the_evidence_looks_its_direct_matches_up_by_id(synthetic: Conn) -> None:
    # The direct L0 matches of an answer's evidence are found one primary-key probe each,
    # not by reading every L0 row of the project (1,980 here) against the fused list.
    ids = [
        r[0]
        for r in synthetic.execute(
            "SELECT id FROM memory.nodes WHERE project_id = 1 AND level = 'L0' ORDER BY id LIMIT 5"
        ).fetchall()
    ]
    leg = json.dumps({"ids": ids, "scores": [5, 4, 3, 2, 1]})
    sql = (
        "SELECT node_id FROM memory.select_evidence('{}'::bigint[], NULL, %s::jsonb,"
        " project_name => 'big', budget => 20)"
    )
    # the weakest match of a min-max scaled leg scores 0, which cites nothing
    assert {r[0] for r in synthetic.execute(sql, (leg,)).fetchall()} == set(ids[:4])
    plans = [p for p in _nested_plans(synthetic, sql, (leg,)) if "WITH fused AS" in p]
    assert len(plans) == 1
    root = json.loads(plans[0][plans[0].index("{") :])["Plan"]
    # Every read of memory.nodes in the candidates' statement is a probe by key: each
    # candidate (a direct match or a citation) by id, a deeper candidate's citation by id,
    # the neighbours before and after by session (nodes_l0_session; by id where a title is
    # too long for it).
    reads = [n for n in _plan_nodes(root) if n.get("Relation Name") == "nodes"]
    assert {n["Node Type"] for n in reads} == {"Index Scan"}, reads
    assert {n["Index Name"] for n in reads} == {"nodes_pkey", "nodes_l0_session"}, reads
    # by id: each candidate once (the direct matches, the sessions and the candidates' own
    # rows were three lookups until 2026-12-06: 5 reads, 6 in a generic plan), the two
    # long-title branches, and a deeper candidate's citation where the plan keeps its test
    assert sum(n["Index Name"] == "nodes_pkey" for n in reads) <= 4, reads


def test_an_answer_plans_its_second_half_once_per_session(synthetic: Conn) -> None:
    # memory._finish runs its statements with generic plans on this layout (custom plans
    # were planned again at every call), and gives the caller's setting back.
    assert synthetic.execute("SELECT memory._plan_cache_mode()").fetchone() == (
        "force_generic_plan",
    )
    with synthetic.transaction():
        synthetic.execute("SET LOCAL plan_cache_mode = force_custom_plan")
        synthetic.execute(
            "SELECT memory.answer('topic3 word2', project => 'big', strategy => 'LexicalOnly')"
        ).fetchone()
        assert synthetic.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)


def test_an_answers_page_keeps_one_plan_for_every_project(synthetic: Conn) -> None:
    # memory._hydrate's page of nodes ran as a dynamic statement, planned at every call; it
    # is static now: under the generic plans of memory._finish, one probe of the primary
    # key per id, the project a parameter of the probe's filter, for a small project, a
    # large one and none.
    for project in ("rare", "big", None):
        plans = [
            p
            for p in _nested_plans(
                synthetic,
                "SELECT memory.answer('topic3 word2', project => %s, strategy => 'LexicalOnly')",
                (project,),
            )
            if "WITH page AS MATERIALIZED" in p
        ]
        assert len(plans) == 1, plans
        root = json.loads(plans[0][plans[0].index("{") :])["Plan"]
        reads = [n for n in _plan_nodes(root) if n.get("Relation Name") == "nodes"]
        assert [(n["Node Type"], n["Index Name"]) for n in reads] == [
            ("Index Scan", "nodes_pkey")
        ], (project, reads)
        assert reads[0]["Index Cond"] == "(id = i.id)", reads
        assert "project_id = $" in reads[0]["Filter"], reads


def test_an_answer_compiles_nothing_just_in_time(synthetic: Conn) -> None:
    # JIT compilation costs tens of milliseconds before a statement runs, more than any
    # statement of an answer takes: the executor's stages turn it off whatever the
    # estimates (here every statement would cross a jit_above_cost of 0).
    if synthetic.execute("SELECT pg_jit_available()").fetchone() != (True,):
        pytest.skip("this server has no JIT provider")
    with synthetic.transaction():
        synthetic.execute("SET LOCAL jit_above_cost = 0")
        plans = _nested_plans(
            synthetic,
            "SELECT memory.answer('topic3 word2', project => 'big', strategy => 'LexicalOnly')",
            (),
        )
    # The statements inside the stages; not the calls that enter them (one-row calls,
    # whose estimates never reach the threshold, an empty text for a RETURN expression).
    stages = ("memory.answer", "memory._answer", "memory._prepare(", "memory._execute(")
    inner = [
        p
        for p in plans
        if '"Query Text": "",' not in p and not any(s in p.split('"Plan"')[0] for s in stages)
    ]
    assert len(inner) > 10
    assert [p[p.index("Query Text") :][:300] for p in inner if '"JIT"' in p] == []
    # the same statement outside the stages is compiled: the setting is what held it off
    with synthetic.transaction():
        synthetic.execute("SET LOCAL jit_above_cost = 0")
        plan = synthetic.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM memory.nodes"
        ).fetchone()
    assert plan is not None and "JIT" in plan[0][0]


def test_ending_a_version_reads_the_term_statistics_by_key(synthetic: Conn) -> None:
    # The statement trigger drops the terms whose last current posting went by their key:
    # it read every term of every project ("DELETE ... WHERE df = 0") at each statement
    # that ended a version, a cost that grew with the store.
    node = synthetic.execute(
        "SELECT id FROM memory.nodes WHERE project_id = 1 AND text LIKE '% item42'"
    ).fetchone()
    assert node is not None
    stats = (
        "SELECT lexeme, df FROM memory.term_stats"
        " WHERE project_id = 1 AND lexeme IN ('item42', 'topic42') ORDER BY 1"
    )
    before = dict(synthetic.execute(stats).fetchall())
    assert before["item42"] == 1 and before["topic42"] > 1, before
    with synthetic.transaction(force_rollback=True):
        plans = _nested_plans(
            synthetic,
            "UPDATE memory.nodes SET expired_at = now(), end_reason = 'retired'"
            " WHERE id = %s RETURNING id",
            (node[0],),
        )
        # item42 is this node's word alone: its row went; topic42 is still another's
        left = synthetic.execute(stats).fetchall()
        assert left == [("topic42", before["topic42"] - 1)], left
    roots = [json.loads(p[p.index("{") :])["Plan"] for p in plans if "{" in p]
    reads = [
        n for root in roots for n in _plan_nodes(root) if n.get("Relation Name") == "term_stats"
    ]
    assert reads, plans
    assert not [n for n in reads if n["Node Type"] == "Seq Scan"], reads


def test_the_policy_merges_its_values_once_a_call(synthetic: Conn) -> None:
    # memory.policy() reads its 21 columns from one merged object (the defaults under the
    # values set). As an inlined CTE its expression was copied into every column, and the
    # object rebuilt 21 times a call (272 against 35 us); a materialized CTE builds it once.
    plans = _nested_plans(synthetic, "SELECT * FROM memory.policy()", ())
    roots = [json.loads(p[p.index("{") :])["Plan"] for p in plans if "{" in p]
    merged = [
        root for root in roots if any(n.get("Relation Name") == "config" for n in _plan_nodes(root))
    ]
    assert len(merged) == 1, plans
    nodes = list(_plan_nodes(merged[0]))
    assert [n for n in nodes if n["Node Type"] == "CTE Scan" and n.get("CTE Name") == "v"], nodes
    assert len([n for n in nodes if n.get("Relation Name") == "config"]) == 1, nodes


def _postings_conditions(plans: list[str]) -> list[str]:
    roots = [json.loads(p[p.index("{") :])["Plan"] for p in plans if "{" in p]
    return [
        str(n.get("Index Cond"))
        for root in roots
        for n in _plan_nodes(root)
        if n.get("Relation Name") == "postings"
    ]


def _lookup_conditions(plans: list[str]) -> dict[str, list[str]]:
    """The index conditions of the look-ups that make a leg's visibility: the project by
    name (memory.project_id) and the probe for a bounded valid time (memory._valid_at)."""
    roots = [json.loads(p[p.index("{") :])["Plan"] for p in plans if "{" in p]
    found: dict[str, list[str]] = {"projects_name_key": [], "nodes_valid_bounded": []}
    for root in roots:
        for n in _plan_nodes(root):
            if n.get("Index Name") in found:
                found[n["Index Name"]].append(str(n.get("Index Cond")))
    return found


def test_a_plain_lexical_search_keeps_one_plan_for_every_project(synthetic: Conn) -> None:
    # On one table, a plain search's statements keep their generic plans (re-planned at
    # every call they cost about 0.45 ms); the project must still bound the postings read,
    # as a range of keys in the index condition, for a named project and for none.
    assert synthetic.execute("SELECT memory._plan_cache_mode()").fetchone() == (
        "force_generic_plan",
    )
    for project in ("rare", "big", None):
        for exhaustive in (False, True):
            conds = _postings_conditions(
                _nested_plans(
                    synthetic,
                    "SELECT * FROM memory.lexical_search('topic0 word3 item42', %s,"
                    " exhaustive => %s)",
                    (project, exhaustive),
                )
            )
            assert conds, (project, exhaustive)
            for cond in conds:
                # a parameter of a generic plan, not the project's id as a constant
                assert "project_id >= $" in cond and "project_id <= $" in cond, conds
    # a search that tests nodes (here a time window) is still planned for its call, with
    # the project and the window as constants
    timed = _nested_plans(
        synthetic,
        "SELECT * FROM memory.lexical_search('topic0 word3 item42', 'rare',"
        " since => '2000-01-01', exhaustive => true)",
        (),
    )
    conds = _postings_conditions(timed)
    assert conds and not [c for c in conds if "$" in c], conds
    # The look-ups that make the visibility run before that choice, planned once a session
    # whatever the search (planned per call they cost 0.3 ms of an answer's two legs): the
    # project by its name, and the probe for a bounded valid time by the project's range.
    plain = _nested_plans(
        synthetic, "SELECT * FROM memory.lexical_search('topic0 word3', 'rare')", ()
    )
    for plans in (plain, timed):
        lookups = _lookup_conditions(plans)
        assert lookups["projects_name_key"] and lookups["nodes_valid_bounded"], lookups
        for index, found in lookups.items():
            assert all("$" in c for c in found), (index, found)
        # the range's ends made by the function: parameters, leakproof under the policy
        assert all(
            "project_id >= $" in c and "project_id <= $" in c
            for c in lookups["nodes_valid_bounded"]
        ), lookups
    # the caller's setting comes back after the call (set_config's is_local would keep
    # the plain search's to the end of the transaction, were the SET clause not scoping it)
    with synthetic.transaction(force_rollback=True):
        synthetic.execute("SET LOCAL plan_cache_mode = force_custom_plan")
        synthetic.execute("SELECT count(*) FROM memory.lexical_search('topic0 word3', 'rare')")
        assert synthetic.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)


def test_the_evidence_finds_a_turns_neighbours_in_one_index_descent(fixture_url: str) -> None:
    """memory.select_evidence's neighbours (the nearest L0 turn of the same title each way)
    are read through nodes_l0_session, its conditions the project, the title and the id
    range, as the service's role under row-level security (where a qual that is not
    leakproof could not be an index condition) and under the generic plans an answer runs
    with (memory._finish); the primary-key walk a title too long for the index needs runs
    behind a one-time filter, for such a candidate only."""
    from service_client import KONG

    with connect(fixture_url, autocommit=True) as conn:
        ensure_service_login(conn, "poimen_service")
        row = conn.execute(
            "SELECT array_agg(node_id ORDER BY rank) FROM memory.query(%s, NULL, 'poimen',"
            " k => 10, strategy => 'LexicalOnly')",
            (KONG,),
        ).fetchone()
        assert row is not None and row[0]
        setup = (
            "SET LOCAL ROLE poimen_service",
            "SELECT set_config('poimen.read_projects', 'poimen', true)",
            "SET LOCAL plan_cache_mode = force_generic_plan",
        )
        plans = _nested_plans(
            conn,
            "SELECT * FROM memory.select_evidence(%s, NULL, NULL, budget => 100,"
            " project_name => 'poimen') WHERE current_user = 'poimen_service'",
            (row[0],),
            setup,
        )
    conds: list[str] = []
    gated: list[bool] = []

    def walk(node: dict[str, Any], gate: str) -> None:
        gate = node.get("One-Time Filter", gate)
        if node.get("Index Name") == "nodes_l0_session":
            conds.append(node.get("Index Cond", ""))
            gated.append("NOT" in gate and "long_title" in gate)
        for child in node.get("Plans", []):
            walk(child, gate)

    neighbour_plans = [p for p in plans if "WITH fused AS" in p]
    assert len(neighbour_plans) == 1, plans
    root = json.loads(neighbour_plans[0][neighbour_plans[0].index("{") :])["Plan"]
    walk(root, "")
    assert len(conds) == 2, neighbour_plans  # one probe before the turn, one after
    for cond in conds:
        assert "project_id" in cond and "title" in cond, cond
        assert "id <" in cond or "id >" in cond, cond
    assert gated == [True, True]
    # Row-level security applied: the policy's test of the caller's projects filters reads.
    assert any("project_id = ANY" in n.get("Filter", "") for n in _plan_nodes(root)), (
        neighbour_plans
    )
    # The long titles' branches: primary-key scans, each behind its one-time filter.
    long_branches = [
        n
        for n in _plan_nodes(root)
        if "long_title" in n.get("One-Time Filter", "") and "NOT" not in n["One-Time Filter"]
    ]
    assert len(long_branches) == 2, neighbour_plans
    for branch in long_branches:
        assert {x.get("Index Name") for x in _plan_nodes(branch)} >= {"nodes_pkey"}
    # Under the policy each candidate is still looked up by an index condition: an id that
    # a FULL JOIN's coalesce() gave, pulled into the probe, would wait behind the policy's
    # qual (not leakproof) and scan the project instead.
    probed = [n for n in _plan_nodes(root) if n.get("Subplan Name") == "CTE probed"]
    assert len(probed) == 1, neighbour_plans
    reads = [n for n in _plan_nodes(probed[0]) if n.get("Relation Name") == "nodes"]
    assert [(n["Node Type"], n["Index Name"]) for n in reads] == [("Index Scan", "nodes_pkey")]
    assert reads[0]["Index Cond"].startswith("(id ="), reads


def test_an_exhaustive_lexical_search_sorts_only_its_top_k(synthetic: Conn) -> None:
    """The exhaustive BM25 statement (few postings in all) cuts the top k before numbering
    them: its LIMIT sits directly on the sort, which is then a bounded top-N sort, rather
    than above the window function (every scored node sorted first)."""
    plans = [
        p
        for p in _nested_plans(
            synthetic,
            "SELECT * FROM memory.lexical_search('topic1 word2', NULL, NULL, 10)",
            (),
        )
        if "GROUP BY p.node_id" in p and "row_number()" in p
    ]
    assert len(plans) == 1, plans
    root = json.loads(plans[0][plans[0].index("{") :])["Plan"]
    limits = [n for n in _plan_nodes(root) if n["Node Type"] == "Limit"]
    bounded = [n for n in limits if n["Plans"][0]["Node Type"] == "Sort"]
    assert len(bounded) == 1, root
    assert root["Node Type"] != "Limit", root  # no LIMIT above the numbering


def _a_thousand_projects(conn: Conn) -> dict[str, int]:
    """1,000 more projects, each with its corpus statistics, analyzed (where the planner
    prefers an index to reading them all); the service's login made. Name -> id."""
    ensure_service_login(conn, "poimen_service")
    conn.execute(
        "INSERT INTO memory.projects (name)"
        " SELECT 'plan-probe-' || g FROM generate_series(1, 1000) AS g"
    )
    conn.execute(
        "INSERT INTO memory.corpus_stats (project_id, n_docs, total_len)"
        " SELECT id, 10, 100 FROM memory.projects WHERE name LIKE 'plan-probe-%'"
    )
    conn.execute("ANALYZE memory.projects")
    conn.execute("ANALYZE memory.corpus_stats")
    return {str(n): int(i) for n, i in conn.execute("SELECT name, id FROM memory.projects")}


def test_a_legs_corpus_size_is_read_by_the_projects_key_under_row_level_security(
    fixture_url: str,
) -> None:
    """memory.lexical_query reads the project's corpus size (every lexical leg) by
    corpus_stats' key as the service's role under generic plans: with the range's ends
    written as coalesce() in the statement, which is not leakproof, the range waited
    behind the policy and every project's row was read (1,000 here)."""
    with connect(fixture_url, autocommit=True) as conn:
        ids = _a_thousand_projects(conn)
        setup = (
            "SET LOCAL ROLE poimen_service",
            "SELECT set_config('poimen.read_projects', 'plan-probe-7', true)",
            "SET LOCAL plan_cache_mode = force_generic_plan",
        )
        plans = _nested_plans(
            conn,
            "SELECT * FROM memory.lexical_query('kong', %s, 10, 1.2, 0.75)",
            (ids["plan-probe-7"],),
            setup,
        )
    sizes = [p for p in plans if "FROM memory.corpus_stats c" in p]
    assert len(sizes) == 1, plans
    nodes = list(_plan_nodes(json.loads(sizes[0][sizes[0].index("{") :])["Plan"]))
    scans = [n for n in nodes if n.get("Relation Name") == "corpus_stats"]
    assert [n["Node Type"] for n in scans] == ["Index Scan"], sizes
    assert "project_id >=" in scans[0]["Index Cond"], sizes


def test_the_services_project_names_are_looked_up_by_the_unique_index(fixture_url: str) -> None:
    """memory._asserted_project_ids, behind every policy's InitPlan (10-19 an answer for the
    service asserting the request's project), probes memory.projects' unique name index
    under the generic plans an answer runs with, at a thousand projects: "name = ANY
    (names)" planned without the names was a sequential scan comparing every project with
    them. Its ids are the names' that exist, once each, ascending, for a request's few
    names and for a key's long list."""
    with connect(fixture_url, autocommit=True) as conn:
        ids = _a_thousand_projects(conn)
        few = ["plan-probe-7", "poimen", "plan-probe-7", "no-such-project"]
        many = [f"plan-probe-{i}" for i in range(1, 101)] + ["no-such-project"]
        for names in (few, many):
            setup = (
                "SET LOCAL ROLE poimen_service",
                f"SELECT set_config('poimen.read_projects', '{','.join(names)}', true)",
                "SET LOCAL plan_cache_mode = force_generic_plan",
            )
            plans = _nested_plans(conn, "SELECT memory._granted_ids(false)", (), setup)
            lookups = [p for p in plans if "memory.projects p" in p]
            assert lookups, plans
            nodes = [n for p in lookups for n in _plan_nodes(json.loads(p[p.index("{") :])["Plan"])]
            if names is few:
                assert {n.get("Index Name") for n in nodes} >= {"projects_name_key"}, lookups
                assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], lookups
            with conn.transaction():
                for statement in setup:
                    conn.execute(statement)
                got = conn.execute("SELECT memory._granted_ids(false)").fetchone()
            want = sorted({ids[n] for n in names if n in ids})
            assert got == (want,), names
