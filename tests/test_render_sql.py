"""`migrate --render-sql`: the SQL migrate would run, as a psql script (docs/install.md).

Rendered by the real CLI for a real database, applied with psql alone, then judged by what
matters: `migrate --check` finds no drift, and memory_query() answers as it does in a
database `migrate` installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import FIXTURE, free_port, prepare_database
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import layout, migrate, server_python_deps
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest

# What render.py fills in (comments, and poimen_core's source in memory._plpython_modules,
# name the markers as @role.*@ and @vocabulary.NAME@, which are none).
MARKER = re.compile(
    r"@role\.(reader|writer|service)@|@vocabulary\.[a-z_0-9]+@|^\s*@plain_errors@\s*$",
    re.MULTILINE,
)
QUERIES = [
    "kong body buffer",
    "api timeouts during deploys in 2024",
    "why did uploads fail",
    '"client_body_buffer_size" -nginx',
]


# The script installs poimen_core into the database (memory._plpython_modules), never a path
# of the host that rendered it: checked as such (no module copy on this host to compare with).
CHECK = ("--check", "--no-plpython")


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, POIMEN_DATABASE_URL=url)
    return subprocess.run(
        [sys.executable, "-m", "poimen_memory.cli.main", "migrate", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _psql(url: str, script: Path) -> subprocess.CompletedProcess[str]:
    psql = str(find_pg_bin() / "psql")
    return subprocess.run(
        [psql, "-X", "-q", "-1", "-v", "ON_ERROR_STOP=1", "-d", url, "-f", str(script)],
        capture_output=True,
        text=True,
        check=False,
    )


def _answers(url: str) -> list[tuple[Any, ...]]:
    """Every query's results, in order: what a caller of memory_query() sees."""
    out: list[tuple[Any, ...]] = []
    with connect(url, autocommit=True) as conn:
        for q in QUERIES:
            rows = conn.execute(
                "SELECT sha256, level, round(final_score::numeric, 6), search_strategy,"
                " query_score IS NOT NULL"
                " FROM public.memory_query(%s, k => 10)",
                (q,),
            ).fetchall()
            assert rows, q  # the comparison below compares something
            out += [(q, *r) for r in rows]
    return out


def _load(url: str, embedder: LocalEmbedder) -> None:
    """The fixture's nodes through the normal write path (memory._write_nodes)."""
    records, errors = parse_lines(FIXTURE.read_text().splitlines())
    assert not errors
    with connect(url, autocommit=True) as conn:
        report = ingest(conn, records, embedder, progress=False)
    assert report.inserted == len(records) and not report.unresolved


