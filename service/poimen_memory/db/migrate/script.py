"""`migrate --render-sql`: the SQL migrate's transaction runs, as a script for psql.

A DBA who installs database code with psql (and reads it first) gets the exact text: migrate
itself runs, in a transaction that is rolled back, on a connection whose cursors write down
every statement that changes the database, parameters bound as literals. There is no second
writer of migrate's statements: the migrations with their ledger rows, sql/ rendered for
this database (roles, vocabulary, pgvector's schema, PL/Python stubs where plpython3u is
absent), the module's rows and keys, the functions' pinned search_path, the grants.

Left out: what migrate only asks the database (its reads decide what it runs: the script
is rendered for the database as it is now, and names that state in its header), the
per-attempt ``lock_timeout`` (psql does not retry; the header says how to set one) and
the large projects' HNSW graphs, which migrate builds after its transaction (CREATE INDEX
CONCURRENTLY cannot run in psql -1's transaction; a fresh database has none to build)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql

import poimen_memory.db.migrate.layout as layout
from poimen_memory.db.migrate.apply import vector_schema
from poimen_memory.db.migrate.deploy import migrate
from poimen_memory.db.migrate.graphs import missing_project_graphs
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.migrate.ledger import pending_migrations
from poimen_memory.db.migrate.plpython import plpython_status
from poimen_memory.db.queries import statements

# migrate's statements that return rows yet change what follows, kept: the advisory lock
# (a concurrent migrate waits for the script, and the script for it) and pgvector's library
# loaded in the backend (a non-superuser's `SET hnsw.*` in a function definition needs it).
_EFFECTS = ("transaction_lock", "load_pgvector")
# The per-attempt lock timeout of migrate's retry loop (locks.py): not for psql.
_LEFT_OUT = ("set_lock_timeout",)
# A catalog statement that asks (after its leading comments), and where its text stops
# being the same in every statement made from it.
_READ = re.compile(r"^\s*(?:--[^\n]*\n\s*)*(SELECT|WITH)\b", re.IGNORECASE)
_PLACEHOLDER = re.compile(r"\{|%s|%\(")


def _leading(name: str) -> str:
    """A catalog statement's text up to its first placeholder (a name formatted in, a
    parameter bound): what every statement made from it starts with."""
    return _PLACEHOLDER.split(catalog(name).as_string(None), maxsplit=1)[0]


@dataclass(frozen=True)
class Script:
    """The rendered script and what its header says."""

    text: str
    statements: int
    migrations: list[str]
    """The versions it applies (ledger rows it inserts), in order."""


def _questions() -> list[str]:
    """The leading text of each catalog statement that only asks the database something (a
    SELECT or WITH, but for _EFFECTS) and of those _LEFT_OUT. The files' own statements are
    all kept: a SELECT there changes the database (memory._declare_row, sql/069)."""
    return [
        lead
        for name, text in statements(layout.CATALOG).items()
        if (name in _LEFT_OUT or (_READ.match(text) and name not in _EFFECTS))
        and (lead := _leading(name).strip())
    ]


def _wanted(text: str, questions: list[str]) -> bool:
    return not any(text.lstrip().startswith(q) for q in questions)


def _terminated(statement: str) -> str:
    """A statement ending in a semicolon psql sees (not one inside a trailing comment)."""
    text = statement.rstrip()
    if text.endswith(";"):
        return text
    return text + ("\n;" if text.rsplit("\n", 1)[-1].lstrip().startswith("--") else ";")


def _recorder(log: list[str]) -> type[psycopg.Cursor[Any]]:
    """A cursor class that writes down, bound, each statement it runs that migrate sends
    to change the database."""
    questions = _questions()

    class Recording(psycopg.Cursor[Any]):
        def _note(self, query: Any, params: Any) -> None:
            if isinstance(query, bytes):
                query = query.decode()
            text = psycopg.ClientCursor(self.connection).mogrify(query, params)
            if _wanted(text, questions):
                log.append(text)

        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Recording:
            try:
                super().execute(query, params, **kwargs)
            except psycopg.errors.LockNotAvailable:
                # migrate rolls the attempt back and runs it again whole (locks.retrying):
                # what it ran so far is not in the transaction that commits.
                log.clear()
                raise
            self._note(query, params)
            return self

        def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
            rows = list(params_seq)
            super().executemany(query, rows, **kwargs)
            for params in rows:
                self._note(query, params)

    return Recording


# The script is what migrate ran against the ledger as it was: applied to a database whose
# ledger differs (applied twice, or after another deploy) it would re-run or skip migrations.
# It stops first, naming both states (55000: object not in prerequisite state).
_LEDGER_GUARD = """\
DO $guard$
DECLARE
    found text := (SELECT coalesce(string_agg(version, ', ' ORDER BY version), '')
                   FROM memory.schema_migrations);
