"""`migrate --check` sees what protects the data, and `migrate` restores it (issue 26).

Each tampering below is what a DBA did, as the owner, on a migrated database: --check said
"no drift" and migrate left it in place. Now each is a finding (exit 1) and migrate repairs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import db_roles, make_role
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import check, migrate

Conn = psycopg.Connection[Any]

# (tampering, the finding --check prints, a query whose answer shows the repair)
TAMPERING = {
    "rls_off": (
        "ALTER TABLE memory.nodes DISABLE ROW LEVEL SECURITY",
        "row-level security changed by hand: memory.nodes: disabled (migrate makes it: enabled)",
        "SELECT relrowsecurity FROM pg_class WHERE oid = 'memory.nodes'::regclass",
        True,
    ),
    "extra_policy": (
        "CREATE POLICY dba_open ON memory.edges FOR SELECT USING (true)",
        "policy not from sql/ (migrate removes it): dba_open on memory.edges",
        "SELECT count(*) FROM pg_policies WHERE policyname = 'dba_open'",
        0,
    ),
    "altered_policy": (
        "ALTER POLICY granted_read ON memory.nodes USING (true)",
        "policy changed by hand: granted_read on memory.nodes",
        "SELECT qual <> 'true' FROM pg_policies WHERE policyname = 'granted_read'"
        " AND tablename = 'nodes'",
        True,
    ),
    "dropped_policy": (
        "DROP POLICY granted_read ON memory.projects",
        "policy missing (migrate restores it): granted_read on memory.projects",
        "SELECT count(*) FROM pg_policies WHERE policyname = 'granted_read'"
        " AND tablename = 'projects'",
        1,
    ),
    "config_grant": (
        "GRANT INSERT, UPDATE ON memory.config TO poimen_memory_writer",
        "grant not from sql/ (migrate removes it): INSERT ON TABLE memory.config"
        " TO poimen_memory_writer",
        "SELECT has_table_privilege('poimen_memory_writer', 'memory.config', 'INSERT')"
        " OR has_table_privilege('poimen_memory_writer', 'memory.config', 'UPDATE')",
        False,
    ),
    "function_grant": (
        "GRANT EXECUTE ON FUNCTION memory.reset_policy(text) TO poimen_memory_reader",
        "grant not from sql/ (migrate removes it): EXECUTE ON FUNCTION "
        "memory.reset_policy(text) TO poimen_memory_reader",
        "SELECT has_function_privilege('poimen_memory_reader', 'memory.reset_policy(text)',"
        " 'EXECUTE')",
        False,
    ),
    "dropped_index": (
        "DROP INDEX memory.nodes_embedding_hnsw_l1_l2",
        "index missing (migrate restores it): memory.nodes_embedding_hnsw_l1_l2",
        "SELECT to_regclass('memory.nodes_embedding_hnsw_l1_l2') IS NOT NULL",
        True,
    ),
    "altered_index": (
        "DROP INDEX memory.nodes_tsv_gin; CREATE INDEX nodes_tsv_gin ON memory.nodes (project_id)",
        "index changed by hand: memory.nodes_tsv_gin",
        "SELECT pg_get_indexdef('memory.nodes_tsv_gin'::regclass) LIKE '%USING gin (tsv)'",
        True,
    ),
    "disabled_trigger": (
        "ALTER TABLE memory.nodes DISABLE TRIGGER nodes_lexical_row",
        "trigger changed by hand: nodes_lexical_row on memory.nodes",
        "SELECT tgenabled FROM pg_trigger WHERE tgname = 'nodes_lexical_row'",
        "O",
    ),
    "plpython_path": (
        "UPDATE memory.config SET value = '/nonexistent' WHERE key = 'plpython_path'",
        "config changed by hand: memory.config plpython_path: /nonexistent",
        "SELECT value <> '/nonexistent' FROM memory.config WHERE key = 'plpython_path'",
        True,
    ),
    "plpython_checksum": (
        "UPDATE memory.config SET value = 'feed' WHERE key = 'plpython_checksum'",
        "config changed by hand: memory.config plpython_checksum: feed",
        "SELECT value <> 'feed' FROM memory.config WHERE key = 'plpython_checksum'",
        True,
    ),
    "default_privilege": (
        "ALTER DEFAULT PRIVILEGES IN SCHEMA memory GRANT SELECT ON TABLES TO poimen_memory_reader",
        "default privilege not from sql/ (migrate removes it): SELECT on the tables postgres "
        "creates in schema memory: poimen_memory_reader",
        "SELECT count(*) FROM pg_default_acl WHERE defaclnamespace = 'memory'::regnamespace",
        0,
    ),
}


def _one(conn: Conn, query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _reader_counts(conn: Conn) -> tuple[int, int]:
    """Nodes and edges a member of poimen_memory_reader with no project granted sees."""
    make_role(conn, "drift_reader", "reader")
    conn.execute("SELECT memory.revoke_project('drift_reader', '*')")
    conn.execute("SET ROLE drift_reader")
    try:
        nodes = _one(conn, "SELECT count(*) FROM memory.nodes")
        edges = _one(conn, "SELECT count(*) FROM memory.edges")
    finally:
        conn.execute("RESET ROLE")
    return int(nodes), int(edges)


@pytest.mark.parametrize("name", sorted(TAMPERING))
def test_each_tampering_is_reported_then_repaired(
    conn: Conn, plpython_root: Path, name: str
) -> None:
    tamper, finding, probe, repaired = TAMPERING[name]
    assert check(conn, plpython_root=plpython_root).clean
    conn.execute(tamper)
    drift = check(conn, plpython_root=plpython_root)
    assert not drift.clean
    assert any(f.startswith(finding) for f in drift.findings), drift.findings
    # Only the protection changed: no function is reported as edited by hand.
    assert drift.changed == [] and drift.missing == []
    # --check changed nothing.
    assert check(conn, plpython_root=plpython_root).findings == drift.findings
    migrate(conn, plpython_root)
    assert _one(conn, probe) == repaired
    after = check(conn, plpython_root=plpython_root)
    assert after.clean, after.findings
    assert _reader_counts(conn) == (0, 0)


def test_the_issues_attacks_through_the_cli(
    fixture_url: str, conn: Conn, plpython_root: Path
) -> None:
    """The five tamperings of issue 26 at once: `migrate --check` names each and exits 1,
    `migrate` repairs all of them, and a reader with no grant then sees nothing again."""
    env = dict(os.environ, POIMEN_DATABASE_URL=fixture_url)
    # The fixture's server reads this host's files: the directory is asked for explicitly.
    cli = [sys.executable, "-m", "poimen_memory.cli.main", "migrate"]
    cli += ["--plpython-dir", str(plpython_root)]
    names = ("rls_off", "extra_policy", "config_grant", "dropped_index", "plpython_path")
    for name in names:
        conn.execute(TAMPERING[name][0])
    # The attack worked: RLS off and an open policy show every project's rows.
    nodes, edges = _reader_counts(conn)
    assert nodes > 0 and edges > 0
    out = subprocess.run([*cli, "--check"], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    for name in names:
        assert TAMPERING[name][1] in out.stdout, (name, out.stdout)
    assert "no drift" not in out.stdout
    fix = subprocess.run(cli, env=env, capture_output=True, text=True, check=False)
    assert fix.returncode == 0, fix.stdout + fix.stderr
    for name in names:
        _tamper, _finding, probe, repaired = TAMPERING[name]
        assert _one(conn, probe) == repaired, name
    ok = subprocess.run([*cli, "--check"], env=env, capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "no drift" in ok.stdout, ok.stdout + ok.stderr
    assert _reader_counts(conn) == (0, 0)


def test_check_without_the_plpython_root_still_sees_a_foreign_path(conn: Conn) -> None:
    """A remote database (`--check --no-plpython` does not know the install root): the
    recorded path must still be a copy of this code's module."""
    assert check(conn).clean
    conn.execute("UPDATE memory.config SET value = '/nonexistent' WHERE key = 'plpython_path'")
    drift = check(conn)
    assert any("plpython_path: /nonexistent" in f for f in drift.findings), drift.findings


