"""The ledger of versioned migrations (memory.schema_migrations): each file of migrations/
is applied once, in order, and frozen by its checksum; a database that knows a version this
code does not is refused (migrations are forward-only)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import psycopg

import poimen_memory.db.migrate.layout as layout
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.migrate.plpython import plpython_status
from poimen_memory.errors import MigrationError

# A database without plpython3u whose role may not create it (a managed service) still
# takes the migrations: their CREATE EXTENSION becomes a comment, and sql/ makes the
# PL/Python functions as stubs (render.py).
_PLPYTHON_EXTENSION = re.compile(r"^CREATE EXTENSION IF NOT EXISTS plpython3u;$", re.MULTILINE)


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files() -> list[Path]:
    return sorted(layout.MIGRATIONS_DIR.glob("*.sql"))


def _notice_text(source: str, diag: psycopg.errors.Diagnostic) -> str:
    parts = [f"{source}: {diag.message_primary}"]
    parts += [
        f"{k}: {v}" for k, v in (("detail", diag.message_detail), ("hint", diag.message_hint)) if v
    ]
    return "\n".join(parts)


def create_ledger(conn: psycopg.Connection[Any]) -> None:
    conn.execute(catalog("ledger_create"))


def apply_pending(conn: psycopg.Connection[Any], notices: list[str]) -> tuple[list[str], list[str]]:
    """Apply the migrations the ledger does not hold, in order, recording each: (applied,
    already applied). What an applied migration tells the operator (RAISE NOTICE) is added
    to ``notices``."""
    applied: list[str] = []
    already: list[str] = []
    rows = conn.execute(catalog("ledger_recorded")).fetchall()
    recorded: dict[str, str] = {str(r[0]): str(r[1]) for r in rows}
    for path in _files():
        version, checksum = path.stem, _checksum(path)
        if version in recorded:
            if recorded[version] != checksum:
                raise MigrationError(
                    f"migration {path.name} was edited after it was applied",
                    detail=f"recorded checksum {recorded[version]}, file has {checksum}",
                    hint="released migrations are frozen: add a new migration instead",
                )
            already.append(version)
            continue

        # Only the migrations' own notices: the sql/ files' "already exists,
        # skipping" would bury them.
        def tell(diag: psycopg.errors.Diagnostic, name: str = path.name) -> None:
            notices.append(_notice_text(name, diag))

        conn.add_notice_handler(tell)
        text = path.read_text()
        if not plpython_status(conn)[1]:
            text = _PLPYTHON_EXTENSION.sub(
                "-- plpython3u: not in this database, and this role may not create it", text
            )
        try:
            conn.execute(text.encode())
        finally:
            conn.remove_notice_handler(tell)
        conn.execute(catalog("ledger_record"), (version, checksum))
        applied.append(version)
    unknown = unknown_migrations(conn)
    if unknown:
        raise MigrationError(
            f"database has migrations this code does not know: {unknown}",
            hint=AHEAD_HINT,
        )
    return applied, already


AHEAD_HINT = "deploy a newer poimen-memory; migrations are forward-only"


def unknown_migrations(conn: psycopg.Connection[Any]) -> list[str]:
    """The versions in the ledger that this code has no file for: the database is ahead of
    the code (a newer release migrated it), and migrate refuses it."""
    found = conn.execute(catalog("relation_exists"), ("memory.schema_migrations",)).fetchone()
    if found != (True,):
        return []
    recorded = {str(r[0]) for r in conn.execute(catalog("ledger_versions"))}
    return sorted(recorded - {p.stem for p in _files()})


def pending_migrations(conn: psycopg.Connection[Any]) -> list[str]:
    """The versions the database has not applied (every one where it has no ledger)."""
    versions = [p.stem for p in _files()]
    found = conn.execute(catalog("relation_exists"), ("memory.schema_migrations",)).fetchone()
    if found != (True,):
        return versions
    recorded = {str(r[0]) for r in conn.execute(catalog("ledger_versions"))}
    return [v for v in versions if v not in recorded]
