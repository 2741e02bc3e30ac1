"""Named SQL statements, parsed once from queries.sql (one place for every query we send).

migrate's own statements are a file of the same form beside it (db/migrate/catalog.sql),
read through ``statements`` too."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from psycopg import sql

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
QUERIES = Path(__file__).with_name("queries.sql")


@cache
def statements(path: Path = QUERIES) -> dict[str, str]:
    """The statements of a file of ``-- name: NAME`` sections, by name."""
    parts = _NAME.split(path.read_text())
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def q(name: str) -> sql.SQL:
    """The statement called ``name``; a typo is a KeyError at first use, caught by tests."""
    return sql.SQL(statements()[name])


def names() -> list[str]:
    return sorted(statements())
