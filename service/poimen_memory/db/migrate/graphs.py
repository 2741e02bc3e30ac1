"""The large projects' own HNSW graphs (sql/088_indexes.sql), the exception to migrate's one
transaction: a plain CREATE INDEX would hold writes off memory.nodes for the whole build
(minutes at a million nodes), so migrate builds them after its commit with CREATE INDEX
CONCURRENTLY, one at a time; a build that fails leaves an INVALID index, which the next
migrate drops and builds again. Also what the store has outgrown (memory.scale_warnings)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from poimen_memory.db.migrate.interface import GRAPH_BUILD_LOCK_TIMEOUT_S, GraphBuild
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.db.migrate.locks import BUILD_LOCK_KEY, objid
from poimen_memory.errors import MigrationError


def _has_function(conn: psycopg.Connection[Any], signature: str) -> bool:
    """Whether sql/ made this function here: a database migrated only to an old level (or a
    check's transaction, once it has applied sql/) may differ."""
    return conn.execute(catalog("function_exists"), (signature,)).fetchone() == (True,)


def scale_warnings(conn: psycopg.Connection[Any]) -> list[str]:
    """memory.scale_warnings(), one line each, naming the project: none on a database whose
    sql/ predates the function (a database migrated only to an old level has none)."""
    if not _has_function(conn, "memory.scale_warnings()"):
        return []
    rows = conn.execute(catalog("scale_warnings")).fetchall()
    return [
        f"{what}{'' if project is None else f' (project {project})'}: {hint}"
        for project, what, hint in rows
    ]


def missing_project_graphs(conn: psycopg.Connection[Any]) -> list[tuple[str, int, str, str]]:
    """memory._missing_project_graphs(): (index, project id, state, CREATE INDEX CONCURRENTLY
    statement) of each large project's graph that is missing, invalid or differs; none on a
    database whose sql/ predates the function."""
    if not _has_function(conn, "memory._missing_project_graphs()"):
        return []
    rows = conn.execute(catalog("missing_graphs")).fetchall()
    return [(str(n), int(p), str(s), str(stmt)) for n, p, s, stmt in rows]


def build_project_graphs(
    conn: psycopg.Connection[Any],
    *,
    lock_timeout_s: float = GRAPH_BUILD_LOCK_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> list[GraphBuild]:
    """Build the large projects' own HNSW graphs that are missing, invalid or differ
    (memory._missing_project_graphs, the one place they are defined) with CREATE INDEX
    CONCURRENTLY, so writes to memory.nodes go on during the build. Must run outside a
    transaction block (migrate runs it after its commit; so does reembed, and the bench
    after its load). An invalid or different index is dropped (DROP INDEX CONCURRENTLY)
    first. progress: told one line before each build and one after it, with its time."""
    tell = progress or (lambda _line: None)
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        if missing_project_graphs(conn):
            raise MigrationError(
                "the large projects' own HNSW graphs are built with CREATE INDEX CONCURRENTLY,"
                " which cannot run inside a transaction block",
                hint="call build_project_graphs on a connection with no transaction open",
            )
        return []
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        if not missing_project_graphs(conn):
            return []
        return _build(conn, lock_timeout_s, tell)
    finally:
        with contextlib.suppress(psycopg.Error):
            conn.autocommit = autocommit


def _build(
    conn: psycopg.Connection[Any], lock_timeout_s: float, tell: Callable[[str], None]
) -> list[GraphBuild]:
    saved = conn.execute(catalog("session_timeouts")).fetchone()
    assert saved is not None
    built: list[GraphBuild] = []
    try:
        # A build of minutes must not be cut short by a role's statement_timeout.
        conn.execute(
            catalog("set_session_timeouts"), (f"{max(int(lock_timeout_s * 1000), 1)}ms", "0")
        )
        _build_lock(conn, lock_timeout_s, tell)
        try:
            # Again under the lock: a migrate waited for may have built them meanwhile.
            for name, project_id, state, statement in missing_project_graphs(conn):
                tell(
                    f"building memory.{name} (project {project_id}, {state}) with CREATE INDEX"
                    " CONCURRENTLY: writes to memory.nodes go on meanwhile"
                )
                t0 = time.monotonic()
                try:
                    if state != "missing":
                        drop = catalog("drop_index_concurrently")
                        conn.execute(drop.format(index=sql.Identifier(name)))
                    conn.execute(statement.encode())
                except psycopg.Error as exc:
                    raise _build_error(name, exc, lock_timeout_s) from exc
                done = GraphBuild(name, project_id, state, time.monotonic() - t0)
                built.append(done)
                tell(f"built {done.line()}")
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.execute(catalog("build_unlock"), (BUILD_LOCK_KEY,))
    finally:
        with contextlib.suppress(psycopg.Error):
            conn.execute(catalog("set_session_timeouts"), (saved[0], saved[1]))
    return built


def _build_lock(
    conn: psycopg.Connection[Any], lock_timeout_s: float, tell: Callable[[str], None]
) -> None:
    """The session's build lock (BUILD_LOCK_KEY), waiting at most lock_timeout_s (the
    session's lock_timeout) for a session that holds it, named."""
    got = conn.execute(catalog("build_lock_try"), (BUILD_LOCK_KEY,)).fetchone()
    if got == (True,):
        return
    holder = conn.execute(catalog("build_lock_holders"), (objid(BUILD_LOCK_KEY),)).fetchone()
    who = f"pid {holder[0]}" if holder and holder[0] else "another session"
    tell(f"waiting for {who}, which is building project graphs")
    try:
        conn.execute(catalog("build_lock"), (BUILD_LOCK_KEY,))
    except psycopg.errors.LockNotAvailable as exc:
        raise MigrationError(
            f"another migrate ({who}) has been building the large projects' own HNSW graphs"
            f" for more than {lock_timeout_s:g} s",
            detail="migrate's transaction had committed: the schema is migrated; the graphs"
            " are that session's to build",
            hint="let it finish (pg_stat_progress_create_index shows how far it is), then run"
            " poimen-memory migrate again, or raise --build-lock-timeout",
        ) from exc


def _build_error(name: str, exc: psycopg.Error, lock_timeout_s: float) -> MigrationError:
    waited = isinstance(exc, psycopg.errors.LockNotAvailable)
    return MigrationError(
        f"building the project graph memory.{name} failed: {str(exc).strip()}",
        detail="migrate's transaction had committed: the schema is migrated, and queries of"
        " the project read the shared graph meanwhile; the failed CREATE INDEX CONCURRENTLY"
        " may leave the index INVALID (pg_index.indisvalid false, never read by the planner),"
        " which the next migrate drops and builds again",
        hint=(
            f"the build waited more than {lock_timeout_s:g} s for a lock or for a transaction"
            " older than it (a long or idle-in-transaction session in pg_stat_activity):"
            " end it, or raise --build-lock-timeout, and run poimen-memory migrate again"
            if waited
            else "run poimen-memory migrate again once the cause is fixed"
        ),
    )