@pytest.fixture
def second_empty_url(cluster: Cluster, admin: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name}")
    try:
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_rendered_sql_applied_with_psql_installs_what_migrate_does(
    empty_url: str,
    second_empty_url: str,
    tmp_path: Path,
    work_dir: Path,
    embedder: LocalEmbedder,
) -> None:
    for url in (empty_url, second_empty_url):
        with connect(url, autocommit=True) as conn:
            prepare_database(conn)
    script = tmp_path / "install.sql"
    rendered = _cli(empty_url, "--render-sql", str(script))
    assert rendered.returncode == 0, rendered.stderr
    text = script.read_text()
    versions = sorted(p.stem for p in layout.MIGRATIONS_DIR.glob("*.sql"))
    database = empty_url.split("?")[0].rsplit("/", 1)[-1]
    # The header: the version, the target, the roles, how to apply and to check it.
    head = text.split("\n\n", 1)[0]
    assert "poimen-memory 0.1.0" in head
    assert f"database {database}" in head
    assert f"{database}_memory_reader" in head
    assert "psql -1 -v ON_ERROR_STOP=1" in head and "migrate --check" in head
    listed = " ".join(line.lstrip("- ") for line in head.splitlines())
    assert f"applies and records in memory.schema_migrations: {', '.join(versions)};" in listed
    # Every template filled: no marker of sql/ is left for psql to choke on.
    assert MARKER.findall(text) == []
    for v in versions:  # each migration with its ledger row
        assert f"INSERT INTO memory.schema_migrations (version, checksum) VALUES ('{v}'," in text
    # Rendering changed nothing: the database is as empty as it was.
    with connect(empty_url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace('memory')").fetchone() == (None,)

    applied = _psql(empty_url, script)
    assert applied.returncode == 0, applied.stderr
    checked = _cli(empty_url, *CHECK)
    assert checked.returncode == 0 and "no drift" in checked.stdout, checked.stdout + checked.stderr

    with connect(second_empty_url, autocommit=True) as conn:
        migrate(conn, None)
    # The embedder's packages for the server's Python, as scripts/install-embedder.sh tells
    # a DBA to record them: memory.embed then embeds each query in both databases.
    deps = server_python_deps(work_dir)
    for url in (empty_url, second_empty_url):
        _load(url, embedder)
        if deps is not None:
            with connect(url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO memory.config (key, value) VALUES ('plpython_deps', %s)",
                    (str(deps),),
                )
    answers = _answers(empty_url)
    assert answers == _answers(second_empty_url)
    if deps is not None:  # the semantic leg answered too
        assert any(row[-1] for row in answers)


def test_rendered_sql_for_a_migrated_database_reapplies_sql_only(
    fixture_url: str, tmp_path: Path
) -> None:
    """A deploy to a database already migrated: no migration, sql/ re-applied; psql applies
    it twice (as migrate re-applies sql/ on every deploy) and the data stays."""
    script = tmp_path / "deploy.sql"
    rendered = _cli(fixture_url, "--render-sql", str(script))
    assert rendered.returncode == 0, rendered.stderr
    text = script.read_text()
    assert "applies and records in memory.schema_migrations: none;" in text
    assert "INSERT INTO memory.schema_migrations" not in text
    assert "CREATE OR REPLACE FUNCTION memory.query(" in text
    with connect(fixture_url, autocommit=True) as conn:
        before = conn.execute("SELECT count(*) FROM memory.nodes").fetchone()
    for _ in range(2):
        applied = _psql(fixture_url, script)
        assert applied.returncode == 0, applied.stderr
    with connect(fixture_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() == before


def test_rendered_sql_refuses_a_second_application_of_its_migrations(
    empty_url: str, tmp_path: Path
) -> None:
    """Rendered for an empty database, applied once: applied again it fails as a whole
    (the ledger holds its versions) and changes nothing."""
    with connect(empty_url, autocommit=True) as conn:
        prepare_database(conn)
    script = tmp_path / "install.sql"
    assert _cli(empty_url, "--render-sql", str(script)).returncode == 0
    assert _psql(empty_url, script).returncode == 0
    again = _psql(empty_url, script)
    assert again.returncode != 0, again.stderr
    assert "rendered for a database whose ledger held other migrations" in again.stderr
    assert "render it again for this database" in again.stderr
    assert _cli(empty_url, *CHECK).returncode == 0


OWNER = "render_owner"


@pytest.fixture(scope="module")
def managed(work_dir: Path) -> Iterator[str]:
    """A database as a managed service has it (tests/test_managed_postgres.py): owned by a
    role that is no superuser, pgvector created by an administrator, no plpython3u."""
    base = work_dir / "render-managed"  # the server's OS user must reach it
    c = Cluster(base / "data", base / "run", free_port(), find_pg_bin())
    c.start(fast=True)
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        su.execute(f"CREATE ROLE {OWNER} LOGIN CREATEROLE")
        su.execute(f"CREATE DATABASE managed OWNER {OWNER}")
    with psycopg.connect(c.url("managed"), autocommit=True) as su:
        su.execute("CREATE EXTENSION vector")
    users = ["postgres", "root"] if os.geteuid() == 0 else [os.environ.get("USER", "postgres")]
    ident = c.data_dir / "pg_ident.conf"
    ident.write_text(ident.read_text() + "".join(f"poimen {u} {OWNER}\n" for u in users))
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        su.execute("SELECT pg_reload_conf()")
    yield c.url("managed", user=OWNER)
    c.destroy()


def test_rendered_sql_for_a_database_without_plpython_is_applied_by_its_owner(
    managed: str, tmp_path: Path
) -> None:
    """Without plpython3u (and no right to create it) the script holds the PM503 stubs and
    no CREATE EXTENSION plpython3u; the owner, no superuser, applies it with psql."""
    script = tmp_path / "managed.sql"
    rendered = _cli(managed, "--render-sql", str(script))
    assert rendered.returncode == 0, rendered.stderr
    text = script.read_text()
    assert "plpython3u absent: PL/Python functions are PM503 stubs" in text
    assert "CREATE EXTENSION IF NOT EXISTS plpython3u" not in text
    assert "LANGUAGE plpython3u" not in text
    assert "memory._embed needs PL/Python, which this database does not have" in text
    applied = _psql(managed, script)
    assert applied.returncode == 0, applied.stderr
    checked = _cli(managed, *CHECK)
    assert checked.returncode == 0 and "no drift" in checked.stdout, checked.stdout + checked.stderr
    with connect(managed, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as err:
            conn.execute("SELECT memory.embed('hello')")
        assert err.value.sqlstate == "PM503"
