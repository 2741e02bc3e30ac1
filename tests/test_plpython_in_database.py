"""The PL/Python package travels inside the database (migration 0017): after a migrate that
installs no directory on this host (`--no-plpython`, the remote-database case), the
optimizer imports poimen_core from memory._plpython_modules, a new deploy's source replaces
the old one in a running backend, and `migrate --check` reports a module edited or removed
by hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psycopg
import pytest

from conftest import FIXTURE, make_role, prepare_database
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import check, migrate, plpython_checksum
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest

CHECKOUT = Path(__file__).resolve().parents[1]


def _migrated(url: str) -> psycopg.Connection[object]:
    conn = connect(url, autocommit=True)
    prepare_database(conn)
    migrate(conn, None)
    return conn  # type: ignore[return-value]


def test_optimizer_imports_from_the_database(empty_url: str) -> None:
    with _migrated(empty_url) as conn:
        assert (
            conn.execute("SELECT value FROM memory.config WHERE key = 'plpython_path'").fetchone()
            is None
        )
        where = conn.execute("SELECT memory.plpython_load()").fetchone()
        assert where == (f"database:{plpython_checksum()}",)
        plan = conn.execute(
            "SELECT memory.optimize_query('deployment failures in 2024') ->> 'search_strategy'"
        ).fetchone()
        assert plan == ("LexicalFirst",)
        conn.execute(
            "CREATE FUNCTION pg_temp.origin() RETURNS text LANGUAGE plpython3u AS"
            " $$ import sys; return sys.modules['poimen_core.optimizer'].__spec__.origin $$"
        )
        assert conn.execute("SELECT pg_temp.origin()").fetchone() == (
            "memory._plpython_modules:optimizer.py",
        )


def test_a_reader_and_the_service_import_from_the_database(empty_url: str) -> None:
    """Every query imports poimen_core as its caller: a reader role, and the service's role,
    read memory._plpython_modules (its writes stay the owner's). Owner-only, every reader's
    query failed with 42501 on a database whose server reads no directory of ours."""
    with _migrated(empty_url) as conn:
        make_role(conn, "module_reader", "reader")
        make_role(conn, "module_service", "service")
        conn.execute("SELECT memory.grant_project('module_reader', '*')")
        for role in ("module_reader", "module_service"):
            conn.execute(f"SET ROLE {role}")
            try:
                plan = conn.execute(
                    "SELECT memory.optimize_query('deployment failures in 2024')"
                    " ->> 'search_strategy'"
                ).fetchone()
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute("DELETE FROM memory._plpython_modules")
            finally:
                conn.execute("RESET ROLE")
            assert plan == ("LexicalFirst",), role


def test_a_new_deploys_source_replaces_the_old_in_a_backend(empty_url: str) -> None:
    with _migrated(empty_url) as conn:
        conn.execute("SELECT memory.optimize_query('hello')")
        # Another "deploy": the package's __init__ gains a marker and a new checksum.
        conn.execute(
            "UPDATE memory._plpython_modules SET source = source || E'\\nPOIMEN_MARK = 17\\n'"
            " WHERE name = '__init__.py'"
        )
        conn.execute("UPDATE memory.config SET value = 'next' WHERE key = 'plpython_checksum'")
        conn.execute("SELECT memory.optimize_query('hello again')")
        conn.execute(
            "CREATE FUNCTION pg_temp.mark() RETURNS int LANGUAGE plpython3u AS"
            " $$ import sys; return sys.modules['poimen_core'].POIMEN_MARK $$"
        )
        assert conn.execute("SELECT pg_temp.mark()").fetchone() == (17,)


def test_check_reports_a_module_edited_or_removed_by_hand(empty_url: str) -> None:
    with _migrated(empty_url) as conn:
        assert check(conn).clean, check(conn)
        conn.execute(
            "UPDATE memory._plpython_modules SET source = source || E'\\n# x\\n'"
            " WHERE name = 'optimizer.py'"
        )
        conn.execute("DELETE FROM memory._plpython_modules WHERE name = 'dates.py'")
        found = check(conn).findings
        assert any(f.startswith("plpython module changed by hand: optimizer.py") for f in found), (
            found
        )
        assert "plpython module missing (migrate restores it): dates.py" in found, found
        migrate(conn, None)
        assert check(conn).clean


def test_a_server_that_cannot_read_the_checkout_or_home_routes_hybrid(
    empty_url: str, work_dir: Path, embedder: LocalEmbedder
) -> None:
    """The issue's acceptance test: `migrate` from a checkout and a POIMEN_HOME that the
    server's OS user cannot read, the embedder's packages in a directory of the database
    host's own (what scripts/install-embedder.sh fills), then a text memory_query()."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the server then runs as postgres, another OS user")
    made = Path(sys.prefix) / "server-python"
    if not any(made.glob("*/.poimen-deps")):
        pytest.skip("`make setup` did not install the embedder's packages for the server")
    private = Path(tempfile.mkdtemp(prefix="poimen-private-"))
    try:
        private.chmod(0o700)
        for d in ("service", "plpython"):
            shutil.copytree(CHECKOUT / d, private / d, ignore=shutil.ignore_patterns("__pycache__"))
        home = private / "home"
        home.mkdir()
        deps = work_dir / f"db-host-embedder-{uuid.uuid4().hex[:8]}"
        shutil.copytree(made, deps, symlinks=True)
        deps.chmod(0o755)
        env = {
            **os.environ,
            "PYTHONPATH": f"{private / 'service'}:{private / 'plpython'}",
            "POIMEN_HOME": str(home),
            "POIMEN_DATABASE_URL": empty_url,
        }
        with connect(empty_url, autocommit=True) as conn:
            prepare_database(conn)
        run = subprocess.run(
            [sys.executable, "-m", "poimen_memory.cli.main", "migrate"],
            env=env, capture_output=True, text=True, check=False, cwd=private,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        with connect(empty_url, autocommit=True) as conn:
            conn.execute(
                "CREATE FUNCTION pg_temp.can_read(p text) RETURNS bool LANGUAGE plpython3u AS"
                " $$ import os; return os.access(p, os.R_OK) or os.access(p, os.X_OK) $$"
            )
            for p in (private, home, private / "plpython" / "poimen_core"):
                assert conn.execute("SELECT pg_temp.can_read(%s)", (str(p),)).fetchone() == (
                    False,
                ), p
            assert (
                conn.execute(
                    "SELECT value FROM memory.config WHERE key = 'plpython_path'"
                ).fetchone()
                is None
            )
            conn.execute(
                "INSERT INTO memory.config (key, value) VALUES ('plpython_deps', %s)"
                " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                (str(deps),),
            )
            records, _ = parse_lines(FIXTURE.read_text().splitlines())
            ingest(conn, records, embedder, progress=False)
            rows = conn.execute(
                "SELECT search_strategy, query_score, semantic_rank FROM public.memory_query("
                "'why did requests over 10KB fail', project => 'poimen')"
            ).fetchall()
            assert rows and {r[0] for r in rows} == {"Hybrid"}, rows
            assert any(r[2] is not None for r in rows), rows
            assert check(conn).clean, check(conn)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        if "deps" in locals():
            shutil.rmtree(deps, ignore_errors=True)
