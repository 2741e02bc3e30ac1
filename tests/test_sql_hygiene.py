"""Extension-grade hygiene a DBA can check: search_path, parallel labels, comments, least
privilege, unwritable derived columns, PL/Python off the text-query path, and migrate's
lock timeout, drift report, directory permissions and cleanup."""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import FIXTURE, force_parallel, free_port
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import check, install_plpython, layout, migrate
from poimen_memory.db.migrate.apply import INLINED
from poimen_memory.db.migrate.locks import LOCK_KEY
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import MigrationError

Conn = psycopg.Connection[Any]

OURS = """
SELECT p.oid::regprocedure::text AS sig, p.proname, l.lanname, p.provolatile, p.proparallel,
       p.proconfig, p.prosecdef, p.proacl::text[], obj_description(p.oid, 'pg_proc')
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace JOIN pg_language l ON l.oid = p.prolang
WHERE n.nspname = 'memory'
   OR (n.nspname = 'public' AND p.proname IN ('memory_query', 'memory_optimize_query'))
ORDER BY 1
"""

# The grants the DBA can rely on (sql/900_grants.sql), by function name.
OWNER_ONLY = {
    "_refresh_grant_sets",
    "_grants_changed",
    "_projects_changed",
    "_writer_recorded",
    "configure_embedding",
    "reset_embedding",
    "set_policy",
    "reset_policy",
    "_valid_fusion_by_type",
    "refresh_lexical_bounds",
    "nodes_lexical_row",
    "nodes_lexical_statement",
    "enqueue_opensearch",
    "grant_project",
    "revoke_project",
    "enable_outbox",
    "configure_embedding_server",
    "clear_embedding_server",
    "add_project_partitions",
    "projects_partitions",
    "partition_by_project",
    "_ensure_trigger",
    "_ensure_statement_triggers",
    "_probe",
    "_ensure_indexes",
    "_is_project_graph",
    "_declare_row",
    "_project_graph_defs",
    "_index_state",
    "_missing_project_graphs",
    "_asserted_project_ids",
}
# Functions that write content: granted to poimen_memory_writer (the service's role inherits them).
WRITER = {
    "add_nodes",
    "_add_nodes",
    "_write_nodes",
    "_ensure_projects",
    "_stored_nodes",
    "_stored_hashes",
    "_vector_missing",
    "_same_version",
    "_writer",
    "forget",
    "_forget",
    "_review_changes",
    "review_claim",
    "review_confirm",
    "_rest_on_current",
    "_forget_max_nodes",
    "check_note",
    "set_retention",
    "expire",
}
# Owner-only functions the service's role may also run (sql/900_grants.sql, end).
SERVICE = {"configure_embedding", "enable_outbox", "_asserted_project_ids"}
READER = {
    "_asserting",
    "_role_grants",
    "version",
    "roles",
    "_embed",
    "_plain_error",
    "capabilities",
    "_valid_at",
    "check_instant",
    "project_id",
    "check_levels",
    "check_embedding",
    "require_embedding",
    "check_query",
    "check_weight",
    "policy",
    "_policy_keys",
    "_policy_defaults",
    "_policy_value",
    "lexical_document",
    "lexical_search",
    "lexical_kth",
    "_bm25_score",
    "lexical_query",
    "semantic_search",
    "_semantic_stage",
    "_vector_stage",
    "_semantic_exact_current",
    "_current_only",
    "_semantic_ef",
    "scale_warnings",
    "_project_graphs",
    "_project_graph_names",
    "exact_search",
    "search_by_ids",
    "fuse",
    "_fuse_lists",
    "fuse_legs",
    "provenance_walk",
    "_provenance_reach",
    "_rests_on",
    "_check_walk",
    "provenance_tree",
    "provenance",
    "provenance_forest",
    "hydrate",
    "_hydrate",
    "_support_rows",
    "select_evidence",
    "evidence",
    "check_evidence_budget",
    "check_fusion",
    "_evidence",
    "_deeper",
    "_plan",
    "plan_query",
    "_request",
    "strategies",
    "check_k",
    "check_within",
    "_leg",
    "_opensearch_leg",
    "_stage_time",
    "_run_legs",
    "_after_fusion",
    "_cited_only",
    "_finish",
    "_plan_cache_mode",
    "_execute",
    "_prepare",
    "answer",
    "_serve_start",
    "_lexical_calls",
    "_lexical_call",
    "_serve",
    "_serve_finish",
    "_carry_plan",
    "_carried_plan",
    "_assert_projects",
    "support_status",
    "parents_present",
    "_links_max",
    "get_node",
    "_get_node",
    "_node_cursor",
    "_node_after",
    "list_nodes",
    "_list_nodes",
    "count_nodes",
    "_count_nodes",
    "_project_summary",
    "_nodes_where",
    "retention",
    "granted_all",
    "_asserted_all",
    "plpython_path",
    "plpython_load",
    "optimize_query",
    "_optimize_query",
    "check_reference_time",
    "embed",
    "stage_sql",
    "explain_query",
    "_request_instant",
    "_explained",
    "_explain_vector",
    "_without_counts",
    "_explain",
    "_answer",
    "_only",
    "query",
    "memory_query",
    "memory_optimize_query",
    "granted_projects",
    "granted_project_ids",
    "_granted_ids",
    "_asserted_ids",
    "time_bound",
    "time_range",
    "_visible",
    "_visibility",
    "_leg_visibility",
    "_with_grammar",
    "_grammar_required",
    "_versions_at",
    "_plan_visibility",
    "_listing_visibility",
    "partitioned",
    "partition_tables",
    "check_filter",
    "parse_query",
    "_grammar_item",
    "_grammar_pattern",
    "_grammar_doc",
    "_grammar_has",
    "_grammar_match",
    "_grammar_constraints",
    "_grammar_compile",
    "check_grammar",
    "history",
    "support",
    "_rested_parents",
    "_support_at",
    "_support_valid_at",
    "_cites_superseded",
    "review_list",
    "_review_rows",
    "_review_limit",
}


