"""Migrations apply once, re-apply as a no-op, refuse edited files, and match a fresh install."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import make_role, stage_migrations
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import layout, migrate
from poimen_memory.errors import MigrationError

ALL_VERSIONS = sorted(p.stem for p in layout.MIGRATIONS_DIR.glob("*.sql"))


def _schema_dump(cluster: Cluster, url: str) -> str:
    dbname = url.split("?")[0].rsplit("/", 1)[-1]
    out = subprocess.run(
        [
            str(cluster.bin_dir / "pg_dump"),
            "--schema-only",
            "--no-owner",
            "-h",
            str(cluster.socket_dir),
            "-p",
            str(cluster.port),
            "-U",
            "postgres",
            dbname,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return "\n".join(
        line
        for line in out.stdout.splitlines()
        if not line.startswith(("--", "\\restrict", "\\unrestrict"))
    )


def test_migrate_twice_is_noop(cluster: Cluster, empty_url: str, plpython_root: Path) -> None:
    with connect(empty_url, autocommit=True) as conn:
        first = migrate(conn, plpython_root)
        assert first.applied == ALL_VERSIONS
        before = _schema_dump(cluster, empty_url)
        second = migrate(conn, plpython_root)
        assert second.applied == [] and second.already == ALL_VERSIONS
        assert _schema_dump(cluster, empty_url) == before


def test_sql_reapply_changes_nothing_and_keeps_data(
    cluster: Cluster, fixture_url: str, plpython_root: Path
) -> None:
    with connect(fixture_url, autocommit=True) as conn:
        before_rows = conn.execute("SELECT count(*) FROM memory.nodes").fetchone()
        before = _schema_dump(cluster, fixture_url)
        migrate(conn, plpython_root)
        assert _schema_dump(cluster, fixture_url) == before
        assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() == before_rows


def test_edited_migration_is_refused(
    empty_url: str, plpython_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, plpython_root)
        edited = tmp_path / "migrations"
        edited.mkdir()
        src = layout.MIGRATIONS_DIR / "0001_initial.sql"
        (edited / src.name).write_text(src.read_text() + "\n-- edited\n")
        monkeypatch.setattr(layout, "MIGRATIONS_DIR", edited)
        with pytest.raises(MigrationError, match="edited after it was applied"):
            migrate(conn, plpython_root)


def test_failed_migration_rolls_back_everything(
    empty_url: str, plpython_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    migs = tmp_path / "migrations"
    migs.mkdir()
    src = layout.MIGRATIONS_DIR / "0001_initial.sql"
    (migs / src.name).write_text(src.read_text())
    (migs / "0002_broken.sql").write_text("CREATE TABLE memory.broken (x int); SELECT 1/0;")
    monkeypatch.setattr(layout, "MIGRATIONS_DIR", migs)
    with connect(empty_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            migrate(conn, plpython_root)
        assert conn.execute("SELECT to_regclass('memory.nodes')").fetchone() == (None,)


def test_incremental_equals_fresh_install(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    empty_url: str,
    plpython_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Applying migrations one deploy at a time builds the same schema as all at once."""
    all_migs = sorted(layout.MIGRATIONS_DIR.glob("*.sql"))
    staged = tmp_path / "staged"
    staged.mkdir()
    monkeypatch.setattr(layout, "MIGRATIONS_DIR", staged)
    with connect(empty_url, autocommit=True) as conn:
        for m in all_migs:
            (staged / m.name).write_text(m.read_text())
            # One prefix for both databases: their dumps name the same roles.
            migrate(conn, plpython_root, role_prefix="incremental")
    monkeypatch.undo()
    other = "t_fresh_install"
    admin.execute(f"DROP DATABASE IF EXISTS {other}")
    admin.execute(f"CREATE DATABASE {other}")
    try:
        with connect(cluster.url(other), autocommit=True) as conn:
            migrate(conn, plpython_root, role_prefix="incremental")
        assert _schema_dump(cluster, cluster.url(other)) == _schema_dump(cluster, empty_url)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {other} WITH (FORCE)")


