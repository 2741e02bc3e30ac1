"""Where migrate finds what it applies, and its own named statements.

The modules read these paths as attributes of this module (``layout.SQL_DIR``), never as
copies of their own, so a test that points migrate at a staged migrations/ or sql/ sets
them here once."""

from __future__ import annotations

from pathlib import Path

from psycopg import sql

from poimen_memory.db.queries import statements

ROOT = Path(__file__).resolve().parents[4]
MIGRATIONS_DIR = ROOT / "migrations"
SQL_DIR = ROOT / "sql"
PLPYTHON_SRC = ROOT / "plpython" / "poimen_core"
TOKENIZER = ROOT / "service" / "poimen_memory" / "data" / "tokenizer.json"
CATALOG = Path(__file__).with_name("catalog.sql")


def catalog(name: str) -> sql.SQL:
    """migrate's statement called ``name`` (catalog.sql); a typo is a KeyError at first use."""
    return sql.SQL(statements(CATALOG)[name])