def one(conn: Conn, query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _functions(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(OURS).fetchall()


def _grantees(acl: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in acl or []:
        who, rest = item.split("=", 1)
        out[who or "PUBLIC"] = rest.split("/", 1)[0]
    return out


# --- catalog ----------------------------------------------------------------------------


def test_security_definer_functions_search_only_the_catalog(conn: Conn) -> None:
    """A function that runs as the owner must not resolve names in a schema a caller could
    create objects in (CVE-2018-1058): pg_catalog and pg_temp (last) only."""
    definers = [(r[0], r[5]) for r in _functions(conn) if r[6]]
    assert definers  # the statistics triggers and configure_embedding, at least
    for sig, config in definers:
        paths = [c for c in config or [] if c.startswith("search_path=")]
        assert paths == ["search_path=pg_catalog, pg_temp"], (sig, paths)


def test_every_function_pins_search_path_and_has_a_comment(conn: Conn) -> None:
    """Every function but the predicates the planner must inline (migrate.INLINED): a SET
    clause stops inlining, so those carry none and are inlinable as PostgreSQL requires."""
    rows = _functions(conn)
    assert len(rows) >= 30
    unpinned = {r[0] for r in rows if not any(c.startswith("search_path=") for c in r[5] or [])}
    assert {s.split("(", 1)[0] for s in unpinned} == set(INLINED)
    for sig, _name, lang, vol, _par, config, secdef, *_ in rows:
        if sig in unpinned:
            assert (lang, config, secdef) == ("sql", None, False), sig
            assert vol in ("i", "s"), sig
    assert [r[0] for r in rows if not r[8]] == []


def test_the_visibility_predicate_is_inlined(conn: Conn) -> None:
    """memory._visible folds into plain quals: EXPLAIN shows the tests it makes, never the
    function, and a current-versions visibility as expired_at IS NULL."""
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            "EXPLAIN SELECT n.id FROM memory.nodes n WHERE memory._visible(n, "
            "memory._visibility(levels => '{L1}', filter => '{\"k\": 1}'))"
        ).fetchall()
    )
    assert "_visible" not in plan, plan
    assert "expired_at IS NULL" in plan and "metadata @>" in plan, plan


def test_the_membership_test_and_the_plan_mode_are_inlined(conn: Conn) -> None:
    """memory._asserting (every row-level security check's) and memory._plan_cache_mode
    fold into the expressions that call them: EXPLAIN VERBOSE shows what they test, never a
    call to them."""
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            "EXPLAIN VERBOSE SELECT memory._asserting(x), memory._plan_cache_mode()"
            " FROM (VALUES (true), (false)) v(x)"
        ).fetchall()
    )
    assert "_asserting" not in plan and "_plan_cache_mode" not in plan, plan
    assert "pg_has_role" in plan and "pg_get_partkeydef" in plan, plan


