"""sql/ re-applied on every deploy: each file rendered for this database and run, then the
search_path of every function it (re)created pinned.

pgvector may live in any schema (``CREATE EXTENSION vector SCHEMA extensions``): migrate
finds it, creates the functions with that schema on the session's search_path and pins it
in the ``search_path`` of every function that names ``public`` or sets none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import poimen_memory.db.migrate.layout as layout
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.migrate.plpython import plpython_status
from poimen_memory.db.migrate.render import render_sql
from poimen_memory.db.roles import Roles

# A table made at the transaction's start: its pg_class row carries the transaction's xid,
# as does the pg_proc row of every function the transaction (re)creates.
_MARK = "pg_temp.poimen_xact_mark"


def vector_schema(conn: psycopg.Connection[Any]) -> str | None:
    """The schema pgvector is installed in; None where it is not installed."""
    row = conn.execute(catalog("vector_schema")).fetchone()
    return None if row is None else str(row[0])


def use_vector_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    path = ["public"] if schema == "public" else ["public", schema]
    conn.execute(
        catalog("set_search_path").format(path=sql.SQL(", ").join(map(sql.Identifier, path)))
    )


def touched() -> sql.Composed:
    """The functions sql/ owns that this transaction (re)created (after apply_sql_files)."""
    functions = catalog("our_functions")
    return catalog("touched_functions").format(functions=functions, mark=sql.Literal(_MARK))


# The functions PostgreSQL must inline into the statements that call them (the planner
# inlines no function with a SET clause): they get no search_path, and name everything they
# call schema-qualified instead (sql/019_visibility.sql, sql/020_lexical.sql,
# sql/055_support.sql; tests/test_sql_hygiene.py). memory._bm25_score runs once per scored
# document: called, it cost a lexical leg 1.7 ms of 3.4 on LoCoMo (docs/benchmarks.md).
# memory._rests_on is the provenance walks' test of an edge and its parent version: inlined,
# the edge's part filters the edge's scan. memory._asserting is the membership test of every
# row-level security check (memory._granted_ids, 20 to 30 a query); memory._plan_cache_mode
# the layout's plan_cache_mode, read by each stage that sets it.
INLINED = frozenset(
    {
        "memory._visible",
        "memory._bm25_score",
        "memory._rests_on",
        "memory._asserting",
        "memory._plan_cache_mode",
    }
)


def _pin_search_path(conn: psycopg.Connection[Any], schema: str) -> None:
    """Every function sql/ defines gets a fixed search_path: the one in its file (public
    already replaced by pgvector's schema), or, where a file sets none, pg_catalog +
    pgvector's schema (pg_catalog only for SECURITY DEFINER functions); not the INLINED
    predicates."""
    for signature, secdef, config in conn.execute(touched()).fetchall():
        if any(c.startswith("search_path=") for c in config or []):
            continue
        if str(signature).split("(", 1)[0] in INLINED:
            continue
        parts = ["pg_catalog", "pg_temp"] if secdef else ["pg_catalog", schema, "pg_temp"]
        conn.execute(
            catalog("pin_search_path").format(
                function=sql.SQL(signature),
                path=sql.SQL(", ").join(sql.Identifier(p) for p in parts),
            )
        )


def apply_sql_files(conn: psycopg.Connection[Any], schema: str, roles: Roles) -> list[Path]:
    files = sorted(layout.SQL_DIR.glob("*.sql"))
    conn.execute(catalog("mark_transaction").format(mark=sql.SQL(_MARK)))
    installed, _ = plpython_status(conn)
    # pgvector's hnsw.* settings exist once its library is loaded in this backend; before,
    # they are placeholders, which `SET hnsw.ef_search` in a function's definition may name
    # only as a superuser (42501). Reading a vector loads the library.
    conn.execute(catalog("load_pgvector"))
    for path in files:
        text = render_sql(path.read_text(), path, roles=roles, schema=schema, plpython=installed)
        conn.execute(text.encode())
    _pin_search_path(conn, schema)
    if schema not in ("public", "pg_catalog"):
        # Readers resolve pgvector's type and operators through its schema.
        conn.execute(
            catalog("grant_vector_schema").format(
                schema=sql.Identifier(schema), role=sql.Identifier(roles.reader)
            )
        )
    return files
