"""`migrate --check`: drift between the database and migrations/ + sql/, changing nothing.

sql/ is applied inside a transaction that is rolled back, and every function whose
definition (body, settings, comment) differs from what the files produce is listed, with
every difference in what protects the data (row-level security, policies, indexes,
triggers, the grants to PUBLIC and the product's roles, default privileges and the
product's keys in memory.config): the state before, compared with the state the files
leave."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from poimen_memory.db.migrate.apply import (
    apply_sql_files,
    touched,
    use_vector_schema,
    vector_schema,
)
from poimen_memory.db.migrate.graphs import missing_project_graphs, scale_warnings
from poimen_memory.db.migrate.interface import DriftReport
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.migrate.ledger import AHEAD_HINT, pending_migrations, unknown_migrations
from poimen_memory.db.migrate.locks import lock, retrying
from poimen_memory.db.migrate.owners import current_role, foreign_findings, repair_owners
from poimen_memory.db.migrate.plpython import (
    Placement,
    module_findings,
    placement,
    plpython_findings,
    write_config,
)
from poimen_memory.db.migrate.roles import choose_roles, move_roles, record_roles, shared_roles
from poimen_memory.db.roles import Roles

Protection = dict[tuple[str, str], str]


def _snapshot(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Each of our functions' signature, and a digest of its definition."""
    query = catalog("function_snapshot").format(functions=catalog("our_functions"))
    return {str(s): str(d) for s, d in conn.execute(query)}


def _protection(conn: psycopg.Connection[Any], *roles: Roles) -> Protection:
    """What protects the data, for PUBLIC and the given roles' privileges (this database's,
    and the shared ones it moves away from)."""
    names = sorted({n for r in roles for n in r.all})
    grantees = sql.SQL(", ").join(sql.Literal(n) for n in names)
    rows = conn.execute(catalog("protection").format(grantees=grantees)).fetchall()
    return {(str(r[0]), str(r[1])): str(r[2]) for r in rows}


def _findings(before: Protection, after: Protection) -> list[str]:
    """One line per difference: what the database has, and what sql/ makes of it."""

    def short(v: str) -> str:
        return v if len(v) <= 240 else v[:237] + "..."

    out: list[str] = []
    for key in sorted(before.keys() | after.keys()):
        kind, obj = key
        if key not in after:
            out.append(f"{kind} not from sql/ (migrate removes it): {obj}: {short(before[key])}")
        elif key not in before:
            out.append(f"{kind} missing (migrate restores it): {obj}: {short(after[key])}")
        elif before[key] != after[key]:
            out.append(
                f"{kind} changed by hand: {obj}: {short(before[key])}"
                f" (migrate makes it: {short(after[key])})"
            )
    return out


def check(
    conn: psycopg.Connection[Any],
    *,
    lock_timeout_s: float = 10.0,
    plpython_root: Path | None = None,
    role_prefix: str | None = None,
    where: Placement | None = None,
) -> DriftReport:
    """Compare the database with migrations/ and sql/ without changing it. where: where
    migrate would have the server import PL/Python from (placement(); plpython_root is its
    shorthand, migrate's argument): memory.config is compared with what migrate writes for
    it. Without either only the recorded keys' consistency is (a caller that does not say)."""
    if where is None and plpython_root is not None:
        where = placement(plpython_root)

    def attempt(wait_s: float, attempt_s: float) -> DriftReport:
        with conn.transaction(force_rollback=True):
            lock(conn, wait_s, attempt_s)
            ahead = unknown_migrations(conn)
            if ahead:  # this code's sql/ is older than the schema: nothing else compares
                return DriftReport(
                    [],
                    [],
                    [],
                    [],
                    findings=[
                        f"migration in the database this code does not know (migrate refuses"
                        f" it: {AHEAD_HINT}): {v}"
                        for v in ahead
                    ],
                )
            pending = pending_migrations(conn)
            if pending:  # the files need the pending migrations' tables: report those only
                return DriftReport(pending, [], [], [])
            schema = vector_schema(conn) or "public"
            use_vector_schema(conn, schema)
            before = _snapshot(conn)
            roles, move_from, kept = choose_roles(conn, role_prefix)
            compared = (roles,) if move_from is None else (roles, move_from)
            protected = _protection(conn, *compared)
            # Given back as migrate does (or left, where this role may not), so that sql/
            # applies and what follows compares with what migrate makes.
            owners = repair_owners(conn)
            if not kept:  # a finding: "config missing (migrate restores it)"
                record_roles(conn, roles)
            found = plpython_findings(conn, where)
            if where is not None:
                write_config(conn, where)
            conn.execute(catalog("check_mark"))
            try:
                with conn.transaction():
                    apply_sql_files(conn, schema, roles)
                    if move_from is not None:
                        move_roles(conn, move_from, roles, schema)
            except psycopg.errors.InsufficientPrivilege as exc:
                # An object of the product this role may not give back: named above.
                return DriftReport(
                    [],
                    [],
                    [],
                    [],
                    findings=[
                        *owners.findings,
                        f"sql/ not compared: {current_role(conn)} may not apply it"
                        f" ({exc.diag.message_primary}); migrate fails alike until a person"
                        " changes what is named above",
                    ],
                )
            after = _snapshot(conn)
            mine = {str(r[0]) for r in conn.execute(touched())}
            found = (
                foreign_findings(conn, compared, mine)
                + owners.findings
                + _findings(protected, _protection(conn, *compared))
                + found
                + module_findings(conn)
            )
            # sql/ as it would be applied: the function exists here even before migrate.
            outgrown = scale_warnings(conn)
            graphs = [
                f"memory.{name} (project {project_id}): {state}"
                for name, project_id, state, _ in missing_project_graphs(conn)
            ]
        return DriftReport(
            pending_migrations=[],
            changed=sorted(s for s in after if s in before and before[s] != after[s]),
            missing=sorted(s for s in after if s not in before),
            extra=sorted(s for s in before if s not in mine),
            findings=found,
            warnings=shared_roles(conn, roles),
            scale_warnings=outgrown,
            project_graphs=graphs,
        )

    report, waits = retrying(conn, lock_timeout_s, attempt)
    return replace(report, lock_waits=waits)