def test_the_provenance_rule_is_inlined(conn: Conn) -> None:
    """memory._rests_on folds into plain quals of the walks: the edge's test on the edge,
    the node's on the node, never a call to it."""
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            "EXPLAIN SELECT e.parent_id FROM memory.edges e"
            " JOIN memory.nodes p ON p.id = e.parent_id"
            " WHERE e.child_id = 1 AND memory._rests_on(p, e.child_id, e.linked_at, %(t)s,"
            " memory._visibility("
            "as_of => %(t)s), memory._visibility(every_version => true, live_at => %(t)s))",
            {"t": "2026-01-01T00:00:00Z"},
        ).fetchall()
    )
    assert "_rests_on" not in plan and "_visible" not in plan, plan
    lines = plan.splitlines()

    def filter_of(scan: str) -> str:  # the Filter line under a scan node, whatever the order
        at = next(i for i, x in enumerate(lines) if scan in x)
        return next(x for x in lines[at + 1 :] if "Filter:" in x)

    assert "linked_at" in filter_of(" on edges e"), plan
    assert "expires_at" in filter_of(" on nodes p"), plan


def test_the_bm25_rounding_is_inlined(conn: Conn) -> None:
    """memory._bm25_score, run once per scored document, folds into the expression: the
    plan never calls it, and its value is the rounding it documents."""
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            "EXPLAIN VERBOSE SELECT memory._bm25_score(x::float8 / 7) FROM generate_series(1, 3) x"
        ).fetchall()
    )
    assert "_bm25_score" not in plan and "round" in plan, plan
    assert one(conn, "SELECT memory._bm25_score(1.23456789049)") == 1.23456789
    assert one(conn, "SELECT memory._bm25_score(1.2345678906)") == 1.234567891


def test_current_only_reads_every_field_of_the_visibility(conn: Conn) -> None:
    # memory._current_only says a visibility tests nothing but its project and levels, so
    # the exact stage may drop memory._visible (memory._vector_stage): a field added to
    # memory.visibility and not read there would be a test that stage silently skips.
    fields = [
        r[0]
        for r in conn.execute(
            "SELECT a.attname FROM pg_attribute a WHERE a.attrelid = 'memory.visibility'::regclass"
            " AND a.attnum > 0 AND NOT a.attisdropped"
        ).fetchall()
    ]
    body = one(conn, "SELECT pg_get_functiondef('memory._current_only'::regproc)")
    unread = [
        f
        for f in fields
        if f not in ("project_id", "levels") and not re.search(rf"\(v\)\.{f}\b", body)
    ]
    assert len(fields) > 10 and unread == [], unread


def test_parallel_labels(conn: Conn) -> None:
    by_name = {r[1]: r for r in _functions(conn)}
    for sig, _name, lang, vol, par, *_ in by_name.values():
        if lang == "plpython3u":  # plpy.execute opens subtransactions
            assert par == "u", sig
        if vol == "v":  # writes, DDL or triggers never run in a worker
            assert par == "u", sig
    for name in ("_answer", "query", "memory_query", "memory_optimize_query"):
        assert by_name[name][4] == "u"  # they may call the PL/Python optimizer
    for name in ("hydrate", "fuse", "fuse_legs", "provenance_tree", "policy", "lexical_query"):
        assert by_name[name][4] == "s"
    # they set a setting for the call (hnsw.ef_search; plan_cache_mode), or run one that does
    for name in ("semantic_search", "lexical_search", "_leg", "_lexical_call", "select_evidence"):
        assert by_name[name][4] == "u", name


def test_schema_tables_and_columns_are_commented(conn: Conn) -> None:
    assert one(conn, "SELECT obj_description('memory'::regnamespace)")
    missing = conn.execute(
        "SELECT c.relname, a.attname FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'memory'"
        " LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
        "      AND col_description(c.oid, a.attnum) IS NULL"
        " WHERE c.relkind = 'r'"
        "   AND (obj_description(c.oid, 'pg_class') IS NULL OR a.attname IS NOT NULL)"
    ).fetchall()
    assert missing == []


