"""Partitioning by project (sql/087_partitions.sql): memory.partition_by_project() moves a
database with data over without loss (every row, every ranking equal before and after),
keeps row-level security, privileges and triggers, prunes a project's query to its own
partition and HNSW graph, and gives a new project its partitions; migration 0009 refuses
provenance edges across projects instead of dropping them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import make_role, stage_migrations
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import check, layout, migrate
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest

Conn = psycopg.Connection[Any]
CLI = [sys.executable, "-m", "poimen_memory.cli.main"]
FIXTURE = Path(__file__).parent / "fixtures" / "memory_nodes.jsonl"

TABLES = ("nodes", "edges", "postings", "term_stats", "corpus_stats")
# The whole content of each table in key order: equal digests mean equal rows.
ORDER = {
    "nodes": "t.id",
    "edges": "t.child_id, t.parent_id",
    "postings": "t.lexeme, t.project_id, t.node_id",
    "term_stats": "t.project_id, t.lexeme",
    "corpus_stats": "t.project_id",
}
CONTENT = {
    t: f"SELECT md5(string_agg(t::text, '|' ORDER BY {o})) FROM memory.{t} t"
    for t, o in ORDER.items()
}
QUERIES = (
    "kong client body buffer size",
    "why did requests over 10KB fail",
    "what did the team decide about retries",
    "postgres vacuum",
    "deploy",
)


def _state(conn: Conn) -> dict[str, Any]:
    return {t: conn.execute(q).fetchone() for t, q in CONTENT.items()} | {
        f"count:{t}": conn.execute(f"SELECT count(*) FROM memory.{t}").fetchone() for t in TABLES
    }


def _rankings(conn: Conn, embedder: LocalEmbedder) -> dict[str, Any]:
    """What every retrieval entry point answers for a fixed query set, per project and for
    all projects: memory.query (both legs, fusion, provenance trees), and each leg alone."""
    projects = [r[0] for r in conn.execute("SELECT name FROM memory.projects ORDER BY name")]
    out: dict[str, Any] = {}
    for q in QUERIES:
        vec = embedder.embed_query(q)
        for project in [*projects, None]:
            key = f"{q}@{project}"
            out["query:" + key] = conn.execute(
                "SELECT node_id, final_score, provenance::text"
                " FROM memory.query(%s, %s::vector, %s, ARRAY['L0','L1','L2'], 10)",
                (q, vec, project),
            ).fetchall()
            out["lexical:" + key] = conn.execute(
                "SELECT node_id, rank, lexical_score FROM memory.lexical_search(%s, %s, NULL, 20)",
                (q, project),
            ).fetchall()
            out["semantic:" + key] = conn.execute(
                "SELECT node_id, rank FROM memory.semantic_search(%s::vector, %s, NULL, 20)",
                (vec, project),
            ).fetchall()
    return out


def _partitions(conn: Conn, table: str) -> set[str]:
    rows = conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = %s::regclass",
        (f"memory.{table}",),
    )
    return {r[0] for r in rows}


def _scanned_relations(plan: dict[str, Any]) -> set[str]:
    found: set[str] = set()
    if "Relation Name" in plan:
        found.add(str(plan["Relation Name"]))
    for child in plan.get("Plans", []):
        found |= _scanned_relations(child)
    return found


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(m for child in node.get("Plans", []) for m in _plan_nodes(child))]


def _embedding_storage(conn: Conn) -> set[str]:
    """The storage of nodes.embedding in the parent and every partition."""
    rows = conn.execute(
        "SELECT a.attstorage FROM pg_attribute a WHERE a.attname = 'embedding' AND a.attrelid IN"
        " (SELECT 'memory.nodes'::regclass UNION ALL"
        "  SELECT inhrelid FROM pg_inherits WHERE inhparent = 'memory.nodes'::regclass)"
    ).fetchall()
    assert len(rows) == 1 + len(_partitions(conn, "nodes"))
    return {r[0] for r in rows}


def test_partition_by_project_keeps_every_row_and_ranking(
    conn: Conn, embedder: LocalEmbedder, fixture_url: str, plpython_root: Path
) -> None:
    before, ranked = _state(conn), _rankings(conn, embedder)
    assert before["count:nodes"][0] > 0 and before["count:edges"][0] > 0
    pids = dict(conn.execute("SELECT name, id FROM memory.projects").fetchall())
    assert conn.execute("SELECT memory.partitioned()").fetchone() == (False,)
    next_id = conn.execute("SELECT max(id) FROM memory.nodes").fetchone()

    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    report = conn.execute("SELECT * FROM memory.partition_by_project()").fetchall()

    assert conn.execute("SELECT memory.partitioned()").fetchone() == (True,)
    assert [r[0] for r in report] == list(TABLES)
    for table, parts, rows_before, rows_after in report:
        assert parts == len(pids) and rows_before == rows_after == before[f"count:{table}"][0]
        assert _partitions(conn, table) == {f"{table}_p{i}" for i in pids.values()}
    assert any("copied" in n for n in notices) and any("done in" in n for n in notices)
    assert _state(conn) == before
    assert _rankings(conn, embedder) == ranked
    # The id sequence carried over: a new node continues after the old ones.
    new_id = conn.execute(
        "INSERT INTO memory.nodes (sha256, project_id, level, text)"
        " VALUES (sha256('after'::bytea), %s, 'L0', 'after the move') RETURNING id",
        (pids["poimen"],),
    ).fetchone()
    assert new_id is not None and next_id is not None and new_id[0] > next_id[0]
    # A second call changes nothing; sql/ re-applies cleanly and reports no drift.
    again = conn.execute("SELECT * FROM memory.partition_by_project()").fetchall()
    assert [r[1] for r in again] == [len(pids)] * len(TABLES) and any(
        "already partitioned" in n for n in notices
    )
    migrate(conn, plpython_root)
    assert check(conn).clean


def test_a_project_query_reads_only_its_partition(conn: Conn, embedder: LocalEmbedder) -> None:
    conn.execute("SELECT memory.partition_by_project()")
    pid = conn.execute("SELECT id FROM memory.projects WHERE name = 'poimen'").fetchone()
    assert pid is not None
    vec = embedder.embed_query("kong client body buffer size")
    plans = conn.execute(
        "SELECT stage, plan FROM memory.explain_query('kong client body buffer size', %s::vector,"
        " 'poimen', ARRAY['L1','L2'], 5, 'SemanticOnly')",
        (vec,),
    ).fetchall()
    (top,) = [
        p["Plan"] if isinstance(p, dict) else p[0]["Plan"] for st, p in plans if st == "semantic"
    ]
    assert _scanned_relations(top) == {f"nodes_p{pid[0]}"}
    # An answer's second half keeps PostgreSQL's choice of plans here (custom plans prune
    # to the project's partition before locking); on one table it plans once per session.
    assert conn.execute("SELECT memory._plan_cache_mode()").fetchone() == ("auto",)
    # So does a plain lexical search (on one table it keeps generic plans): its postings are
    # read in the project's partition alone, the project a constant of the plan.
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    with conn.transaction():
        conn.execute("LOAD 'auto_explain'")
        for k, v in [("log_min_duration", "0"), ("log_nested_statements", "on"),
                     ("log_level", "notice"), ("log_format", "json")]:  # fmt: skip
            conn.execute(f"SET LOCAL auto_explain.{k} = '{v}'")
        conn.execute("SET LOCAL client_min_messages = notice")
        conn.execute("SELECT * FROM memory.lexical_search('kong body buffer', 'poimen')").fetchall()
    postings = [
        n
        for text in notices
        if "{" in text
        for n in _plan_nodes(json.loads(text[text.index("{") :])["Plan"])
        if str(n.get("Relation Name", "")).startswith("postings")
    ]
    assert postings, notices
    assert {n["Relation Name"] for n in postings} == {f"postings_p{pid[0]}"}, postings
    assert not [n for n in postings if "$" in str(n.get("Index Cond"))], postings
    # The partition has its own HNSW graphs (the planner picks them once it is large enough).
    hnsw = conn.execute(
        "SELECT count(*) FROM pg_indexes WHERE schemaname = 'memory' AND tablename = %s"
        " AND indexdef LIKE '%%USING hnsw%%'",
        (f"nodes_p{pid[0]}",),
    ).fetchone()
    assert hnsw == (2,)


def test_a_large_projects_own_graphs_are_not_copied_to_every_partition(conn: Conn) -> None:
    """A project's own HNSW graphs (memory._project_graphs) are partial indexes of the one
    table; partitioning gives each project a graph of its own anyway, so they are not copied:
    each partition keeps its pair, none gets an empty pair per large project."""
    pid = conn.execute("SELECT id FROM memory.projects WHERE name = 'poimen'").fetchone()
    assert pid is not None
    vs = conn.execute(
        "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace"
        " WHERE e.extname = 'vector'"
    ).fetchone()
    assert vs is not None
    conn.execute(
        f"CREATE INDEX nodes_embedding_hnsw_p{pid[0]} ON memory.nodes USING hnsw "
        f'(embedding "{vs[0]}".vector_cosine_ops) WHERE project_id = {pid[0]}'
    )
    conn.execute("SELECT memory.partition_by_project()")
    per_partition = conn.execute(
        "SELECT tablename, count(*) FROM pg_indexes WHERE schemaname = 'memory'"
        " AND tablename ~ '^nodes_p[0-9]+$' AND indexdef LIKE '%%USING hnsw%%' GROUP BY 1"
    ).fetchall()
    assert per_partition and all(n == 2 for _, n in per_partition), per_partition


def test_a_new_project_gets_its_partitions_and_rls_still_holds(conn: Conn) -> None:
    conn.execute("SELECT memory.partition_by_project()")
    make_role(conn, "part_writer", "writer")
    conn.execute("SELECT memory.grant_project('part_writer', 'fresh', write => true)")
    conn.execute("SET ROLE part_writer")
    summary = conn.execute(
        "SELECT memory.add_nodes(%s::jsonb)",
        (
            json.dumps(
                [
                    {"project": "fresh", "level": "L0", "id": "t1",
                     "text": "the zeppelin landed at noon"},
                    {"project": "fresh", "level": "L1", "id": "m1",
                     "text": "a zeppelin arrived", "parents": ["t1"]},
                ]
            ),
        ),
    ).fetchone()  # fmt: skip
    assert summary is not None and summary[0]["inserted"] == 2 and summary[0]["edges"] == 1
    # It sees its project only, through the parents; the partitions themselves are closed.
    assert conn.execute("SELECT DISTINCT level FROM memory.nodes ORDER BY 1").fetchall() == [
        ("L0",),
        ("L1",),
    ]
    hits = conn.execute(
        "SELECT node_id FROM memory.lexical_search('zeppelin', 'fresh', NULL, 5)"
    ).fetchall()
    assert len(hits) == 2
    fresh = conn.execute("SELECT id FROM memory.projects WHERE name = 'fresh'").fetchone()
    assert fresh is not None
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(f"SELECT count(*) FROM memory.nodes_p{fresh[0]}")
    conn.execute("RESET ROLE")
    for table in TABLES:
        assert f"{table}_p{fresh[0]}" in _partitions(conn, table)
    # Its vectors stay in the row like the parent's (migration 0010).
    assert _embedding_storage(conn) == {"m"}
    assert conn.execute(
        "SELECT n_docs FROM memory.corpus_stats WHERE project_id = %s", (fresh[0],)
    ).fetchone() == (2,)


def test_0009_refuses_edges_across_projects(
    empty_url: str, plpython_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edge a DBA wrote across projects before 0009 stops the migration with a hint,
    and nothing is applied; removed, the migration goes through and fills edges.project_id."""
    add_migrations = stage_migrations(tmp_path, monkeypatch, below="0009")
    monkeypatch.setattr(layout, "SQL_DIR", tmp_path / "no-sql")
    (tmp_path / "no-sql").mkdir()
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, plpython_root)
        ids = {}
        for project in ("a", "b"):
            conn.execute("INSERT INTO memory.projects (name) VALUES (%s)", (project,))
            row = conn.execute(
                "INSERT INTO memory.nodes (sha256, project_id, level, text)"
                " SELECT sha256(%s::bytea), id, 'L0', 'text' FROM memory.projects WHERE name = %s"
                " RETURNING id",
                (project.encode(), project),
            ).fetchone()
            assert row is not None
            ids[project] = row[0]
        conn.execute(
            "INSERT INTO memory.edges (child_id, parent_id) VALUES (%s, %s)", (ids["a"], ids["b"])
        )
        add_migrations("0009")
        with pytest.raises(Exception, match="provenance edges join nodes of different projects"):
            migrate(conn, plpython_root)
        applied = conn.execute("SELECT max(version) FROM memory.schema_migrations").fetchone()
        assert applied is not None and applied[0] < "0009"
        conn.execute("DELETE FROM memory.edges")
        conn.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, text)"
            " SELECT sha256('a2'::bytea), project_id, 'L1', 'text' FROM memory.nodes WHERE id = %s",
            (ids["a"],),
        )
        conn.execute(
            "INSERT INTO memory.edges (child_id, parent_id)"
            " SELECT max(id), min(id) FROM memory.nodes WHERE project_id = "
            " (SELECT project_id FROM memory.nodes WHERE id = %s)",
            (ids["a"],),
        )
        migrate(conn, plpython_root)
        assert conn.execute(
            "SELECT count(*) FROM memory.edges e JOIN memory.nodes n"
            " ON n.id = e.child_id AND n.project_id = e.project_id"
        ).fetchone() == (1,)


