"""Connections: the database URL (explicit or the embedded cluster), plain connections and
the service's pool, all with pgvector's types registered, and the Lender that hands out the
pool's connections within a request's deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from pgvector.psycopg import register_vector, register_vector_async
from psycopg import sql
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.queries import q
from poimen_memory.errors import DatabaseUnavailable, DeadlineExceeded
from poimen_memory.settings import Settings


def embedded_cluster(settings: Settings) -> Cluster:
    return Cluster(
        data_dir=settings.data_dir,
        socket_dir=settings.socket_dir,
        port=settings.pg_port,
        bin_dir=find_pg_bin(settings.pg_bin_dir, settings.setup_state),
        service_role=settings.service_role,
    )


def embedded_replica(settings: Settings) -> Cluster:
    """The embedded cluster's streaming standby: its own data, socket and port."""
    return Cluster(
        data_dir=settings.replica_home / "pgdata",
        socket_dir=settings.replica_home / "run",
        port=settings.replica_port,
        bin_dir=find_pg_bin(settings.pg_bin_dir, settings.setup_state),
        service_role=settings.service_role,
    )


def database_url(settings: Settings, *, start: bool = False) -> str:
    """The configured URL; otherwise the embedded cluster's (started first when ``start``)."""
    if settings.database_url:
        return settings.database_url
    cluster = embedded_cluster(settings)
    if start and not cluster.running():
        cluster.start()
    return cluster.url()


def service_database_url(settings: Settings) -> str:
    """What `serve` connects as: POIMEN_SERVICE_DATABASE_URL; else POIMEN_DATABASE_URL (a
    DBA's cluster: give it a member of the database's service role, docs/security.md);
    else the embedded cluster's service role, never its superuser."""
    if settings.service_database_url:
        return settings.service_database_url
    if settings.database_url:
        return settings.database_url
    return embedded_cluster(settings).url(user=settings.service_role)


def ensure_service_login(conn: psycopg.Connection[Any], role: str) -> None:
    """The embedded cluster's login role for the service (peer authentication maps the
    server's OS user to it): a member of this database's service role, which migrate has
    created (memory.roles())."""
    roles = conn.execute(q("database_roles")).fetchone()
    assert roles is not None
    ident = {"role": sql.Identifier(role), "group": sql.Identifier(str(roles[2]))}
    row = conn.execute(q("service_role_exists"), {"role": role}).fetchone()
    if row is None or not row[0]:
        conn.execute(q("create_service_login").format(role=ident["role"]))
    conn.execute(q("grant_service_role").format(**ident))


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, **kwargs)
    # The vector extension does not exist until the first migrate.
    with contextlib.suppress(psycopg.ProgrammingError):
        register_vector(conn)
    return conn


async def configure_async(conn: psycopg.AsyncConnection[Any]) -> None:
    # Before the first migrate there is no vector type; statements then fail with a typed
    # "not migrated" error instead of the pool failing to open for its whole timeout.
    with contextlib.suppress(psycopg.ProgrammingError):
        await register_vector_async(conn)


class _CheckWhenIdle:
    """The pool's check, run on a connection lent last ``idle_s`` or more ago (so idle at
    least since then: one a server restart may have killed) rather than at every checkout:
    a busy service then spends no round trip per query on it. No ``reset`` callback: the
    pool would send every returned connection through a worker task for it."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.lent: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], float] = (
            weakref.WeakKeyDictionary()
        )

    async def check(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        at = self.lent.get(conn)
        if at is None or now - at >= self.idle_s:
            await AsyncConnectionPool.check_connection(conn)
        self.lent[conn] = now


def _configure(
    statement_timeout_s: float | None,
) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await configure_async(conn)
        if statement_timeout_s is not None:
            # A bound for a statement whose client went away; the request's own deadline
            # cancels earlier (pipeline.py).
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, false)",
                (str(int(statement_timeout_s * 1000)),),
            )

    return configure


def open_pool(
    url: str,
    *,
    min_size: int,
    max_size: int,
    statement_timeout_s: float | None = None,
    check_idle_s: float = 1.0,
) -> AsyncConnectionPool[Any]:
    """An autocommit pool (a read is one statement, one round trip, no transaction) that
    checks a connection idle for check_idle_s before lending it, so one killed by a server
    restart is replaced, not used."""
    idle = _CheckWhenIdle(check_idle_s)
    return AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        configure=_configure(statement_timeout_s),
        check=idle.check,
        open=False,
        kwargs={"autocommit": True},
    )


class Remaining(Protocol):
    """A request's deadline, as far as borrowing a connection goes (retrieval/deadline.py)."""

    def remaining(self) -> float: ...


@dataclass
class Lender:
    """Lends the service's pooled connections within a request's deadline: the queries'
    (retrieval/pipeline.py, on the primary or a read replica's pool) and the API's own
    (api/auth.py's keys, api/nodes.py). Built with the pool by services.open_services."""

    pool: AsyncConnectionPool[Any]
    pool_timeout_s: float
    """POIMEN_POOL_TIMEOUT_S: how long a pool with no connection at all may take to get one
    before the database counts as down."""
    # Whether a pool's server answers, per pool, shared for a second (_database_answers).
    _probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _probes: dict[int, tuple[float, bool]] = field(default_factory=dict, init=False, repr=False)

    @contextlib.asynccontextmanager
    async def connection(
        self, deadline: Remaining, stage: str, pool: AsyncConnectionPool[Any] | None = None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection of ``pool`` (default: the primary's) within the deadline. A pool that
        has no connection at all after POIMEN_POOL_TIMEOUT_S means the database is down (503
        at once, not at the deadline); a pool whose connections are all busy is only slow, so
        the request waits for the rest of its deadline and then reports a timeout."""
        pool = pool or self.pool
        # Decide before the deadline does, so the answer is "unavailable", not "timeout".
        first = min(deadline.remaining() * 0.8, self.pool_timeout_s)
        async with contextlib.AsyncExitStack() as stack:
            try:
                conn = await stack.enter_async_context(pool.connection(timeout=max(first, 0.001)))
            except PoolTimeout as exc:
                if not await self._database_answers(pool):
                    raise DatabaseUnavailable(
                        "database unavailable: no connection could be made",
                        detail=str(exc),
                        hint="check that PostgreSQL is running; the service reconnects by itself",
                    ) from exc
                try:
                    conn = await stack.enter_async_context(
                        pool.connection(timeout=max(deadline.remaining(), 0.001))
                    )
                except PoolTimeout as late:
                    raise DeadlineExceeded(
                        f"no free database connection before the deadline ({stage})",
                        hint="raise POIMEN_POOL_MAX, or timeout_seconds",
                    ) from late
            yield conn

    async def _database_answers(self, pool: AsyncConnectionPool[Any]) -> bool:
        """Is the server up (the pool is merely busy) or down? One direct connection tells;
        the answer is shared for a second so a crowd of waiting requests probes once."""
        async with self._probe_lock:
            at, up = self._probes.get(id(pool), (-1e9, True))
            if time.monotonic() - at < 1.0:
                return up
            info = pool.conninfo
            if not isinstance(info, str):  # a conninfo callable: judge by the pool alone
                return bool(pool.get_stats().get("pool_size", 0))
            try:
                async with asyncio.timeout(0.5):
                    probe = await psycopg.AsyncConnection.connect(info)
                await probe.close()
                up = True
            except psycopg.Error as exc:
                # The server answered (e.g. 53300, too many connections): it is up, busy.
                up = exc.sqlstate is not None
            except TimeoutError:
                up = False
            self._probes[id(pool)] = (time.monotonic(), up)
            return up
