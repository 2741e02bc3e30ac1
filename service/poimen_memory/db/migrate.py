"""Apply versioned migrations once (frozen by checksum), then re-apply sql/ on every deploy.

Everything runs in one transaction under an advisory lock, so a failed deploy leaves the
database as it was and two concurrent deploys serialise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psycopg

from poimen_memory.errors import MigrationError

ROOT = Path(__file__).resolve().parents[3]
MIGRATIONS_DIR = ROOT / "migrations"
SQL_DIR = ROOT / "sql"
PLPYTHON_SRC = ROOT / "plpython" / "poimen_core"
_LOCK_KEY = 0x706F696D656E  # "poimen"

_LEDGER = """
CREATE SCHEMA IF NOT EXISTS memory;
CREATE TABLE IF NOT EXISTS memory.schema_migrations (
    version    text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


@dataclass(frozen=True)
class MigrateReport:
    applied: list[str]
    already: list[str]
    sql_files: list[str]
    plpython_path: str | None


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plpython_checksum() -> str:
    h = hashlib.sha256()
    for f in sorted(PLPYTHON_SRC.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def install_plpython(root: Path) -> Path:
    """Copy the stdlib-only module where the server's postgres user can import it.

    The directory is named by content hash, so a new version never overwrites code that a
    running backend has loaded; the shim notices the path change and re-imports.
    """
    target = root / plpython_checksum()[:16]
    pkg = target / "poimen_core"
    if not (pkg / "__init__.py").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(
            PLPYTHON_SRC, tmp / "poimen_core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        for d in (tmp, tmp / "poimen_core"):
            d.chmod(0o755)
        for f in (tmp / "poimen_core").iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    p = root
    while p != p.parent:  # every ancestor must be traversable by the postgres user
        if p.exists() and (p.stat().st_mode & 0o001) == 0 and os.geteuid() == 0:
            p.chmod(p.stat().st_mode | 0o001)  # o+x: traverse only, nothing readable
        p = p.parent
    return target


def migrate(conn: psycopg.Connection[object], plpython_root: Path | None) -> MigrateReport:
    for d in (MIGRATIONS_DIR, SQL_DIR):
        if not d.is_dir():
            raise MigrationError(
                f"{d} does not exist",
                hint="run from a source checkout (pip install -e .); the SQL ships beside the code",
            )
    applied: list[str] = []
    already: list[str] = []
    py_path: str | None = None
    if plpython_root is not None:
        py_path = str(install_plpython(plpython_root))
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute(_LEDGER)
        rows = conn.execute("SELECT version, checksum FROM memory.schema_migrations").fetchall()
        recorded: dict[str, str] = {str(r[0]): str(r[1]) for r in rows}  # type: ignore[index]
        for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
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
            conn.execute(path.read_text().encode())
            conn.execute(
                "INSERT INTO memory.schema_migrations (version, checksum) VALUES (%s, %s)",
                (version, checksum),
            )
            applied.append(version)
        unknown = set(recorded) - {p.stem for p in MIGRATIONS_DIR.glob("*.sql")}
        if unknown:
            raise MigrationError(
                f"database has migrations this code does not know: {sorted(unknown)}",
                hint="deploy a newer poimen-memory; migrations are forward-only",
            )
        if py_path is not None:
            conn.execute(
                """INSERT INTO memory.config (key, value) VALUES
                       ('plpython_path', %s), ('plpython_checksum', %s)
                   ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
                   WHERE memory.config.value IS DISTINCT FROM EXCLUDED.value""",
                (py_path, plpython_checksum()),
            )
        sql_files = sorted(SQL_DIR.glob("*.sql"))
        for path in sql_files:
            conn.execute(path.read_text().encode())
    return MigrateReport(applied, already, [p.name for p in sql_files], py_path)
