"""This database's roles (db/roles.py): chosen at its first migrate, recorded in
memory.config (role_prefix), then kept; a database migrated before roles were per database
moves from the cluster-wide memory_reader trio to its own."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.roles import KINDS, LEGACY, Roles, prefix_for
from poimen_memory.errors import MigrationError


def _recorded_prefix(conn: psycopg.Connection[Any]) -> str | None:
    """The prefix this database's first migrate recorded; None before it."""
    row = conn.execute(catalog("relation_exists"), ("memory.config",)).fetchone()
    if row is None or not row[0]:
        return None
    found = conn.execute(catalog("recorded_prefix")).fetchone()
    return None if found is None else str(found[0])


def _default_prefix(conn: psycopg.Connection[Any]) -> str:
    name = conn.execute(catalog("current_database")).fetchone()
    assert name is not None
    return prefix_for(str(name[0]))


def database_roles(conn: psycopg.Connection[Any], configured: str | None = None) -> Roles:
    """The roles the sql/ files name in this database: the recorded ones, else those its
    first migrate would choose (``configured``: POIMEN_ROLE_PREFIX)."""
    recorded = _recorded_prefix(conn)
    return Roles(recorded if recorded is not None else configured or _default_prefix(conn))


def choose_roles(
    conn: psycopg.Connection[Any], configured: str | None
) -> tuple[Roles, Roles | None, bool]:
    """This database's roles; the cluster-wide ones its grants and members move from when
    it was migrated before roles were per database; whether its prefix is recorded. The
    first migrate records it (record_roles: POIMEN_ROLE_PREFIX, else the database's name),
    so the names then follow the data through a dump and restore under another name."""
    recorded = _recorded_prefix(conn)
    if recorded is not None:
        stored = Roles(recorded)
        if configured is not None and configured != stored.prefix:
            raise MigrationError(
                f"POIMEN_ROLE_PREFIX is {configured}, but this database's roles have the"
                f" prefix {stored.prefix}",
                detail=f"its roles are {', '.join(stored.all)}, recorded in memory.config"
                " (role_prefix) at its first migrate",
                hint=f"unset POIMEN_ROLE_PREFIX for this database, or set it to {stored.prefix}",
            )
        return stored, None, True
    roles = Roles(configured or _default_prefix(conn))
    legacy = conn.execute(catalog("legacy_roles_here")).fetchone()
    moving = legacy is not None and bool(legacy[0]) and roles != LEGACY
    return roles, (LEGACY if moving else None), False


def record_roles(conn: psycopg.Connection[Any], roles: Roles) -> None:
    conn.execute(catalog("record_prefix"), (roles.prefix,))


def move_roles(conn: psycopg.Connection[Any], old: Roles, new: Roles, schema: str) -> list[str]:
    """The move from the cluster-wide roles (every database's memory_reader trio) to this
    database's own, after sql/ granted the new ones: each direct member of an old role gets
    the new one, so nobody loses what they had here; the project grants follow; the old
    roles keep nothing here, so a role made for another database and granted one of them
    later gains nothing here. The members are named: those made for another database
    should have the new role revoked."""
    told: list[str] = []
    ours = list(old.all) + list(new.all)
    for kind in KINDS:
        was, now = old.name(kind), new.name(kind)
        if conn.execute(catalog("role_exists"), (was,)).fetchone() == (None,):
            continue
        members = [str(r[0]) for r in conn.execute(catalog("role_members"), (was, ours))]
        for member in members:
            grant = catalog("grant_role")
            conn.execute(grant.format(role=sql.Identifier(now), member=sql.Identifier(member)))
        conn.execute(catalog("move_project_grants"), (now, was))
        conn.execute(catalog("drop_project_grants"), (was,))
        _revoke_all(conn, sql.Identifier(was), schema)
        if members:
            told.append(
                f"this database's roles are its own now: {now} in place of the cluster-wide"
                f" {was}, whose members here were granted {now}: {', '.join(members)}."
                f" {was} is shared by every database of the cluster: revoke {now} from any"
                " of them made for another database"
            )
    return told


def _revoke_all(conn: psycopg.Connection[Any], role: sql.Identifier, schema: str) -> None:
    """An old role keeps nothing in this database: its privileges on the schema, what is in
    it, the public.memory_* aliases and pgvector's schema."""
    for what in ("TABLES", "FUNCTIONS", "SEQUENCES"):
        conn.execute(catalog("revoke_all_in_schema").format(kind=sql.SQL(what), role=role))
    conn.execute(catalog("revoke_schema").format(role=role))
    for (fn,) in conn.execute(catalog("public_aliases")).fetchall():
        conn.execute(catalog("revoke_function").format(function=sql.SQL(fn), role=role))
    if schema not in ("public", "pg_catalog"):
        conn.execute(
            catalog("revoke_vector_schema").format(schema=sql.Identifier(schema), role=role)
        )


def shared_roles(conn: psycopg.Connection[Any], roles: Roles, shown: int = 5) -> list[str]:
    """This database's roles holding privileges in other databases too (a TEMPLATE copy
    of this one, or one given the same POIMEN_ROLE_PREFIX): a grant made to them here
    reaches there. One warning, naming the first few of those databases."""
    rows = conn.execute(catalog("shared_roles"), (list(roles.all),))
    dbs = sorted({str(db) for _role, db in rows})
    if not dbs:
        return []
    named = ", ".join(dbs[:shown]) + (f" and {len(dbs) - shown} more" if len(dbs) > shown else "")
    return [
        f"this database's roles ({', '.join(roles.all)}) also hold privileges in {named}:"
        " a grant made to them in one database reaches the others (a database gets roles of"
        " its own from POIMEN_ROLE_PREFIX at its first migrate)"
    ]