BEGIN
    IF found IS DISTINCT FROM {expected} THEN
        RAISE EXCEPTION 'this script was rendered for a database whose ledger held other migrations'
            USING ERRCODE = '55000',
                  DETAIL = format('memory.schema_migrations holds [%s]; rendered for [%s]',
                                  found, {expected}),
                  HINT = 'render it again for this database: poimen-memory migrate --render-sql';
    END IF;
END $guard$"""


def _with_guard(log: list[str], already: list[str]) -> list[str]:
    """The ledger guard right after the statement that creates the ledger."""
    lead = _leading("ledger_create").strip()
    at = next(i for i, s in enumerate(log) if s.lstrip().startswith(lead)) + 1
    expected = psycopg.sql.Literal(", ".join(sorted(already))).as_string(None)
    return [*log[:at], _LEDGER_GUARD.format(expected=expected), *log[at:]]


def _server(conn: psycopg.Connection[Any]) -> tuple[str, str, str]:
    row = conn.execute(
        "SELECT current_database(), current_setting('server_version'),"
        " (SELECT extversion FROM pg_extension WHERE extname = 'vector')"
    ).fetchone()
    assert row is not None
    return str(row[0]), str(row[1]), str(row[2] or "not installed")


def _product_version() -> str:
    try:
        return version("poimen-memory")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown (not installed)"


def render_script(
    conn: psycopg.Connection[Any],
    *,
    role_prefix: str | None = None,
    check_command: str = "poimen-memory migrate --check --no-plpython",
) -> Script:
    """What ``migrate`` would run on the database ``conn`` is connected to (autocommit, as
    migrate's own), as a psql script with a header; the database is left as it was."""
    log: list[str] = []
    was = conn.cursor_factory
    graphs = 0 if pending_migrations(conn) else len(missing_project_graphs(conn))
    with conn.transaction(force_rollback=True):
        conn.cursor_factory = _recorder(log)
        try:
            report = migrate(conn, None, role_prefix=role_prefix, build_graphs=False)
        finally:
            conn.cursor_factory = was
        # As the script leaves it (pgvector is created by the first migration).
        database, server, pgvector = _server(conn)
        plpython = plpython_status(conn)[0]
        schema = vector_schema(conn) or "public"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = conn.info
    target = f"database {database} on {info.host}:{info.port} as {info.user}"
    header = [
        f"-- poimen-memory {_product_version()}: the SQL `poimen-memory migrate` runs in its"
        " transaction,",
        f"-- rendered {when} for {target}",
        f"-- (PostgreSQL {server}; pgvector {pgvector} in schema {schema}; plpython3u"
        f" {'installed' if plpython else 'absent: PL/Python functions are PM503 stubs'}).",
        f"-- Roles: {', '.join(report.roles.all)}.",
        *textwrap.wrap(
            "Migrations it applies and records in memory.schema_migrations: "
            f"{', '.join(report.applied) or 'none'}; already applied: {len(report.already)}.",
            width=96,
            initial_indent="-- ",
            subsequent_indent="--   ",
            break_on_hyphens=False,
        ),
        "-- It is rendered for that database as it was then (its ledger, roles, extensions):",
        "-- applied elsewhere or later it may fail (and roll back) or differ; render again.",
        "--",
        "-- Read it, keep it, then apply it as the database's owner in one transaction",
        "-- (migrate's lock timeout is not in it; PGOPTIONS='-c lock_timeout=10s' sets one):",
        f"--   psql -1 -v ON_ERROR_STOP=1 -d {database} -f THIS_FILE",
        "-- and check that the database is what this version of poimen-memory makes (exit 0):",
        f"--   POIMEN_DATABASE_URL=<its URL> {check_command}",
    ]
    if graphs:
        header.append(
            f"-- Not in it: {graphs} large project graph(s) that `poimen-memory migrate` builds"
            " after its transaction (CREATE INDEX CONCURRENTLY; docs/scaling.md)."
        )
    body = [_terminated(s) for s in _with_guard(log, report.already)]
    text = "\n".join([*header, "", "\\set ON_ERROR_STOP on", "", *body]) + "\n"
    return Script(text, len(body), report.applied)


def write_script(script: Script, path: Path | None) -> None:
    """The script into ``path`` (None: stdout)."""
    if path is None:
        print(script.text, end="")
    else:
        path.write_text(script.text)
