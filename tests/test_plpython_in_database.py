"""The PL/Python package travels inside the database (migration 0017): after a migrate that
installs no directory on this host (`--no-plpython`, the remote-database case), the
optimizer imports poimen_core from memory._plpython_modules, a new deploy's source replaces
the old one in a running backend, and `migrate --check` reports a module edited or removed
by hand."""

from __future__ import annotations

import psycopg

from conftest import prepare_database
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import check, migrate, plpython_checksum


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