def test_a_restored_database_is_no_drift(
    cluster: Cluster, admin: Conn, fixture_url: str, plpython_root: Path
) -> None:
    """pg_dump | pg_restore (grants replayed by the restoring superuser, in its order):
    --check compares bodies and who may run them apart, so nothing is 'changed by hand'."""
    src = fixture_url.split("?")[0].rsplit("/", 1)[-1]
    target = "t_drift_restored"
    admin.execute(f"DROP DATABASE IF EXISTS {target} WITH (FORCE)")
    admin.execute(f"CREATE DATABASE {target}")
    base = ["-h", str(cluster.socket_dir), "-p", str(cluster.port), "-U", "postgres"]
    try:
        dump = subprocess.run(
            [str(cluster.bin_dir / "pg_dump"), "-Fc", *base, src],
            capture_output=True,
            check=True,
        )
        subprocess.run(
            [str(cluster.bin_dir / "pg_restore"), *base, "-d", target],
            input=dump.stdout,
            capture_output=True,
            check=True,
        )
        with connect(cluster.url(target), autocommit=True) as conn:
            # A restore elsewhere replays the grants in another order: here the owner's own
            # entry moves behind the others in every function's ACL (same privileges).
            conn.execute(
                """DO $$ DECLARE f regprocedure; BEGIN
                       FOR f IN SELECT p.oid FROM pg_proc p
                                WHERE p.pronamespace = 'memory'::regnamespace LOOP
                           EXECUTE format('REVOKE ALL ON FUNCTION %s FROM postgres', f);
                           EXECUTE format('GRANT ALL ON FUNCTION %s TO postgres', f);
                       END LOOP;
                   END $$"""
            )
            drift = check(conn, plpython_root=plpython_root)
            # The privileges on the database itself are not in a dump without --create: a
            # restore into a database made by hand lets PUBLIC connect until migrate.
            assert not drift.changed and not drift.missing, drift
            assert drift.findings == [
                f"grant not from sql/ (migrate removes it): CONNECT ON DATABASE {target}"
                " TO PUBLIC: granted",
                f"grant missing (migrate restores it): CONNECT ON DATABASE {target}"
                " TO poimen_memory_reader: granted",
            ], drift.findings
            migrate(conn, plpython_root)
            assert check(conn, plpython_root=plpython_root).clean
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {target} WITH (FORCE)")


def test_a_function_the_owner_adds_later_is_not_public(conn: Conn) -> None:
    """The default privilege in the form that works (FOR ROLE the owner, not IN SCHEMA): a
    SECURITY DEFINER function the owner adds after migrate is the owner's alone."""
    conn.execute(
        "CREATE FUNCTION memory.dba_node_count() RETURNS bigint LANGUAGE sql"
        " SECURITY DEFINER SET search_path = pg_catalog, pg_temp"
        " AS 'SELECT count(*) FROM memory.nodes'"
    )
    assert _one(conn, "SELECT memory.dba_node_count()") > 0
    make_role(conn, "late_reader", "reader")
    conn.execute("ALTER ROLE late_reader LOGIN")
    for role in ("public", *db_roles(conn).all, "late_reader"):
        assert not _one(
            conn, f"SELECT has_function_privilege('{role}', 'memory.dba_node_count()', 'EXECUTE')"
        ), role
    conn.execute("SET ROLE late_reader")
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT memory.dba_node_count()")
    finally:
        conn.execute("RESET ROLE")
    # And --check leaves the DBA's function (and its grants) alone: no finding about it.
    drift = check(conn)
    assert drift.extra == ["memory.dba_node_count()"] and drift.findings == []
