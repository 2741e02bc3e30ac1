"""migrate's advisory locks, and the retry of a transaction refused a lock.

A deploy's transaction takes LOCK_KEY (another migrate: waiting for it blocks nobody's
query), then gives every other lock it takes a short lock_timeout: DDL queued behind a long
reader makes every later query on that table queue behind it, so an attempt gives up soon
and the whole transaction is tried again, until ``--lock-timeout`` is spent."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from poimen_memory.db.migrate.layout import catalog
from poimen_memory.errors import MigrationError

LOCK_KEY = 0x706F696D656E  # "poimen"
# Held for the session while the project graphs are built (after the transaction, whose
# advisory lock is gone by then): a second migrate waits for the first's builds instead of
# dropping an index the first is still building, which looks INVALID until it is done.
BUILD_LOCK_KEY = LOCK_KEY + 1
# Each attempt waits at most this long for a table's lock: a DDL statement queued behind a
# long reader makes every later query on that table queue behind it, so it must give up
# soon and try again later rather than wait the whole --lock-timeout.
LOCK_ATTEMPT_S = 0.5

_T = TypeVar("_T")


def objid(key: int) -> int:
    """pg_locks.objid of an advisory lock taken with this bigint key (its low 32 bits)."""
    return key & 0xFFFFFFFF


def lock(conn: psycopg.Connection[Any], wait_s: float, attempt_s: float) -> None:
    """The advisory lock (another migrate: waiting for it blocks nobody's query) within
    wait_s, then a short lock_timeout for everything else the transaction locks."""
    _lock_timeout(conn, wait_s)
    conn.execute(catalog("transaction_lock"), (LOCK_KEY,))
    _lock_timeout(conn, attempt_s)


def _lock_timeout(conn: psycopg.Connection[Any], seconds: float) -> None:
    timeout = sql.Literal(f"{max(int(seconds * 1000), 1)}ms")
    conn.execute(catalog("set_lock_timeout").format(timeout=timeout))


def waited_for(conn: psycopg.Connection[Any], exc: psycopg.errors.LockNotAvailable) -> str:
    """The statement that gave up (PostgreSQL's context names it) and the sessions holding
    locks on the schema at that moment."""
    where = (exc.diag.context or "").strip().splitlines()
    stmt = where[0] if where else (exc.diag.message_primary or str(exc)).strip()
    try:
        holders = conn.execute(catalog("lock_holders"), (objid(LOCK_KEY),)).fetchall()
    except psycopg.Error:
        holders = []
    held = "; ".join(
        f"{rel} {mode} held by pid {pid} ({user}, {state} for {age} s: {query})"
        for rel, mode, pid, user, state, age, query in holders
    )
    return f"{stmt}" + (f" -- {held}" if held else "")


def retrying(
    conn: psycopg.Connection[Any], lock_timeout_s: float, attempt: Callable[[float, float], _T]
) -> tuple[_T, list[str]]:
    """Run attempt(wait_s, attempt_s) (one transaction) until it is not refused a lock, for
    at most lock_timeout_s in all; what each refused attempt waited for is returned."""
    deadline = time.monotonic() + lock_timeout_s
    waits: list[str] = []
    pause = 0.05
    while True:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            return attempt(left, min(LOCK_ATTEMPT_S, left)), waits
        except psycopg.errors.LockNotAvailable as exc:
            waits.append(waited_for(conn, exc))
            if deadline - time.monotonic() <= pause:
                raise _lock_error(exc, lock_timeout_s, waits) from exc
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _lock_error(
    exc: psycopg.errors.LockNotAvailable, lock_timeout_s: float, waits: list[str]
) -> MigrationError:
    return MigrationError(
        f"migrate could not take a lock within {lock_timeout_s:g} s "
        f"({len(waits)} attempt{'s' if len(waits) != 1 else ''}, each waiting at most "
        f"{LOCK_ATTEMPT_S:g} s)",
        detail=f"{str(exc).strip()}; waited for: {waits[-1] if waits else '?'}",
        hint="another migrate, a long transaction or a DBA session holds a lock on the memory "
        "schema: find it in pg_stat_activity / pg_locks, or retry with a longer --lock-timeout",
    )
