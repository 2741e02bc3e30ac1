"""Where migrate finds what it applies, and its own named statements.

The product's SQL ships inside the package, so a checkout (editable install, or
PYTHONPATH=service:plpython) and an installed wheel read the same files from the same
place, through importlib.resources: ``poimen_memory/migrations/`` (run once, frozen by
checksum), ``poimen_memory/sql/`` (re-applied on every deploy; "sql/" in the comments of
the code and the docs), ``poimen_core`` (the PL/Python module) and the tokenizer in
``poimen_memory/data/``.

The modules read these paths as attributes of this module (``layout.SQL_DIR``), never as
copies of their own, so a test that points migrate at a staged migrations/ or sql/ sets
them here once."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from psycopg import sql

from poimen_memory.db.queries import statements
from poimen_memory.errors import MigrationError


def _directory(package: str, *parts: str) -> Path:
    """A directory shipped in ``package``, as a real path: migrate copies poimen_core where
    the server imports it, which needs files on disk. pip installs a wheel unpacked, so this
    only fails for a zipped install (a zipapp, an egg)."""
    found = files(package).joinpath(*parts)
    if not isinstance(found, Path):
        raise MigrationError(
            f"{package}/{'/'.join(parts)} is not a directory on disk ({found!r})",
            hint="install poimen-memory unpacked (pip install), not zipped",
        )
    return found


PACKAGE = _directory("poimen_memory")
MIGRATIONS_DIR = PACKAGE / "migrations"
SQL_DIR = PACKAGE / "sql"
PLPYTHON_SRC = _directory("poimen_core")
TOKENIZER = PACKAGE / "data" / "tokenizer.json"
CATALOG = PACKAGE / "db" / "migrate" / "catalog.sql"


def catalog(name: str) -> sql.SQL:
    """migrate's statement called ``name`` (catalog.sql); a typo is a KeyError at first use."""
    return sql.SQL(statements(CATALOG)[name])