def _partition_cli(url: str, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`poimen-memory migrate --partition-by-project` in a process of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env.update(POIMEN_HOME=str(home), POIMEN_DATABASE_URL=url)
    cmd = [*CLI, "migrate", "--no-plpython", "--partition-by-project", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_migrate_partition_by_project_from_the_cli(fixture_url: str, tmp_path: Path) -> None:
    """The DBA's command: progress on stderr while it runs, a summary per table, and a
    second run that says there is nothing left to do."""
    first = _partition_cli(fixture_url, tmp_path, "--maintenance-work-mem", "256MB")
    assert first.returncode == 0, first.stderr
    assert "notice: partition_by_project: copied" in first.stderr
    summary = [line for line in first.stdout.splitlines() if line.startswith("memory.")]
    assert [line.split(":")[0] for line in summary] == [f"memory.{t}" for t in TABLES]
    assert all(" 2 partitions, " in line and "(before: " in line for line in summary)
    second = _partition_cli(fixture_url, tmp_path)
    assert second.returncode == 0 and "already partitioned" in second.stdout
    with connect(fixture_url) as conn:
        assert conn.execute("SELECT memory.partitioned()").fetchone() == (True,)


def test_a_bad_maintenance_work_mem_is_refused_before_anything_moves(
    fixture_url: str, tmp_path: Path
) -> None:
    bad = _partition_cli(fixture_url, tmp_path, "--maintenance-work-mem", "lots")
    assert bad.returncode != 0 and "maintenance_work_mem" in bad.stderr
    assert "Traceback" not in bad.stderr
    with connect(fixture_url) as conn:
        assert conn.execute("SELECT memory.partitioned()").fetchone() == (False,)


def _to_the_ulp(ranked: dict[str, Any]) -> dict[str, Any]:
    """Rankings with scores to 12 digits: a fused score over every project sums floats in
    the order the rows come back, and a restored heap returns them in another order."""
    return {
        k: [tuple(round(x, 12) if isinstance(x, float) else x for x in row) for row in rows]
        for k, rows in ranked.items()
    }


def _pg_tool(cluster: Cluster, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.bin_dir / tool), "-h", str(cluster.socket_dir), "-p", str(cluster.port),
         "-U", "postgres", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_partitioned_database_survives_dump_and_restore(
    cluster: Cluster,
    admin: Conn,
    conn: Conn,
    fixture_url: str,
    embedder: LocalEmbedder,
    plpython_root: Path,
    tmp_path: Path,
) -> None:
    """The DBA's first question: pg_dump -Fc, pg_restore into a new database, and the copy
    answers the same, keeps partitioning new projects, keeps row-level security and takes
    the next deploy."""
    conn.execute("SELECT memory.partition_by_project()")
    before, ranked = _state(conn), _rankings(conn, embedder)
    dump = tmp_path / "memory.dump"
    dbname = fixture_url.split("?")[0].rsplit("/", 1)[-1]
    dumped = _pg_tool(cluster, "pg_dump", "-Fc", "-f", str(dump), dbname)
    assert dumped.returncode == 0, dumped.stderr
    restored = f"{dbname}_restored"
    admin.execute(f"CREATE DATABASE {restored}")
    try:
        done = _pg_tool(cluster, "pg_restore", "--exit-on-error", "-d", restored, str(dump))
        assert done.returncode == 0, done.stderr
        with connect(cluster.url(restored), autocommit=True) as r:
            assert r.execute("SELECT memory.partitioned()").fetchone() == (True,)
            assert _state(r) == before
            assert _to_the_ulp(_rankings(r, embedder)) == _to_the_ulp(ranked)
            make_role(r, "restored_writer", "writer")
            r.execute("SELECT memory.grant_project('restored_writer', 'fresh', write => true)")
            r.execute("SET ROLE restored_writer")
            summary = r.execute(
                "SELECT memory.add_nodes(%s::jsonb)",
                (json.dumps([{"project": "fresh", "level": "L0", "id": "t1",
                              "text": "the zeppelin landed at noon"}]),),
            ).fetchone()  # fmt: skip
            assert summary is not None and summary[0]["inserted"] == 1
            assert r.execute("SELECT DISTINCT p.name FROM memory.nodes n"
                             " JOIN memory.projects p ON p.id = n.project_id").fetchall() == [
                ("fresh",)
            ]  # fmt: skip
            assert r.execute("SELECT count(*) FROM memory.edges").fetchone() == (0,)
            r.execute("RESET ROLE")
            fresh = r.execute("SELECT id FROM memory.projects WHERE name = 'fresh'").fetchone()
            assert fresh is not None
            for table in TABLES:
                assert f"{table}_p{fresh[0]}" in _partitions(r, table)
            migrate(r, plpython_root)
            assert check(r).clean
            assert _state(r)["count:nodes"] == (before["count:nodes"][0] + 1,)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {restored} WITH (FORCE)")


def _wait_for(conn: Conn, sql: str, want: Any, tries: int = 600) -> None:
    """Poll (bounded) until the statement answers want: another session reached a lock."""
    for _ in range(tries):
        if conn.execute(sql).fetchone() == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{sql} never answered {want}")


def _attempt(url: str, outcome: dict[str, str], name: str, work: Callable[[Conn], Any]) -> None:
    """Run work on a connection of its own (a thread's), waiting at most 60 s for any lock;
    record "ok" or the SQLSTATE it failed with (40P01 for a deadlock)."""
    with connect(url, autocommit=True) as c:
        c.execute("SET lock_timeout = '60s'")
        try:
            work(c)
            outcome[name] = "ok"
        except psycopg.Error as exc:
            outcome[name] = str(exc.sqlstate)


def test_two_writers_creating_projects_at_once_both_succeed(conn: Conn, fixture_url: str) -> None:
    """A new project's partitions take ACCESS EXCLUSIVE on the parents. memory.add_nodes
    must create its projects before it reads memory.nodes: two writers holding ACCESS SHARE
    there from their reads, each then wanting ACCESS EXCLUSIVE, deadlock."""
    conn.execute("SELECT memory.partition_by_project()")
    outcome: dict[str, str] = {}

    def add(project: str) -> None:
        def work(c: Conn) -> None:
            c.execute(
                "SELECT memory.add_nodes(%s::jsonb)",
                (json.dumps([{"project": project, "level": "L0", "id": "t1",
                              "text": f"the {project} zeppelin landed"}]),),
            )  # fmt: skip

        _attempt(fixture_url, outcome, project, work)

    # The gate lets reads through but holds back INSERTs into memory.projects, so both
    # writers get as far as they can before either creates its project.
    with connect(fixture_url) as gate:
        gate.execute("LOCK TABLE memory.projects IN SHARE MODE")
        writers = [threading.Thread(target=add, args=(p,)) for p in ("alpha", "beta")]
        for w in writers:
            w.start()
        _wait_for(
            conn,
            "SELECT count(*) FROM pg_locks WHERE NOT granted"
            " AND relation = 'memory.projects'::regclass",
            (2,),
        )
        gate.commit()
    for w in writers:
        w.join(timeout=180)
    assert outcome == {"alpha": "ok", "beta": "ok"}
    for project in ("alpha", "beta"):
        pid = conn.execute("SELECT id FROM memory.projects WHERE name = %s", (project,)).fetchone()
        assert pid is not None and f"nodes_p{pid[0]}" in _partitions(conn, "nodes")


def test_two_projects_created_behind_a_long_reader_both_go_through(
    conn: Conn, fixture_url: str
) -> None:
    """Two transactions each insert a project (as ingest does) while a long reader (a
    report, pg_dump) holds memory.nodes: both hold ROW EXCLUSIVE on memory.projects and
    wait in the trigger for the reader. When it ends, they must go through one after the
    other: the partitions' DDL must not need a lock on memory.projects that conflicts."""
    conn.execute("SELECT memory.partition_by_project()")
    outcome: dict[str, str] = {}

    def create(project: str) -> None:
        def work(c: Conn) -> None:
            with c.transaction():
                c.execute("INSERT INTO memory.projects (name) VALUES (%s)", (project,))

        _attempt(fixture_url, outcome, project, work)

    with connect(fixture_url) as reader:
        reader.execute("SELECT count(*) FROM memory.nodes")
        creators = [threading.Thread(target=create, args=(p,)) for p in ("gamma", "delta")]
        for waiting, c in enumerate(creators, start=1):
            c.start()
            _wait_for(
                conn,
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND relation = 'memory.nodes'::regclass",
                (waiting,),
            )
        reader.commit()
    for c in creators:
        c.join(timeout=180)
    assert outcome == {"gamma": "ok", "delta": "ok"}


def test_deleting_a_project_deletes_its_rows_on_the_partitioned_layout(conn: Conn) -> None:
    """The cascade nodes' foreign key to memory.projects did, done by a trigger there: the
    tables end up as a delete on the unpartitioned layout leaves them."""
    pid = conn.execute("SELECT id FROM memory.projects WHERE name = 'atlas'").fetchone()
    assert pid is not None
    assert conn.execute(
        "SELECT count(*) FROM memory.nodes WHERE project_id = %s", pid
    ).fetchone() != (0,)
    with conn.transaction(force_rollback=True):
        conn.execute("DELETE FROM memory.projects WHERE id = %s", pid)
        unpartitioned = _state(conn)
    conn.execute("SELECT memory.partition_by_project()")
    conn.execute("DELETE FROM memory.projects WHERE id = %s", pid)
    assert _state(conn) == unpartitioned
    assert conn.execute(
        "SELECT count(*) FROM memory.nodes WHERE project_id = %s", pid
    ).fetchone() == (0,)


def test_a_partition_read_directly_shows_no_row(conn: Conn) -> None:
    """A DBA's default privileges grant every new table of the schema, partitions
    included; RLS applies through the parent only, so a partition must refuse rows itself:
    those made by the move and those a new project gets."""
    conn.execute(
        "ALTER DEFAULT PRIVILEGES IN SCHEMA memory GRANT SELECT ON TABLES TO poimen_memory_reader"
    )
    conn.execute("SELECT memory.partition_by_project()")
    conn.execute("INSERT INTO memory.projects (name) VALUES ('fresh')")
    conn.execute(
        "INSERT INTO memory.nodes (sha256, project_id, level, text)"
        " SELECT sha256('late'::bytea), id, 'L0', 'a late node' FROM memory.projects"
        " WHERE name = 'fresh'"
    )
    make_role(conn, "part_reader", "reader")
    conn.execute("SELECT memory.grant_project('part_reader', 'poimen')")
    hidden = [
        f"memory.{t}_p{pid}"
        for (pid,) in conn.execute("SELECT id FROM memory.projects WHERE name <> 'poimen'")
        for t in TABLES
    ]
    conn.execute("SET ROLE part_reader")
    try:
        for name in hidden:
            assert conn.execute(f"SELECT count(*) FROM {name}").fetchone() == (0,), name
        assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() != (0,)
    finally:
        conn.execute("RESET ROLE")


def test_partition_by_project_keeps_a_disabled_trigger_disabled(conn: Conn) -> None:
    conn.execute("ALTER TABLE memory.nodes DISABLE TRIGGER nodes_outbox_insert")
    conn.execute("ALTER TABLE memory.nodes ENABLE REPLICA TRIGGER nodes_outbox_update")
    conn.execute("SELECT memory.partition_by_project()")
    assert conn.execute(
        "SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = 'memory.nodes'::regclass"
        " AND tgname IN ('nodes_outbox_insert', 'nodes_outbox_update') ORDER BY 1"
    ).fetchall() == [("nodes_outbox_insert", "D"), ("nodes_outbox_update", "R")]


@pytest.mark.parametrize("partitioned", [False, True])
def test_ingesting_the_same_file_again_adds_nothing(
    conn: Conn, embedder: LocalEmbedder, partitioned: bool
) -> None:
    """Duplicates are found by (sha256, project_id) since 0009, on both layouts."""
    if partitioned:
        conn.execute("SELECT memory.partition_by_project()")
    before = _state(conn)
    records, errors = parse_lines(FIXTURE.read_text().splitlines())
    assert not errors
    report = ingest(conn, records, embedder, progress=False)
    assert (report.inserted, report.duplicates) == (0, len(records))
    assert _state(conn) == before


def test_a_new_embedding_model_rebuilds_every_partitions_graphs(conn: Conn) -> None:
    """`poimen-memory reembed` (memory.reset_embedding) retypes the column and rebuilds the
    HNSW indexes through the parent: every partition gets both graphs again."""
    conn.execute("SELECT memory.partition_by_project()")
    conn.execute("SELECT memory.reset_embedding('another-model', 8)")
    assert conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = 'memory.nodes'::regclass AND attname = 'embedding'"
    ).fetchone() == ("vector(8)",)
    graphs = conn.execute(
        "SELECT c.relname, count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_index x ON x.indrelid = c.oid JOIN pg_class ic ON ic.oid = x.indexrelid"
        " JOIN pg_am a ON a.oid = ic.relam"
        " WHERE i.inhparent = 'memory.nodes'::regclass AND a.amname = 'hnsw' GROUP BY 1"
    ).fetchall()
    partitions = _partitions(conn, "nodes")
    assert {name for name, _ in graphs} == partitions and {n for _, n in graphs} == {2}
    assert _embedding_storage(conn) == {"m"}  # retyped, and back in the row
    assert conn.execute(
        "SELECT count(*) FROM memory.nodes WHERE embedding IS NOT NULL"
    ).fetchone() == (0,)
