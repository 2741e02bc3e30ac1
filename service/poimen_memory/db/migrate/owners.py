"""The product's own objects and who owns them, and the objects in its schema it did not
make that its roles can use anyway (issue 44).

The product's tables are those migrations/ creates (and the ledger), with their partitions;
its functions those sql/ defines. Each belongs to the owner of schema memory: a table owned
by another role is that role's to read around row-level security and to alter, and migrate
(which must own what it re-creates) gives it back. An object in the schema that is not the
product's but that PUBLIC or one of its roles may use is a way around row-level security
when it reads a protected table as its owner (a view, a SECURITY DEFINER function): not the
product's to drop, so --check names it and migrate leaves it to a person."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

import poimen_memory.db.migrate.layout as layout
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.roles import Roles

# The files write their DDL upper case (a case-blind search finds no more).
_CREATE_TABLE = re.compile(r"\bCREATE TABLE (?:IF NOT EXISTS )?memory\.(\w+)")
_CREATE_FUNCTION = re.compile(
    r"\bCREATE (?:OR REPLACE )?(?:FUNCTION|PROCEDURE|AGGREGATE) (memory\.\w+|public\.memory_\w+)"
)


def product_tables() -> list[str]:
    """The tables the product makes: the ledger, and each one a migration creates."""
    names = {"schema_migrations"}
    for path in sorted(layout.MIGRATIONS_DIR.glob("*.sql")):
        names.update(_CREATE_TABLE.findall(path.read_text()))
    return sorted(names)


def product_functions() -> list[str]:
    """The schema-qualified names of the functions sql/ defines (every overload)."""
    names: set[str] = set()
    for path in sorted(layout.SQL_DIR.glob("*.sql")):
        names.update(_CREATE_FUNCTION.findall(path.read_text()))
    return sorted(names)


@dataclass(frozen=True)
class WrongOwner:
    kind: str  # TABLE or FUNCTION
    name: str  # as ALTER ... OWNER takes it
    owner: str
    wanted: str  # the owner of schema memory

    def finding(self) -> str:
        return (
            f"owner changed by hand: {self.kind} {self.name}: {self.owner} (migrate makes it:"
            f" {self.wanted}, the owner of schema memory)"
        )

    def statement(self) -> sql.Composed:
        # ROUTINE: a function, a procedure or an aggregate alike.
        return catalog("alter_owner").format(
            kind=sql.SQL("ROUTINE" if self.kind == "FUNCTION" else self.kind),
            name=sql.SQL(self.name),
            owner=sql.Identifier(self.wanted),
        )


def wrong_owners(conn: psycopg.Connection[Any]) -> list[WrongOwner]:
    """The product's tables (and partitions) and functions not owned by schema memory's
    owner."""
    rows = conn.execute(
        catalog("wrong_owners"), {"tables": product_tables(), "functions": product_functions()}
    ).fetchall()
    return [WrongOwner(str(k), str(n), str(o), str(w)) for k, n, o, w in rows]


@dataclass(frozen=True)
class OwnerRepair:
    findings: list[str]
    """One line per object of the product another role owned: given back, or (this role
    may not: it must be a member of both roles, or a superuser) the statement a person runs."""
    left: list[str]
    """The lines of those not given back."""


def repair_owners(conn: psycopg.Connection[Any]) -> OwnerRepair:
    """Give each of the product's objects back to schema memory's owner, each in a
    savepoint, so that one this role may not change leaves the others repaired."""
    findings: list[str] = []
    left: list[str] = []
    for w in wrong_owners(conn):
        try:
            with conn.transaction():
                conn.execute(w.statement())
            findings.append(w.finding())
        except psycopg.errors.InsufficientPrivilege as exc:
            line = (
                f"{w.finding()}; {current_role(conn)} may not change it"
                f" ({exc.diag.message_primary}): a superuser runs"
                f" {w.statement().as_string(conn)}"
            )
            findings.append(line)
            left.append(line)
    return OwnerRepair(findings, left)


def current_role(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(catalog("current_role")).fetchone()
    assert row is not None
    return str(row[0])


def foreign_findings(
    conn: psycopg.Connection[Any], roles: tuple[Roles, ...], mine: set[str]
) -> list[str]:
    """Each view, table, sequence or function in schema memory that the product did not
    make (mine: the functions this transaction's sql/ made) and that PUBLIC or one of the
    product's roles may use; those that read around row-level security first."""
    grantees = sorted({n for r in roles for n in r.all})
    rows = conn.execute(
        catalog("foreign_usable"), {"tables": product_tables(), "grantees": grantees}
    ).fetchall()
    found: list[tuple[bool, str]] = []
    for kind, name, users, owner, bypass in rows:
        if kind == "FUNCTION" and name in mine:
            continue
        how = f": {bypass}" if bypass else ""
        found.append(
            (
                not bypass,
                f"not from the product, usable by {users} (migrate leaves it to a person: drop"
                f" it or revoke): {kind} {name} owned by {owner}{how}",
            )
        )
    return [line for _, line in sorted(found)]
