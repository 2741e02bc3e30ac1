"""`poimen-memory migrate`: the versioned migrations once, then sql/ again, in one
transaction under the advisory lock (locks.py), so a failed deploy leaves the database as it
was and two concurrent deploys serialise; then, committed, the large projects' own graphs
(graphs.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

import poimen_memory.db.migrate.layout as layout
from poimen_memory.db.migrate.apply import (
    apply_sql_files,
    touched,
    use_vector_schema,
    vector_schema,
)
from poimen_memory.db.migrate.graphs import build_project_graphs, scale_warnings
from poimen_memory.db.migrate.interface import GRAPH_BUILD_LOCK_TIMEOUT_S, MigrateReport
from poimen_memory.db.migrate.ledger import apply_pending, create_ledger
from poimen_memory.db.migrate.locks import lock, retrying
from poimen_memory.db.migrate.owners import foreign_findings, repair_owners
from poimen_memory.db.migrate.plpython import (
    install_plpython,
    module_root,
    placement,
    plpython_status,
    record_module,
    remove_old_copies,
    server_python_deps,
)
from poimen_memory.db.migrate.roles import choose_roles, move_roles, record_roles, shared_roles
from poimen_memory.db.roles import Roles
from poimen_memory.errors import MigrationError


def migrate(
    conn: psycopg.Connection[Any],
    plpython_root: Path | None,
    *,
    lock_timeout_s: float = 10.0,
    role_prefix: str | None = None,
    build_lock_timeout_s: float = GRAPH_BUILD_LOCK_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
    embedder_packages: Path | None = None,
    build_graphs: bool = True,
) -> MigrateReport:
    """Migrations, then sql/, in one transaction; then, committed, the large projects' own
    HNSW graphs that are missing (build_project_graphs: concurrently, each waiting at most
    build_lock_timeout_s; progress is told of each). role_prefix: POIMEN_ROLE_PREFIX, used by
    the first migrate of a database only (db/roles.py). plpython_root: a directory of this
    host the database server reads, where poimen_core is installed for it (None: the server
    imports it from the database alone, and a path recorded before is removed);
    embedder_packages: where the embedder's packages are on the database host (placement).
    build_graphs=False: the transaction only (script.py: a psql script holds no
    CONCURRENTLY build)."""
    for d in (layout.MIGRATIONS_DIR, layout.SQL_DIR):
        if not d.is_dir():
            raise MigrationError(
                f"{d} does not exist",
                hint="the package ships it (poimen_memory/migrations, poimen_memory/sql):"
                " reinstall poimen-memory",
            )
    where = placement(plpython_root, embedder_packages)
    plpython_root = module_root(plpython_root)
    py_target = None if plpython_root is None else install_plpython(plpython_root)
    if plpython_root is not None and embedder_packages is None:
        server_python_deps(plpython_root.parent)  # copies them where deps_target said
    py_path = None if py_target is None else str(py_target)
    deps = where.deps

    def attempt(
        wait_s: float, attempt_s: float
    ) -> tuple[list[str], list[str], list[str], str, list[Path], Roles, list[str]]:
        notices: list[str] = []
        with conn.transaction():
            lock(conn, wait_s, attempt_s)
            create_ledger(conn)
            # The product's objects back to schema memory's owner first: migrate re-creates
            # and alters them, which only their owner may.
            owners = repair_owners(conn)
            if owners.left:
                raise MigrationError(
                    "objects of the product are owned by a role this one may not take them from",
                    detail="\n".join(owners.left),
                    hint="run the statements named (as a superuser, or a member of both"
                    " roles), then migrate again",
                )
            notices.extend(f"repaired: {line}" for line in owners.findings)
            # Independent of the session's search_path (even ''): public, plus pgvector's schema.
            use_vector_schema(conn, vector_schema(conn) or "public")
            applied, already = apply_pending(conn, notices)
            schema = vector_schema(conn) or "public"
            use_vector_schema(conn, schema)
            record_module(conn, where)
            roles, move_from, kept = choose_roles(conn, role_prefix)
            if not kept:
                record_roles(conn, roles)
            sql_files = apply_sql_files(conn, schema, roles)
            if move_from is not None:
                notices.extend(move_roles(conn, move_from, roles, schema))
            mine = {str(r[0]) for r in conn.execute(touched())}
            compared = (roles,) if move_from is None else (roles, move_from)
            # Not the product's to drop: named, for a person (`migrate --check` too).
            left = foreign_findings(conn, compared, mine)
        return applied, already, notices, schema, sql_files, roles, left

    (applied, already, notices, schema, sql_files, roles, left), waits = retrying(
        conn, lock_timeout_s, attempt
    )
    graphs = (
        build_project_graphs(conn, lock_timeout_s=build_lock_timeout_s, progress=progress)
        if build_graphs
        else []
    )
    installed, _ = plpython_status(conn)
    removed: list[str] = []
    if plpython_root is not None and py_target is not None:
        removed = remove_old_copies(plpython_root, py_target)
    return MigrateReport(
        applied,
        already,
        [p.name for p in sql_files],
        py_path,
        schema,
        removed,
        None if deps is None else str(deps),
        notices,
        waits,
        installed,
        roles,
        [*left, *shared_roles(conn, roles)],
        scale_warnings(conn),
        graphs,
    )