def test_version_names_the_newest_migration(conn: Conn) -> None:
    version, migrations, checksum = conn.execute("SELECT * FROM memory.version()").fetchone()  # type: ignore[misc]
    assert version == max(p.stem for p in layout.MIGRATIONS_DIR.glob("*.sql"))
    assert migrations[-1] == version and checksum


# --- search_path and parallel mode -------------------------------------------------------


def test_functions_work_under_an_empty_search_path(conn: Conn, embedder: LocalEmbedder) -> None:
    q = "how do I fix uploads over 10KB failing through the kong gateway"
    emb = embedder.embed_query(q)
    conn.execute("SET search_path = ''")
    ids = [r[0] for r in conn.execute("SELECT id FROM memory.nodes ORDER BY id LIMIT 3")]
    rows = conn.execute("SELECT node_id, query_score FROM memory.hydrate(%s, %s)", (ids, emb))
    assert [r[0] for r in rows.fetchall()] == ids
    hybrid = conn.execute(
        "SELECT search_strategy, query_score FROM public.memory_query(%s, %s, 'poimen')", (q, emb)
    ).fetchall()
    assert hybrid and hybrid[0][0] == "Hybrid" and all(r[1] is not None for r in hybrid)
    assert conn.execute(
        "SELECT count(*) FROM memory.semantic_search(%s, 'poimen', '{L1}', 5)", (emb,)
    ).fetchone() == (5,)


def test_query_runs_under_forced_parallel_mode(conn: Conn, embedder: LocalEmbedder) -> None:
    q = "how do I fix uploads over 10KB failing through the kong gateway"
    emb = embedder.embed_query(q)
    for key, value in (
        (force_parallel(conn), "on"),
        ("parallel_setup_cost", "0"),
        ("parallel_tuple_cost", "0"),
        ("min_parallel_table_scan_size", "0"),
    ):
        conn.execute(f"SET {key} = {value}")
    assert one(conn, "SELECT count(*) FROM public.memory_query(%s, %s, 'poimen')", (q, emb))
    assert one(conn, "SELECT count(*) FROM public.memory_query('kong body buffer')")
    assert one(conn, "SELECT public.memory_optimize_query('kong')")


