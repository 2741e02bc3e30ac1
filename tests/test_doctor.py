"""`poimen-memory doctor` and memory.capabilities(): on the suite's own database everything
the product uses is on (pg_stat_statements aside: this cluster does not preload it); a
database without pgvector, unmigrated, behind on its migrations or with row-level security
off fails with the reason; the optional capabilities that are off are warnings, each with
its cost; and docs/managed-postgres.md shows the vocabulary's capability table and what
changes without PL/Python (one definition). The managed-PostgreSQL case, without plpython3u,
is in tests/test_managed_postgres.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import make_role, prepare_database
from poimen_core import vocabulary
from poimen_memory.cli.doctor import render
from poimen_memory.cli.main import main
from poimen_memory.db import capabilities
from poimen_memory.db.capabilities import report
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import MIGRATIONS_DIR, migrate
from poimen_memory.db.roles import Roles, prefix_for

DOC = Path(__file__).resolve().parents[1] / "docs" / "managed-postgres.md"
NAMES = [n for n, _r, _w, _c in vocabulary.CAPABILITIES]
COSTS = {n: c for n, _r, _w, c in vocabulary.CAPABILITIES}


def doctor(
    url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
) -> tuple[int, str]:
    """`poimen-memory doctor ARGS` against url, through the CLI's main() in this process."""
    for key in [k for k in os.environ if k.startswith("POIMEN_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("POIMEN_DATABASE_URL", url)
    capsys.readouterr()
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def by_name(out: str) -> dict[str, dict[str, Any]]:
    body = json.loads(out)
    assert [c["name"] for c in body["capabilities"]] == NAMES
    return {c["name"]: c for c in body["capabilities"]}


@pytest.fixture
def bare_url(cluster: Any, admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A database without pgvector (template0: nothing the suite's template holds)."""
    name = f"t_bare_{os.getpid()}"
    admin.execute(f"DROP DATABASE IF EXISTS {name}")
    admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    try:
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# -- the suite's database ----------------------------------------------------------------


def test_everything_is_on_in_the_test_database(
    fixture_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = doctor(fixture_url, monkeypatch, capsys, "--json")
    caps = by_name(out)
    assert code == 0 and json.loads(out)["ok"] is True
    assert json.loads(out)["source"] == "memory.capabilities()"
    off = {n for n, c in caps.items() if c["status"] != "on"}
    # This cluster does not preload pg_stat_statements (tests/test_query_cost.py has one).
    assert off == {"pg_stat_statements"}, caps
    assert caps["pg_stat_statements"]["detail"].startswith("not installed in this database")
    assert caps["pg_stat_statements"]["cost"] == COSTS["pg_stat_statements"]
    assert all(caps[n]["cost"] is None for n in NAMES if n != "pg_stat_statements")
    assert caps["pgvector"]["detail"].endswith("iterative index scans: yes")
    newest = max(p.stem for p in MIGRATIONS_DIR.glob("*.sql"))
    assert caps["schema"]["detail"].startswith(f"{newest} (")
    # The suite migrates with a PL/Python directory on this host (conftest.plpython_root).
    assert caps["plpython_module"]["detail"].startswith("imported from the directory /")
    assert caps["embedder"]["detail"].startswith("memory.embed works, with the local model")
    assert "a superuser" in caps["owner"]["detail"]
    assert "bypasses it (a superuser)" in caps["row_level_security"]["detail"]

    code, text = doctor(fixture_url, monkeypatch, capsys)
    assert code == 0
    assert "ok: everything poimen-memory needs is here" in text
    assert "warning: off (optional): pg_stat_statements" in text
    assert "without it: no per-statement counts" in text


def test_sql_users_get_the_same_report_as_a_reader(conn: psycopg.Connection[Any]) -> None:
    reader = conn.execute("SELECT reader FROM memory.roles()").fetchone()[0]  # type: ignore[index]
    make_role(conn, "doctor_reader", reader)
    conn.execute("SET ROLE doctor_reader")
    rows = conn.execute("SELECT name, required, status, detail, cost FROM memory.capabilities()")
    caps = {r[0]: r for r in rows.fetchall()}
    conn.execute("RESET ROLE")
    assert list(caps) == NAMES
    assert [n for n, c in caps.items() if c[1]] == ["pgvector", "schema", "row_level_security"]
    assert caps["embedder"][2] == "on" and caps["plpython_module"][2] == "on"
    assert caps["owner"][2:] == (
        "off",
        "doctor_reader: not the owner of schema memory (postgres is); not a superuser; "
        f"member of {reader}",
        COSTS["owner"],
    )
    assert caps["row_level_security"][3].endswith(
        "this role sees the projects granted to it (memory.grant_project)"
    )
    # Nothing to run it with for PUBLIC.
    make_role(conn, "doctor_nobody")
    conn.execute("SET ROLE doctor_nobody")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT * FROM memory.capabilities()")
    conn.execute("RESET ROLE")


def test_the_text_report_wraps_each_cost_under_its_capability(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute("DELETE FROM memory.config WHERE key = 'plpython_deps'")  # no embedder here
    text = render(report(conn), width=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    at = next(i for i, line in enumerate(lines) if line.startswith("embedder "))
    assert lines[at].split()[1] == "off"
    following = " ".join(" ".join(lines[at : at + 20]).split())
    assert "off the in-database embedder cannot be imported on the database host" in following
    assert "--embedder-packages DIR" in following
    assert ("without it: " + COSTS["embedder"])[:60] in following
    assert lines[-1] == "warning: off (optional): embedder, pg_stat_statements"


# -- what is missing, and why -------------------------------------------------------------


def test_a_database_without_pgvector_fails_with_the_reason(
    bare_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = doctor(bare_url, monkeypatch, capsys, "--json")
    caps = by_name(out)
    assert code == 1 and json.loads(out)["ok"] is False
    # The probes ran as this code's copy of the function, in pg_temp, rolled back.
    assert json.loads(out)["source"].startswith("092_capabilities.sql of this poimen-memory")
    assert caps["pgvector"]["status"] == "off"
    assert caps["pgvector"]["detail"].startswith(
        "not installed in this database; the server offers"
    )
    assert caps["pgvector"]["cost"] == COSTS["pgvector"]
    assert caps["schema"]["detail"] == "schema memory is not installed in this database"
    assert caps["row_level_security"]["detail"] == "needs the schema (`poimen-memory migrate`)"
    with connect(bare_url, autocommit=True) as conn:
        assert report(conn).missing  # the same report, in this session
        assert conn.execute(
            "SELECT to_regprocedure('pg_temp.poimen_capabilities()'), to_regnamespace('memory')"
        ).fetchone() == (None, None)  # left nothing behind
    code, text = doctor(bare_url, monkeypatch, capsys)
    assert code == 1
    words = " ".join(text.split())
    assert (
        "missing (required): pgvector, schema, row_level_security: poimen-memory cannot run on "
        "this database as it is"
    ) in words
    assert "without it: nothing works: the embeddings column" in words


def test_the_copy_in_pg_temp_is_rendered_as_migrate_renders_the_file(
    bare_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy goes through migrate.render_sql: a role marker in the file is this
    database's role (POIMEN_ROLE_PREFIX where given, else the database's name), as the
    function migrate makes would say, not the marker."""
    source = tmp_path / "092_capabilities.sql"
    source.write_text(
        "CREATE OR REPLACE FUNCTION memory.capabilities()\n"
        "RETURNS TABLE (name text, required boolean, status text, detail text, cost text)\n"
        "LANGUAGE sql STABLE\n"
        "SET search_path = pg_catalog, public, pg_temp\n"
        "AS $$\n"
        "SELECT 'roles', true, 'on', '@role.reader@ @vocabulary.reference_first_year@',"
        " NULL::text\n"
        "$$;\n"
    )
    monkeypatch.setattr(capabilities, "SOURCE", source)
    first_year = vocabulary.sql_literals()["reference_first_year"]
    with connect(bare_url, autocommit=True) as conn:
        database = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        (row,) = report(conn).capabilities
        # The names migrate's render_sql would write (db/roles.py), not restated here.
        assert row.detail == f"{Roles(prefix_for(database)).reader} {first_year}"
        (row,) = report(conn, "tenant_a").capabilities
        assert row.detail == f"{Roles('tenant_a').reader} {first_year}"


def test_an_unmigrated_database_with_pgvector_names_migrate(
    empty_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with connect(empty_url, autocommit=True) as conn:
        prepare_database(conn)
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    code, out = doctor(empty_url, monkeypatch, capsys, "--json")
    caps = by_name(out)
    assert code == 1
    assert caps["pgvector"]["status"] == "on"
    assert (caps["schema"]["status"], caps["schema"]["cost"]) == ("off", COSTS["schema"])
    assert "poimen-memory migrate" in COSTS["schema"]


def test_a_pending_migration_is_a_missing_schema(
    conn: psycopg.Connection[Any],
    fixture_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    newest = max(p.stem for p in MIGRATIONS_DIR.glob("*.sql"))
    conn.execute("DELETE FROM memory.schema_migrations WHERE version = %s", (newest,))
    code, out = doctor(fixture_url, monkeypatch, capsys, "--json")
    schema = by_name(out)["schema"]
    assert code == 1
    assert schema["status"] == "off" and schema["detail"].endswith(f"; pending: {newest}")


def test_row_level_security_off_is_a_missing_capability(
    conn: psycopg.Connection[Any],
    fixture_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    conn.execute("ALTER TABLE memory.nodes DISABLE ROW LEVEL SECURITY")
    code, out = doctor(fixture_url, monkeypatch, capsys, "--json")
    rls = by_name(out)["row_level_security"]
    assert code == 1
    assert rls["status"] == "off" and rls["detail"].startswith("disabled on memory.nodes;")
    assert rls["cost"] == COSTS["row_level_security"]


def test_the_module_from_the_database_and_no_embedder_are_warnings(
    empty_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with connect(empty_url, autocommit=True) as conn:
        prepare_database(conn)
        migrate(conn, None)  # no directory on this host: poimen_core from the database
    code, out = doctor(empty_url, monkeypatch, capsys, "--json")
    caps = by_name(out)
    assert code == 0
    assert caps["plpython_module"]["detail"].startswith(
        "imported from memory._plpython_modules, in the database (checksum "
    )
    assert caps["embedder"]["status"] == "off"
    detail = caps["embedder"]["detail"]
    # What is missing on the server, where it looked, and what to do there.
    assert detail.startswith(
        "the in-database embedder cannot be imported on the database host (No module named "
    ), detail
    assert "looked in its own sys.path: memory.config has no plpython_deps" in detail
    assert "then run `poimen-memory migrate --embedder-packages DIR`" in detail
    assert caps["embedder"]["cost"] == COSTS["embedder"]


def test_a_module_directory_missing_on_the_database_host_is_named(
    conn: psycopg.Connection[Any],
    fixture_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    conn.execute("UPDATE memory.config SET value = '/nonexistent' WHERE key = 'plpython_path'")
    code, out = doctor(fixture_url, monkeypatch, capsys, "--json")
    caps = by_name(out)
    assert code == 0
    module = caps["plpython_module"]
    assert module["status"] == "off" and module["cost"] == COSTS["plpython_module"]
    assert module["detail"].startswith("the PL/Python optimizer module cannot be imported")
    assert "plpython_path = /nonexistent" in module["detail"]


def test_the_installed_command_runs(fixture_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    proc = subprocess.run(
        [sys.executable, "-m", "poimen_memory.cli.main", "doctor"],
        env={**env, "POIMEN_DATABASE_URL": fixture_url},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2].split() == ["capability", "status", "detail"]


# -- one definition: the doc shows the vocabulary --------------------------------------------


def without_plpython_table() -> str:
    rows = [f"| {what} | {yes} | {no} |" for what, yes, no in vocabulary.WITHOUT_PLPYTHON]
    return "\n".join(["| | with PL/Python | without |", "|---|---|---|", *rows])


def capability_table() -> str:
    def cost(name: str, text: str) -> str:
        return "everything in [What changes without PL/Python](#what-changes-without-plpython)" \
            if name == "plpython3u" else text  # fmt: skip

    rows = [
        f"| `{n}` | {'yes' if r else 'no'} | {w} | {cost(n, c)} |"
        for n, r, w, c in vocabulary.CAPABILITIES
    ]
    header = ["| capability | required | what it is | when it is off |", "|---|---|---|---|"]
    return "\n".join([*header, *rows])


def test_the_doc_shows_the_vocabularys_tables() -> None:
    doc = DOC.read_text()
    assert without_plpython_table() in doc, "docs/managed-postgres.md:\n" + without_plpython_table()
    assert capability_table() in doc, "docs/managed-postgres.md:\n" + capability_table()
    assert "`poimen-memory doctor`" in doc
