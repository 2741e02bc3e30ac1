"""Named SQL statements, parsed once from queries.sql (one place for every query we send)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from psycopg import sql

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def _all() -> dict[str, str]:
    text = (Path(__file__).with_name("queries.sql")).read_text()
    parts = _NAME.split(text)
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def q(name: str) -> sql.SQL:
    """The statement called ``name``; a typo is a KeyError at first use, caught by tests."""
    return sql.SQL(_all()[name])


def names() -> list[str]:
    return sorted(_all())
