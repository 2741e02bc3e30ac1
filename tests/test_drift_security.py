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
from poimen_memory.errors import MigrationError

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
    # FORCE off, held (sql/085_tenants.sql): the owner's SECURITY DEFINER functions act on
    # every project's rows.
    "force_rls": (
        "ALTER TABLE memory.nodes FORCE ROW LEVEL SECURITY",
        "row-level security changed by hand: memory.nodes: enabled, forced (migrate makes it:"
        " enabled)",
        "SELECT relforcerowsecurity FROM pg_class WHERE oid = 'memory.nodes'::regclass",
        False,
    ),
    # Its owner reads the API keys around row-level security and may alter the table.
    "owner": (
        "DO $$ BEGIN IF to_regrole('drift_other_owner') IS NULL THEN"
        " CREATE ROLE drift_other_owner; END IF; END $$;"
        " ALTER TABLE memory.api_keys OWNER TO drift_other_owner",
        "owner changed by hand: TABLE memory.api_keys: drift_other_owner (migrate makes it:"
        " postgres, the owner of schema memory)",
        "SELECT relowner::regrole::text FROM pg_class WHERE oid = 'memory.api_keys'::regclass",
        "postgres",
    ),
    "function_owner": (
        "DO $$ BEGIN IF to_regrole('drift_other_owner') IS NULL THEN"
        " CREATE ROLE drift_other_owner; END IF; END $$;"
        " ALTER FUNCTION memory.set_policy(text, text) OWNER TO drift_other_owner",
        "owner changed by hand: FUNCTION memory.set_policy(text,text): drift_other_owner",
        "SELECT proowner::regrole::text FROM pg_proc"
        " WHERE oid = 'memory.set_policy(text, text)'::regprocedure",
        "postgres",
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


# -- around row-level security, by objects the product did not make (issue 44) ----------

ALL_NODES = (
    "CREATE VIEW memory.all_nodes AS SELECT id, project_id, text FROM memory.nodes;"
    " GRANT SELECT ON memory.all_nodes TO poimen_memory_reader"
)
VIEW_FINDING = (
    "not from the product, usable by poimen_memory_reader (migrate leaves it to a person:"
    " drop it or revoke): VIEW memory.all_nodes owned by postgres: reads memory.nodes"
    " (row-level security) as its owner, around row-level security"
)
PEEK_FINDING = (
    "not from the product, usable by PUBLIC (migrate leaves it to a person: drop it or"
    " revoke): FUNCTION memory.drift_peek() owned by drift_admin: SECURITY DEFINER: runs as"
    " its owner, around row-level security"
)


def _as_reader(conn: Conn, query: str) -> Any:
    """What a member of the reader role granted no project gets from query."""
    make_role(conn, "drift_reader", "reader")
    conn.execute("SELECT memory.revoke_project('drift_reader', '*')")
    conn.execute("SET ROLE drift_reader")
    try:
        return _one(conn, query)
    finally:
        conn.execute("RESET ROLE")


def _foreign_peek(conn: Conn) -> None:
    """Another administrator's SECURITY DEFINER function in the schema: it may read every
    row (BYPASSRLS), and, made without the product's default privileges, PUBLIC may run it."""
    conn.execute(
        "DO $$ BEGIN IF to_regrole('drift_admin') IS NULL THEN"
        " CREATE ROLE drift_admin NOLOGIN BYPASSRLS; END IF; END $$"
    )
    conn.execute("GRANT USAGE, CREATE ON SCHEMA memory TO drift_admin")
    conn.execute("GRANT SELECT ON memory.nodes TO drift_admin")
    conn.execute("SET ROLE drift_admin")
    try:
        conn.execute(
            "CREATE FUNCTION memory.drift_peek() RETURNS bigint LANGUAGE sql SECURITY DEFINER"
            " SET search_path = pg_catalog, pg_temp AS 'SELECT count(*) FROM memory.nodes'"
        )
    finally:
        conn.execute("RESET ROLE")


def _forget_peek(conn: Conn) -> None:
    conn.execute("DROP FUNCTION memory.drift_peek()")
    conn.execute("REVOKE ALL ON SCHEMA memory FROM drift_admin")
    conn.execute("REVOKE ALL ON memory.nodes FROM drift_admin")


def test_a_view_around_row_level_security_is_named_first_and_left_to_a_person(
    conn: Conn, plpython_root: Path
) -> None:
    conn.execute(ALL_NODES)
    # And a table of the DBA's that PUBLIC may read: usable, but reading no protected row.
    conn.execute(
        "CREATE TABLE memory.dba_notes (note text); GRANT SELECT ON memory.dba_notes TO PUBLIC"
    )
    # The attack works: a reader granted no project reads every project's nodes.
    assert _as_reader(conn, "SELECT count(*) FROM memory.nodes") == 0
    assert _as_reader(conn, "SELECT count(*) FROM memory.all_nodes") > 0
    drift = check(conn, plpython_root=plpython_root)
    assert not drift.clean
    assert drift.findings[0] == VIEW_FINDING, drift.findings
    assert (
        "not from the product, usable by PUBLIC (migrate leaves it to a person: drop it or"
        " revoke): TABLE memory.dba_notes owned by postgres"
    ) in drift.findings[1:]
    # migrate changes neither (they are the DBA's), and says so.
    report = migrate(conn, plpython_root)
    assert VIEW_FINDING in report.warnings, report.warnings
    assert _as_reader(conn, "SELECT count(*) FROM memory.all_nodes") > 0
    assert check(conn, plpython_root=plpython_root).findings[0] == VIEW_FINDING
    # A person drops them: no drift.
    conn.execute("DROP VIEW memory.all_nodes; DROP TABLE memory.dba_notes")
    assert check(conn, plpython_root=plpython_root).clean


def test_a_view_that_runs_as_its_caller_is_named_but_not_as_a_way_around(conn: Conn) -> None:
    conn.execute(
        "CREATE VIEW memory.my_nodes WITH (security_invoker = true) AS SELECT id FROM"
        " memory.nodes; GRANT SELECT ON memory.my_nodes TO poimen_memory_reader"
    )
    assert _as_reader(conn, "SELECT count(*) FROM memory.my_nodes") == 0
    found = [f for f in check(conn).findings if "memory.my_nodes" in f]
    assert found == [
        "not from the product, usable by poimen_memory_reader (migrate leaves it to a person:"
        " drop it or revoke): VIEW memory.my_nodes owned by postgres"
    ], found
    conn.execute("DROP VIEW memory.my_nodes")


def test_another_admins_security_definer_function_is_named(conn: Conn, plpython_root: Path) -> None:
    _foreign_peek(conn)
    try:
        assert _as_reader(conn, "SELECT memory.drift_peek()") > 0  # every project's nodes
        drift = check(conn, plpython_root=plpython_root)
        assert drift.findings[0] == PEEK_FINDING, drift.findings
        assert drift.extra == ["memory.drift_peek()"]
        report = migrate(conn, plpython_root)
        assert PEEK_FINDING in report.warnings
        assert check(conn, plpython_root=plpython_root).findings == [PEEK_FINDING]
    finally:
        _forget_peek(conn)
    assert check(conn, plpython_root=plpython_root).clean


def test_a_database_ahead_of_the_code(conn: Conn, plpython_root: Path) -> None:
    conn.execute(
        "INSERT INTO memory.schema_migrations (version, checksum)"
        " VALUES ('9999_from_a_newer_release', 'feed')"
    )
    drift = check(conn, plpython_root=plpython_root)
    assert not drift.clean
    assert drift.findings == [
        "migration in the database this code does not know (migrate refuses it: deploy a"
        " newer poimen-memory; migrations are forward-only): 9999_from_a_newer_release"
    ]
    with pytest.raises(MigrationError, match="migrations this code does not know"):
        migrate(conn, plpython_root)
    conn.execute("DELETE FROM memory.schema_migrations WHERE version = '9999_from_a_newer_release'")
    assert check(conn, plpython_root=plpython_root).clean


def test_issue_44s_findings_through_the_cli(
    fixture_url: str, conn: Conn, plpython_root: Path
) -> None:
    """Each way around row-level security of issue 44: `migrate --check` exits 1 naming it;
    migrate repairs the product's (the owner, FORCE) and names what it leaves (the view,
    the function); a database ahead of the code is a finding, and migrate refuses it."""
    env = dict(os.environ, POIMEN_DATABASE_URL=fixture_url)
    cli = [sys.executable, "-m", "poimen_memory.cli.main", "migrate"]
    cli += ["--plpython-dir", str(plpython_root)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, check=False)

    conn.execute(ALL_NODES)
    _foreign_peek(conn)
    for name in ("owner", "force_rls"):
        conn.execute(TAMPERING[name][0])
    try:
        out = run("--check")
        assert out.returncode == 1, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        # The two ways around row-level security come first.
        assert lines[:2] == [PEEK_FINDING, VIEW_FINDING], lines
        for name in ("owner", "force_rls"):
            assert TAMPERING[name][1] in out.stdout, (name, out.stdout)
        fix = run()
        assert fix.returncode == 0, fix.stdout + fix.stderr
        for name in ("owner", "force_rls"):
            assert _one(conn, TAMPERING[name][2]) == TAMPERING[name][3], name
        assert f"warning: {VIEW_FINDING}" in fix.stderr and f"warning: {PEEK_FINDING}" in fix.stderr
        left = run("--check")
        assert left.returncode == 1
        assert left.stdout.splitlines() == [
            PEEK_FINDING,
            VIEW_FINDING,
            "not from sql/ (left alone): memory.drift_peek()",
            "drift found: run `poimen-memory migrate` to re-apply sql/",
        ], left.stdout
    finally:
        conn.execute("DROP VIEW IF EXISTS memory.all_nodes")
        _forget_peek(conn)
    ok = run("--check")
    assert ok.returncode == 0 and "no drift" in ok.stdout, ok.stdout + ok.stderr

    conn.execute(
        "INSERT INTO memory.schema_migrations (version, checksum) VALUES ('9999_newer', 'feed')"
    )
    ahead = run("--check")
    assert (
        ahead.returncode == 1 and "does not know" in ahead.stdout and "9999_newer" in ahead.stdout
    )
    refused = run()
    assert refused.returncode != 0 and "9999_newer" in refused.stderr, refused.stderr