def test_0008_names_the_roles_it_leaves_without_a_project(
    admin: psycopg.Connection[Any],
    empty_url: str,
    plpython_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Row-level security silently empties the results of existing SQL users: the migration
    that turns it on names them (a NOTICE that migrate reports), and only them."""
    add_migrations = stage_migrations(tmp_path, monkeypatch, below="0008")
    with connect(empty_url, autocommit=True) as conn:
        first = migrate(conn, plpython_root)  # before 0008: sql/ makes the group roles
        assert "0008_project_grants" not in first.applied and first.notices == []
        # 0008 ran on databases whose roles were the cluster-wide memory_reader trio
        # (before roles were per database): its notice names their members.
        make_role(admin, "memory_reader")
        make_role(admin, "memory_service")
        # Roles are cluster-wide: created once per session, like tests/test_tenants.py's.
        for role, group in (
            ("legacy_reader", "memory_reader"),
            ("legacy_service", "memory_service"),
        ):
            exists = admin.execute("SELECT to_regrole(%s) IS NOT NULL", (role,)).fetchone()
            if exists == (False,):
                admin.execute(f"CREATE ROLE {role}")
            admin.execute(f"GRANT {group} TO {role}")
        add_migrations("0008")  # 0008 and what sql/ needs after it
        report = migrate(conn, plpython_root)
        again = migrate(conn, plpython_root)
    assert "0008_project_grants" in report.applied
    (notice,) = report.notices
    names = notice.splitlines()[0].rpartition(": ")[2].split(", ")
    assert notice.startswith("0008_project_grants.sql: row-level security is on")
    assert "legacy_reader" in names and "hint: For each: SELECT memory.grant_project" in notice
    assert not {"legacy_service", "memory_writer", "memory_service", "postgres"} & set(names)
    assert again.notices == []  # applied once: said once


def test_0020_gives_every_id_less_node_an_id(
    empty_url: str, plpython_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes stored without an id (before 0020) get one, every version, distinct, usable
    by memory.get_node; their content hashes and BM25 statistics stay as they were."""
    add_migrations = stage_migrations(tmp_path, monkeypatch, below="0020")
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, plpython_root)
        conn.execute("INSERT INTO memory.projects (name) VALUES ('old')")
        # As the writer stored them before 0020: external_id NULL (one retired since).
        conn.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, text, expired_at, end_reason)"
            " SELECT sha256(convert_to(t, 'UTF8')), p.id, 'L0', t, e, r"
            " FROM memory.projects p, (VALUES ('an old note', NULL::timestamptz, NULL::text),"
            "   ('another old note', now(), 'retired')) v(t, e, r) WHERE p.name = 'old'"
        )
        stats = (
            "SELECT (SELECT count(*) FROM memory.postings), (SELECT sum(df) FROM memory.term_stats)"
        )
        hashes = "SELECT array_agg(sha256 ORDER BY id) FROM memory.nodes"
        before = (conn.execute(stats).fetchone(), conn.execute(hashes).fetchone())
        add_migrations("0020")
        report = migrate(conn, plpython_root)
        assert "0020_generated_ids" in report.applied
        ids = [r[0] for r in conn.execute("SELECT external_id FROM memory.nodes ORDER BY id")]
        assert len(ids) == 2 and len(set(ids)) == 2
        assert all(i.startswith("n:") for i in ids)
        assert (conn.execute(stats).fetchone(), conn.execute(hashes).fetchone()) == before
        got = conn.execute("SELECT text FROM memory.get_node(%s, 'old')", (ids[0],)).fetchone()
        assert got == ("an old note",)


def test_0028_drops_the_jsonb_signature_of_after_fusion(
    empty_url: str, plpython_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database from before 0028 holds memory._after_fusion(jsonb, jsonb, vector); 0028
    drops it (sql/ makes the memory.fused_row[] one), so no stale overload is left."""
    add_migrations = stage_migrations(tmp_path, monkeypatch, below="0028")
    signature = "memory._after_fusion(jsonb, jsonb, vector)"
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, plpython_root)
        # the old signature, as sql/ made it before 0028 (its body does not matter here)
        conn.execute(
            "CREATE FUNCTION memory._after_fusion(candidates jsonb, plan jsonb, q vector,"
            " OUT fused jsonb, OUT withheld integer, OUT held bigint[])"
            " LANGUAGE sql AS 'SELECT candidates, 0, ''{}''::bigint[]'"
        )
        add_migrations("0028")
        report = migrate(conn, plpython_root)
        assert "0028_typed_fusion_candidates" in report.applied
        assert conn.execute("SELECT to_regprocedure(%s)", (signature,)).fetchone() == (None,)
        kept = conn.execute(
            "SELECT array_agg(oid::regprocedure::text) FROM pg_proc WHERE proname = '_after_fusion'"
        ).fetchone()
        assert kept is not None and kept[0] == [
            "memory._after_fusion(memory.fused_row[],jsonb,vector)"
        ]
        assert migrate(conn, plpython_root).applied == []  # once