def test_semantic_search_ef_search_under_forced_parallel_mode(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    conn.execute(f"SET {force_parallel(conn)} = on")
    emb = embedder.embed_query("kong")
    assert conn.execute(
        "SELECT count(*) FROM memory.semantic_search(%s, 'poimen', '{L1}', 5, 40)", (emb,)
    ).fetchone() == (5,)


# --- privileges -------------------------------------------------------------------------


def test_grants_are_listed_per_function(conn: Conn) -> None:
    seen: set[str] = set()
    for sig, name, *_rest, acl, _comment in _functions(conn):
        g = _grantees(acl)
        seen.add(name)
        assert "PUBLIC" not in g, f"PUBLIC may execute {sig}"
        # Writers inherit the reader's functions; only the writing ones are granted to them.
        assert ("poimen_memory_writer" in g) == (name in WRITER), sig
        if name in READER:
            assert g.get("poimen_memory_reader") == "X", sig
        elif name in WRITER:
            assert g.get("poimen_memory_writer") == "X" and "poimen_memory_reader" not in g, sig
        else:
            assert name in OWNER_ONLY, f"{sig} is in neither list of sql/900_grants.sql"
            assert "poimen_memory_reader" not in g, sig
            assert ("poimen_memory_service" in g) == (name in SERVICE), sig
    assert (READER | WRITER) - seen <= {"lexical_kth"}


def test_reader_cannot_run_ddl_ish_functions(conn: Conn) -> None:
    conn.execute("SELECT memory.grant_project('poimen_memory_reader', 'poimen')")  # rows: RLS
    conn.execute("SET ROLE poimen_memory_reader")
    assert one(conn, "SELECT count(*) FROM public.memory_query('kong')")
    for call in (
        "SELECT memory.configure_embedding('x', 3)",
        "SELECT memory.reset_embedding('x', 3)",
        "SELECT memory.set_policy('fusion', 'rrf')",
        "SELECT memory.reset_policy()",
        "SELECT memory.grant_project('poimen_memory_reader', '*')",
        "SELECT memory.revoke_project('poimen_memory_reader', 'poimen')",
        "SELECT memory.configure_embedding_server('http://127.0.0.1:9')",
        "SELECT memory.clear_embedding_server()",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(call)


def test_objects_a_dba_adds_are_not_granted(conn: Conn, fixture_url: str) -> None:
    conn.execute("CREATE TABLE memory.dba_notes (note text)")
    conn.execute("CREATE FUNCTION memory.dba_tool() RETURNS int LANGUAGE sql RETURN 1")
    migrate(conn, None)
    acl = conn.execute(
        "SELECT (SELECT relacl::text FROM pg_class WHERE oid = 'memory.dba_notes'::regclass),"
        " (SELECT proacl::text FROM pg_proc WHERE oid = 'memory.dba_tool()'::regprocedure)"
    ).fetchone()
    assert (
        acl is not None
        and "poimen_memory_reader" not in str(acl[0])
        and "poimen_memory_reader" not in str(acl[1])
    )
    # A function created in the schema by the owner is not executable by PUBLIC by default
    # (a NULL proacl is the built-in default: PUBLIC may execute).
    public = conn.execute(
        "SELECT count(*) FROM pg_proc p,"
        " aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a"
        " WHERE p.oid = 'memory.dba_tool()'::regprocedure AND a.grantee = 0"
    ).fetchone()
    assert public == (0,)


def test_derived_columns_cannot_be_written(conn: Conn) -> None:
    conn.execute("SELECT memory.grant_project('poimen_memory_writer', 'poimen', write => true)")
    conn.execute("SET ROLE poimen_memory_writer")
    nid = one(conn, "SELECT id FROM memory.nodes WHERE external_id = 'poimen:mem:1'")
    for stmt in (
        "UPDATE memory.nodes SET tsv = 'zzz:1' WHERE id = %s",
        "UPDATE memory.nodes SET lex_len = 1 WHERE id = %s",
        "UPDATE memory.postings SET tf = 99 WHERE node_id = %s",
        "UPDATE memory.term_stats SET df = 0 WHERE project_id = %s",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(stmt, (nid,))
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, text, tsv)"
            " VALUES (sha256('x'), 1, 'L1', 'x', 'zzz:1')"
        )
    # Content stays writable, and the derived columns follow it.
    conn.execute("UPDATE memory.nodes SET text = 'zebra crossing' WHERE id = %s", (nid,))
    assert "zebra" in one(conn, "SELECT tsv::text FROM memory.nodes WHERE id = %s", (nid,))
    hits = conn.execute(
        "SELECT node_id FROM public.memory_query('zebra crossing', project => 'poimen')"
    )
    assert [r[0] for r in hits.fetchall()][:1] == [nid]


# --- PL/Python off the critical path ----------------------------------------------------


def test_text_queries_run_without_plpython(conn: Conn, embedder: LocalEmbedder) -> None:
    """As after a restore on a host without the module (or on a managed PostgreSQL): text
    queries and forced strategies still answer; a query that would need the optimizer's
    routing is planned as Hybrid, and the plan says why."""
    conn.execute(
        "UPDATE memory.config SET value = '/nonexistent/poimen' WHERE key = 'plpython_path'"
    )
    rows = conn.execute(
        "SELECT external_id, search_strategy"
        " FROM public.memory_query('kong body buffer', project => 'poimen')"
    ).fetchall()
    assert rows[0] == ("poimen:mem:1", "LexicalOnly")
    q = "uploads over 10KB failing"
    emb = embedder.embed_query(q)
    forced = conn.execute(
        "SELECT search_strategy FROM public.memory_query(%s, %s, 'poimen', strategy => 'Hybrid')",
        (q, emb),
    ).fetchall()
    assert forced and forced[0][0] == "Hybrid"
    routed = conn.execute(
        "SELECT DISTINCT search_strategy FROM public.memory_query(%s, %s, 'poimen')", (q, emb)
    ).fetchall()
    assert routed == [("Hybrid",)]
    plan = one(conn, "SELECT memory.plan_query(%s, project => 'poimen')", (q,))
    assert {"stage": "optimizer", "reason": "not_installed"} in plan["degraded"]
    assert any("no optimizer on this database" in w for w in plan["why"])


# --- migrate ----------------------------------------------------------------------------


def test_migrate_gives_up_on_a_held_lock(conn: Conn, fixture_url: str) -> None:
    with psycopg.connect(fixture_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        with pytest.raises(MigrationError, match="could not take a lock") as exc:
            migrate(conn, None, lock_timeout_s=0.2)
        assert "pg_locks" in (exc.value.hint or "")
        with pytest.raises(MigrationError, match="could not take a lock"):
            check(conn, lock_timeout_s=0.2)


def test_check_reports_drift_and_changes_nothing(conn: Conn) -> None:
    assert check(conn).clean
    conn.execute(
        "CREATE OR REPLACE FUNCTION memory.check_levels(levels text[]) RETURNS text[]"
        " LANGUAGE sql IMMUTABLE RETURN levels"
    )
    conn.execute("CREATE FUNCTION memory.dba_tool() RETURNS int LANGUAGE sql RETURN 1")
    drift = check(conn)
    assert not drift.clean
    assert drift.changed == ["memory.check_levels(text[])"]
    assert drift.extra == ["memory.dba_tool()"] and drift.missing == []
    # Nothing was changed by the check: the hand edit is still there.
    assert conn.execute("SELECT memory.check_levels('{L9}')").fetchone() == (["L9"],)
    migrate(conn, None)
    assert check(conn).clean


def test_migrate_check_cli_exit_codes(fixture_url: str, conn: Conn, plpython_root: Path) -> None:
    import sys

    # The directory the fixture was migrated with, named (a URL database records none
    # unless asked): --check compares memory.config with it.
    env = dict(os.environ, POIMEN_DATABASE_URL=fixture_url)
    cli = [sys.executable, "-m", "poimen_memory.cli.main", "migrate", "--check"]
    cli += ["--plpython-dir", str(plpython_root)]
    ok = subprocess.run(cli, env=env, capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "no drift" in ok.stdout, ok.stdout + ok.stderr
    conn.execute("COMMENT ON FUNCTION memory.policy() IS 'edited by hand'")
    drift = subprocess.run(cli, env=env, capture_output=True, text=True, check=False)
    assert drift.returncode == 1 and "memory.policy()" in drift.stdout


def test_commands_that_migrate_record_no_path_of_their_host(
    fixture_url: str, tmp_path: Path
) -> None:
    """ingest and keys migrate first, as migrate does: for a database named by URL with no
    directory of this host recorded (it imports poimen_core from memory._plpython_modules).
    They recorded this host's, so --check found drift, and a server on another host would
    have looked for poimen_core in a directory it does not have (a helper's attack)."""
    import sys

    env = dict(os.environ, POIMEN_DATABASE_URL=fixture_url)
    cli = [sys.executable, "-m", "poimen_memory.cli.main"]
    nodes = tmp_path / "one.jsonl"
    nodes.write_text('{"id": "host:1", "level": "L0", "text": "a turn from another host"}\n')
    for args in (["migrate"], ["ingest", str(nodes), "--project", "poimen"],
                 ["keys", "create", "--project", "poimen"], ["migrate", "--check"]):  # fmt: skip
        out = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, check=False)
        assert out.returncode == 0, (args, out.stdout + out.stderr)
    assert "no drift" in out.stdout, out.stdout


def test_migrate_and_check_print_the_scale_warnings(
    fixture_url: str, conn: Conn, plpython_root: Path
) -> None:
    """memory.scale_warnings() (issue 28) in the CLI: migrate and migrate --check name the
    project that outgrew the exact path; a warning, not drift (--check still exits 0)."""
    import sys

    env = dict(os.environ, POIMEN_DATABASE_URL=fixture_url)
    cli = [sys.executable, "-m", "poimen_memory.cli.main", "migrate"]
    cli += ["--plpython-dir", str(plpython_root)]
    conn.execute("SELECT memory.set_policy('exact_scan_max_nodes', '1')")
    (project,) = conn.execute(
        "SELECT p.name FROM memory.corpus_stats c JOIN memory.projects p ON p.id = c.project_id"
        " ORDER BY c.n_docs LIMIT 1"
    ).fetchone()  # type: ignore[misc]
    for args in (["--check"], []):
        out = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        line = f"scale warning: filtered_hnsw (project {project}): project {project} holds"
        assert line in out.stdout, out.stdout
    conn.execute("SELECT memory.reset_policy('exact_scan_max_nodes')")
    out = subprocess.run([*cli, "--check"], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "scale warning" not in out.stdout, out.stdout


def test_plpython_install_touches_only_its_own_directories(work_dir: Path) -> None:
    private = work_dir / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    if os.geteuid() == 0:  # the server (postgres) could not traverse it: refuse, change nothing
        with pytest.raises(MigrationError, match="not reachable") as exc:
            install_plpython(private / "plpython")
        assert str(private) in (exc.value.detail or "")
    else:
        install_plpython(private / "plpython")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_migrate_removes_old_plpython_copies(conn: Conn, work_dir: Path) -> None:
    root = work_dir / "plpython-cleanup"
    root.mkdir()
    root.chmod(0o755)
    stale = root / "0123456789abcdef"
    (stale / "poimen_core").mkdir(parents=True)
    (root / "0123456789abcdef.tmp42").mkdir()
    (root / "keep-me").mkdir()
    report = migrate(conn, root)
    assert report.removed_copies == ["0123456789abcdef", "0123456789abcdef.tmp42"]
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [Path(report.plpython_path or "").name, "keep-me"]
    )
    assert one(conn, "SELECT public.memory_optimize_query('kong')")


def test_migrate_installs_the_modules_bytecode_for_the_server(conn: Conn, work_dir: Path) -> None:
    """Compiled where the server's OS user can read it (whatever the installer's umask); a
    server of this Python's X.Y finds, for every module of the package it imported, bytecode
    its own import accepts (magic number, timestamp flags, the source's mtime and size).
    The server cannot write it, so without it each backend compiled the modules at its
    first PL/Python call."""
    root = work_dir / "plpython-bytecode"
    umask = os.umask(0o077)
    try:
        report = migrate(conn, root)
    finally:
        os.umask(umask)
    pkg = Path(report.plpython_path or "") / "poimen_core"
    modules = sorted(pkg.glob("*.py"))
    assert modules
    assert stat.S_IMODE((pkg / "__pycache__").stat().st_mode) == 0o755
    for source in modules:
        compiled = Path(importlib.util.cache_from_source(str(source)))
        assert stat.S_IMODE(compiled.stat().st_mode) == 0o644, compiled
    one(conn, "SELECT memory.optimize_query('why did uploads over 10KB fail last week')")
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute(
        """DO $$
import importlib.util, os, sys
import poimen_core
def accepted(module):
    st = os.stat(module.__file__)
    with open(importlib.util.cache_from_source(module.__file__), "rb") as f:
        head = f.read(16)
    return head == (importlib.util.MAGIC_NUMBER + bytes(4)
                    + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                    + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
mods = [m for n, m in sorted(sys.modules.items()) if n.split(".")[0] == "poimen_core"]
bad = [m.__name__ for m in mods if not accepted(m)]
plpy.notice("server %d.%d %d %s %s" % (*sys.version_info[:2], len(mods), ",".join(bad) or "-",
                                       poimen_core.__file__))
$$ LANGUAGE plpython3u"""
    )
    (notice,) = [n for n in notices if n.startswith("server ")]
    _, version, count, bad, imported = notice.split(" ")
    assert imported == str(pkg / "__init__.py"), notice
    assert int(count) >= 3, notice  # the package, the optimizer and what it imports
    if version == f"{sys.version_info[0]}.{sys.version_info[1]}":
        assert bad == "-", notice


# --- dump and restore -------------------------------------------------------------------


@pytest.fixture
def fresh_cluster(work_dir: Path) -> Iterator[Cluster]:
    c = Cluster(work_dir / "restore-data", work_dir / "restore-run", free_port(), find_pg_bin())
    c.start(fast=True)
    yield c
    c.destroy()


def _acl_map(conn: Conn) -> dict[str, dict[str, str]]:
    # Signatures print types outside the search_path schema-qualified: compare them bare.
    def bare(sig: str) -> str:
        sig = sig.replace("extensions.vector", "vector").replace("public.vector", "vector")
        return sig.removeprefix("public.")

    return {bare(r[0]): _grantees(r[7]) for r in _functions(conn)}


@pytest.mark.parametrize("no_acl", [False, True])
def test_dump_restores_into_a_fresh_cluster(
    conn: Conn,
    fixture_url: str,
    fresh_cluster: Cluster,
    plpython_root: Path,
    work_dir: Path,
    no_acl: bool,
) -> None:
    """pg_dump of a migrated database, pg_restore into a cluster that lacks our roles, then
    migrate there: the grants are back exactly and PUBLIC executes nothing."""
    assert FIXTURE.exists()
    # Project grants are kept by role name, so they survive into a cluster with other oids.
    conn.execute("SELECT memory.grant_project('poimen_memory_reader', 'poimen')")
    dump = work_dir / f"memory-{no_acl}.dump"
    bin_dir = fresh_cluster.bin_dir
    subprocess.run(
        [str(bin_dir / "pg_dump"), "-Fc", "-f", str(dump), "-d", fixture_url],
        check=True,
        capture_output=True,
    )
    restore = subprocess.run(
        [str(bin_dir / "pg_restore"), "-d", fresh_cluster.url(), str(dump)]
        + (["--no-acl", "--no-owner"] if no_acl else []),
        capture_output=True,
        text=True,
        check=False,
    )
    if no_acl:
        assert restore.returncode == 0, restore.stderr
    with connect(fresh_cluster.url(), autocommit=True) as target:
        migrate(target, plpython_root)
        after = _acl_map(target)
        assert after == _acl_map(conn)
        assert all("PUBLIC" not in g for g in after.values())
        target.execute("SET ROLE poimen_memory_reader")
        rows = target.execute(
            "SELECT external_id FROM public.memory_query('kong body buffer', project => 'poimen')"
        )
        assert rows.fetchone() == ("poimen:mem:1",)


def test_sql_reads_the_shared_vocabulary(conn: Conn) -> None:
    """migrate writes poimen_core.vocabulary into the SQL it applies: the database's words
    are the service's, and a marker left in a function is none."""
    from poimen_core import vocabulary

    assert one(conn, "SELECT memory.strategies()") == list(vocabulary.STRATEGIES)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT memory.check_fusion('borda')")
    assert one(conn, "SELECT memory.check_fusion('rrf')") == "rrf"
    leftover = conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p"
        " WHERE p.pronamespace = 'memory'::regnamespace AND p.prosrc LIKE '%@vocabulary.%'"
    ).fetchall()
    assert leftover == []


def test_project_name_is_one_domain_from_the_vocabulary(conn: Conn) -> None:
    """memory.projects.name is a memory.project_name, whose CHECK is the vocabulary's
    pattern: migrate puts it back when it was changed by hand, and memory.grant_project
    refuses what the domain refuses with the same error as before the domain."""
    from poimen_core import vocabulary

    def check_clause() -> Any:
        return one(
            conn,
            "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c"
            " WHERE c.contypid = 'memory.project_name'::regtype",
        )

    want = f"CHECK ((VALUE ~ '^{vocabulary.PROJECT_NAME}$'::text))"
    column_type = one(
        conn,
        "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
        " WHERE a.attrelid = 'memory.projects'::regclass AND a.attname = 'name'",
    )
    assert column_type == "memory.project_name" and check_clause() == want
    assert one(conn, "SELECT 'poimen:a_b-1.2'::memory.project_name") == "poimen:a_b-1.2"
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("INSERT INTO memory.projects (name) VALUES ('no spaces')")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as exc:
        conn.execute("SELECT memory.grant_project('poimen_memory_reader', 'no spaces')")
    assert exc.value.diag.message_primary == 'invalid project name "no spaces"'
    assert exc.value.diag.message_detail == (
        f"A project name matches {vocabulary.PROJECT_NAME}, or is * for every project."
    )
    conn.execute("ALTER DOMAIN memory.project_name DROP CONSTRAINT project_name_check")
    conn.execute("ALTER DOMAIN memory.project_name ADD CONSTRAINT project_name_check CHECK (true)")
    migrate(conn, None)
    assert check_clause() == want
    assert check(conn).clean
