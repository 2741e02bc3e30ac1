"""The capability report of one database: memory.capabilities() (sql/092_capabilities.sql),
plus what only this code knows, its own migration level.

Where the schema is not installed (or was migrated by a release without the function) the
same function is created in pg_temp from this code's sql/ file, in a transaction that is
rolled back: the probes are defined once, in SQL, whichever way the report is asked for."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import psycopg

from poimen_core import vocabulary
from poimen_memory.db.migrate import (
    MIGRATIONS_DIR,
    SQL_DIR,
    database_roles,
    plpython_status,
    render_sql,
    vector_schema,
)

__all__ = ["Capability", "Report", "report"]

SOURCE = SQL_DIR / "092_capabilities.sql"
_CREATE = re.compile(r"^CREATE OR REPLACE FUNCTION memory\.capabilities\(\).*?^\$\$;$", re.M | re.S)
_TEMP_NAME = "pg_temp.poimen_capabilities"


@dataclass(frozen=True)
class Capability:
    name: str
    required: bool
    status: str  # 'on' or 'off'
    detail: str
    cost: str | None  # what is missing without it (None when on)

    @property
    def on(self) -> bool:
        return self.status == "on"


@dataclass(frozen=True)
class Report:
    database: str
    role: str
    capabilities: list[Capability]
    source: str  # 'memory.capabilities()', or this code's copy in pg_temp

    @property
    def missing(self) -> list[Capability]:
        """Required and off: poimen-memory cannot run here as the database is."""
        return [c for c in self.capabilities if c.required and not c.on]

    @property
    def warnings(self) -> list[Capability]:
        """Optional and off: the product runs, with what each one's cost says missing."""
        return [c for c in self.capabilities if not c.required and not c.on]

    @property
    def ok(self) -> bool:
        return not self.missing

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "database": self.database,
            "role": self.role,
            "source": self.source,
            "capabilities": [asdict(c) for c in self.capabilities],
        }


def _temp_function(conn: psycopg.Connection[Any], role_prefix: str | None = None) -> str:
    """This code's memory.capabilities(), as a function of this session only, rendered as
    migrate renders the file for this database."""
    m = _CREATE.search(SOURCE.read_text())
    assert m is not None, f"{SOURCE} defines memory.capabilities()"
    text = m.group(0).replace("FUNCTION memory.capabilities()", f"FUNCTION {_TEMP_NAME}()", 1)
    return render_sql(
        text,
        SOURCE,
        roles=database_roles(conn, role_prefix),
        schema=vector_schema(conn) or "public",
        plpython=plpython_status(conn)[0],
    )


def _schema_level(conn: psycopg.Connection[Any], row: Capability) -> Capability:
    """The schema's row, with the migrations this code has and the database has not (or the
    other way round: a newer release migrated it)."""
    if not row.on:
        return row
    have = {str(r[0]) for r in conn.execute("SELECT version FROM memory.schema_migrations")}
    code = {p.stem for p in MIGRATIONS_DIR.glob("*.sql")}
    pending, unknown = sorted(code - have), sorted(have - code)
    if pending:
        cost = dict((n, c) for n, _r, _w, c in vocabulary.CAPABILITIES)["schema"]
        return replace(
            row,
            status="off",
            detail=f"{row.detail}; pending: {', '.join(pending)}",
            cost=cost,
        )
    if unknown:
        return replace(
            row,
            detail=f"{row.detail}; a newer release migrated it ({', '.join(unknown)} are "
            "unknown to this code)",
        )
    return row


def report(conn: psycopg.Connection[Any], role_prefix: str | None = None) -> Report:
    """The capability report of the database ``conn`` is connected to, as its role sees it;
    ``role_prefix`` (POIMEN_ROLE_PREFIX) names its roles where no migrate has recorded them."""
    row = conn.execute(
        "SELECT current_database(), current_user,"
        " to_regprocedure('memory.capabilities()') IS NOT NULL"
    ).fetchone()
    assert row is not None
    database, role, installed = str(row[0]), str(row[1]), bool(row[2])
    if installed:
        rows = conn.execute("SELECT * FROM memory.capabilities()").fetchall()
        source = "memory.capabilities()"
    else:
        with conn.transaction(force_rollback=True):
            conn.execute(_temp_function(conn, role_prefix).encode())
            rows = conn.execute(f"SELECT * FROM {_TEMP_NAME}()").fetchall()
        source = f"{SOURCE.name} of this poimen-memory (the database has no memory.capabilities())"
    caps = [Capability(str(n), bool(r), str(s), str(d), c) for n, r, s, d, c in rows]
    caps = [_schema_level(conn, c) if c.name == "schema" else c for c in caps]
    return Report(database, role, caps, source)
