"""PL/Proxy sharding: a proxy database in front of partition databases (docs/scaling.md).

A partition is a database of its own, a normal poimen-memory database migrated by the same
``migrate``; a power of two of them, more than servers, spread over the servers. The proxy
database holds PL/Proxy's SQL/MED cluster ``memory`` (one option ``p<N>`` a partition: the
libpq connection string of its database, the one home of the partition map) and the public
functions as PL/Proxy calls (sql/proxy/proxy.sql). Moving a partition to another server
copies its database and changes its option (``move``).

The proxy logs in to every partition as one role (``proxy_role``), a member of each
partition's own service role: the only role a partition trusts to assert a caller's
projects (sql/proxy/shard.sql).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from poimen_memory.db.cluster import find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import SQL_DIR, DriftReport, MigrateReport, check, migrate
from poimen_memory.db.migrate.render import with_vocabulary
from poimen_memory.errors import ClusterError, PoimenError

PROXY_SQL_DIR = SQL_DIR / "proxy"
SHARD_SQL = PROXY_SQL_DIR / "shard.sql"
PROXY_SQL = PROXY_SQL_DIR / "proxy.sql"
SERVER = "memory"  # PL/Proxy's cluster name, as `CLUSTER 'memory'` in sql/proxy/proxy.sql
DEFAULT_PROXY_ROLE = "poimen_proxy"
# The composite types the proxy's functions return, copied from partition 0's catalog.
ROW_TYPES = ("query_row", "node_row", "node_list_row", "review_item")
LOCK_KEY = 1886351213  # memory_proxy._lock_key()
_OPTION = re.compile(r"^p(\d+)=(.*)$", re.S)


class ShardError(PoimenError, code="shard_error"):
    """The proxy or a partition could not be configured, reached or moved."""


@dataclass(frozen=True)
class Partition:
    number: int
    conninfo: str  # libpq key=value, dbname included, no user (the user mapping's)

    @property
    def dbname(self) -> str:
        return str(conninfo_to_dict(self.conninfo).get("dbname", ""))

    def admin(self, user: str) -> str:
        return make_conninfo(self.conninfo, user=user)


@dataclass
class PartitionReport:
    partition: Partition
    migrate: MigrateReport | None = None
    drift: DriftReport | None = None
    error: str | None = None
    nodes: int | None = None
    projects: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def partition_database(prefix: str, number: int) -> str:
    return f"{prefix}_p{number}"


# Ids the proxy hands out for rows of several partitions (a review item, a reranker's
# candidate) are the partition's own id times this, plus the partition number
# (memory_proxy._global_id in sql/proxy/proxy.sql), so the count is capped by it.
MAX_PARTITIONS = 1024


def check_partitions(count: int, servers: int) -> None:
    if count < 1 or count & (count - 1) or count > MAX_PARTITIONS:
        raise ShardError(
            f"partitions must be a power of two up to {MAX_PARTITIONS}, not {count}",
            hint="PL/Proxy picks a partition as hash & (partitions - 1); e.g. --partitions 16",
        )
    if count < servers:
        raise ShardError(
            f"{count} partitions over {servers} servers leaves a server without one",
            hint="take more partitions than servers, so that a partition moves alone later",
        )


def partitions(proxy: psycopg.Connection[Any]) -> list[Partition]:
    """The partition map: cluster 'memory''s options on the proxy, in partition order."""
    row = proxy.execute(
        "SELECT srvoptions FROM pg_catalog.pg_foreign_server WHERE srvname = %s", (SERVER,)
    ).fetchone()
    if row is None:
        raise ShardError(
            "this database is no PL/Proxy proxy: it has no server 'memory'",
            hint="`poimen-memory shard init` makes one",
        )
    found = []
    for opt in row[0] or ():
        m = _OPTION.match(opt)
        if m:
            found.append(Partition(int(m.group(1)), m.group(2)))
    return sorted(found, key=lambda p: p.number)


def _render(path: Path, markers: dict[str, str]) -> str:
    # The shared words (@vocabulary.NAME@) as in every sql/ file, then this file's own.
    text = with_vocabulary(path.read_text(), path)
    for key, value in markers.items():
        text = text.replace(f"@{key}@", value)
    return text


def _ensure_login(conn: psycopg.Connection[Any], role: str, password: str | None) -> None:
    conn.execute(
        sql.SQL(
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {n}) THEN "
            "CREATE ROLE {r} LOGIN; END IF; END $$"
        ).format(n=sql.Literal(role), r=sql.Identifier(role))
    )
    if password is not None:
        conn.execute(
            sql.SQL("ALTER ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )


def prepare_partition(
    url: str,
    plpython_root: Path | None,
    *,
    proxy_role: str,
    proxy_password: str | None = None,
    role_prefix: str | None = None,
) -> MigrateReport:
    """``migrate`` one partition database, then its relays (sql/proxy/shard.sql), and let the
    proxy's role in as a member of its service role."""
    with connect(url, autocommit=True) as conn:
        report = migrate(conn, plpython_root, role_prefix=role_prefix)
        apply_shard_sql(conn, proxy_role, proxy_password)
    return report


def apply_shard_sql(
    conn: psycopg.Connection[Any], proxy_role: str, proxy_password: str | None = None
) -> None:
    row = conn.execute("SELECT service FROM memory.roles()").fetchone()
    assert row is not None
    service = str(row[0])
    with conn.transaction():
        _ensure_login(conn, proxy_role, proxy_password)
        conn.execute(
            sql.SQL("GRANT {} TO {}").format(sql.Identifier(service), sql.Identifier(proxy_role))
        )
        conn.execute(_render(SHARD_SQL, {"role.service": sql.Identifier(service).as_string(conn)}))


def _row_type(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(
        "SELECT string_agg(format('%%I %%s', attname, format_type(atttypid, atttypmod)), ', '"
        " ORDER BY attnum) FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
        (f"memory.{name}",),
    ).fetchone()
    if row is None or row[0] is None:
        raise ShardError(f"partition 0 has no type memory.{name}", hint="migrate it first")
    return str(row[0])


# The relays of partition 0 (sql/proxy/shard.sql) as proxy.sql makes its remote calls of
# them: name, arguments after the caller's three (declared, then as a call), result.
_RELAYS = """
SELECT p.proname::text,
       (SELECT string_agg(format('%I %s', p.proargnames[i],
                                 format_type(p.proargtypes[i - 1], NULL)), ', ' ORDER BY i)
        FROM generate_series(4, p.pronargs) AS i),
       (SELECT string_agg(quote_ident(p.proargnames[i]), ', ' ORDER BY i)
        FROM generate_series(4, p.pronargs) AS i),
       pg_get_function_result(p.oid)
FROM pg_proc p
WHERE p.pronamespace = 'memory_shard'::regnamespace AND p.proname <> '_assert'
ORDER BY 1, 2
"""


def configure_proxy(
    proxy_url: str,
    parts: list[Partition],
    *,
    service_role: str,
    proxy_role: str,
    proxy_password: str | None,
    admin_user: str,
) -> None:
    """The proxy database: extensions, the partitions' row types, cluster 'memory' and its
    user mapping, then sql/proxy/proxy.sql; one transaction."""
    with connect(parts[0].admin(admin_user)) as p0:
        types = {name: _row_type(p0, name) for name in ROW_TYPES}
        relays = p0.execute(_RELAYS).fetchall()
    with psycopg.connect(proxy_url, autocommit=True) as conn, conn.transaction():
        conn.execute("CREATE EXTENSION IF NOT EXISTS plproxy")
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE SCHEMA IF NOT EXISTS memory")
        conn.execute(
            sql.SQL(
                # The service logs in to the proxy as this role (POIMEN_SERVICE_ROLE), as it
                # does to a single database (db/connect.ensure_service_login): LOGIN. Roles
                # are the cluster's; NOLOGIN here locked the service out of every database.
                "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {n}) THEN "
                "CREATE ROLE {r} LOGIN; END IF; END $$"
            ).format(n=sql.Literal(service_role), r=sql.Identifier(service_role))
        )
        for name, columns in types.items():
            have = _row_type(conn, name) if _exists_type(conn, name) else None
            if have != columns:
                # A partition's row changed shape (a new column): the functions returning
                # it go with the old type and proxy.sql makes them again below.
                conn.execute(
                    sql.SQL("DROP TYPE IF EXISTS memory.{} CASCADE").format(sql.Identifier(name))
                )
                conn.execute(
                    sql.SQL("CREATE TYPE memory.{} AS ({})").format(
                        sql.Identifier(name),
                        sql.SQL(columns),  # a catalog rendering of partition 0, not input
                    )
                )
        options = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(f"p{p.number}"), sql.Literal(p.conninfo))
            for p in parts
        )
        exists = conn.execute(
            "SELECT 1 FROM pg_foreign_server WHERE srvname = %s", (SERVER,)
        ).fetchone()
        if exists is not None:
            _same_map(conn, parts)
        if exists is None:
            conn.execute(
                sql.SQL(
                    "CREATE SERVER {} FOREIGN DATA WRAPPER plproxy OPTIONS "
                    "(connection_lifetime '1800', {})"
                ).format(sql.Identifier(SERVER), options)
            )
        conn.execute(
            sql.SQL("GRANT USAGE ON FOREIGN SERVER {} TO {}").format(
                sql.Identifier(SERVER), sql.Identifier(service_role)
            )
        )
        mapping = [sql.SQL("user {}").format(sql.Literal(proxy_role))]
        if proxy_password is not None:
            mapping.append(sql.SQL("password {}").format(sql.Literal(proxy_password)))
        conn.execute(
            sql.SQL("DROP USER MAPPING IF EXISTS FOR PUBLIC SERVER {}").format(
                sql.Identifier(SERVER)
            )
        )
        conn.execute(
            sql.SQL("CREATE USER MAPPING FOR PUBLIC SERVER {} OPTIONS ({})").format(
                sql.Identifier(SERVER), sql.SQL(", ").join(mapping)
            )
        )
        conn.execute(
            "CREATE TEMP TABLE proxy_relays (name text, args text, call text, result text)"
            " ON COMMIT DROP"
        )
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO pg_temp.proxy_relays VALUES (%s, %s, %s, %s)", relays)
        conn.execute(
            _render(
                PROXY_SQL,
                {
                    "proxy.service": sql.Identifier(service_role).as_string(conn),
                    "proxy.max_partitions": str(MAX_PARTITIONS),
                },
            )
        )


def _same_map(conn: psycopg.Connection[Any], parts: list[Partition]) -> None:
    """The map is changed one partition at a time, by `shard move`, never rewritten."""
    have = partitions(conn)
    if have != parts:
        raise ShardError(
            "this proxy already has a different partition map",
            detail="; ".join(f"p{p.number} {p.conninfo}" for p in have),
            hint="`poimen-memory shard status` shows it; `shard move` moves one partition",
        )


def _exists_type(conn: psycopg.Connection[Any], name: str) -> bool:
    row = conn.execute("SELECT to_regtype(%s)", (f"memory.{name}",)).fetchone()
    return row is not None and row[0] is not None


def _create_database(server_admin: str, dbname: str) -> None:
    with psycopg.connect(make_conninfo(server_admin, dbname="postgres"), autocommit=True) as c:
        if c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone():
            return
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))


def init(
    proxy_url: str,
    servers: list[str],
    count: int,
    *,
    prefix: str,
    service_role: str,
    proxy_role: str = DEFAULT_PROXY_ROLE,
    proxy_password: str | None = None,
    admin_user: str = "postgres",
    plpython_root: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[PartitionReport]:
    """Make ``count`` partition databases round-robin over ``servers`` (libpq connection
    strings without dbname or user), migrate each, and configure the proxy in front."""
    check_partitions(count, len(servers))
    parts = [
        Partition(i, make_conninfo(servers[i % len(servers)], dbname=partition_database(prefix, i)))
        for i in range(count)
    ]
    with psycopg.connect(proxy_url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_foreign_server WHERE srvname = %s", (SERVER,)).fetchone():
            _same_map(conn, parts)  # before any partition database is touched
    reports = []
    for p in parts:
        if progress:
            progress(f"partition {p.number}: {p.conninfo}")
        _create_database(p.admin(admin_user), p.dbname)
        rep = prepare_partition(
            p.admin(admin_user),
            plpython_root,
            proxy_role=proxy_role,
            proxy_password=proxy_password,
            role_prefix=p.dbname,
        )
        reports.append(PartitionReport(p, migrate=rep))
    configure_proxy(
        proxy_url,
        parts,
        service_role=service_role,
        proxy_role=proxy_role,
        proxy_password=proxy_password,
        admin_user=admin_user,
    )
    return reports


def _each_partition(
    proxy_url: str,
    work: Callable[[Partition, PartitionReport], None],
    errors: tuple[type[Exception], ...],
) -> tuple[list[Partition], list[PartitionReport]]:
    """The proxy's partitions, and ``work`` done on each on its own: an error of ``errors``
    (a partition out of reach, a failed migration) is its report's first line, and the
    others go on."""
    with psycopg.connect(proxy_url, autocommit=True) as conn:
        parts = partitions(conn)
    reports = []
    for p in parts:
        r = PartitionReport(p)
        try:
            work(p, r)
        except errors as exc:
            said = str(exc).strip()
            r.error = said.splitlines()[0] if said else repr(exc)
        reports.append(r)
    return parts, reports


def migrate_all(
    proxy_url: str,
    *,
    service_role: str,
    proxy_role: str = DEFAULT_PROXY_ROLE,
    proxy_password: str | None = None,
    admin_user: str = "postgres",
    plpython_root: Path | None = None,
    only_check: bool = False,
) -> list[PartitionReport]:
    """``migrate`` (or ``migrate --check``) every partition, each on its own: one out of
    reach is reported and the others go on. Then the proxy's own SQL again."""

    def one(p: Partition, r: PartitionReport) -> None:
        if only_check:
            with connect(p.admin(admin_user), autocommit=True) as c:
                r.drift = check(c, plpython_root=plpython_root)
        else:
            r.migrate = prepare_partition(
                p.admin(admin_user),
                plpython_root,
                proxy_role=proxy_role,
                proxy_password=proxy_password,
            )

    parts, reports = _each_partition(proxy_url, one, (psycopg.Error, PoimenError))
    if not only_check and all(r.error is None for r in reports):
        configure_proxy(
            proxy_url,
            parts,
            service_role=service_role,
            proxy_role=proxy_role,
            proxy_password=proxy_password,
            admin_user=admin_user,
        )
    return reports


def status(proxy_url: str, *, admin_user: str = "postgres") -> list[PartitionReport]:
    """Each partition: where it is, whether it answers, its nodes and projects."""

    def one(p: Partition, r: PartitionReport) -> None:
        with psycopg.connect(p.admin(admin_user), connect_timeout=5) as c:
            row = c.execute(
                "SELECT (SELECT count(*) FROM memory.nodes WHERE expired_at IS NULL),"
                " (SELECT count(*) FROM memory.projects)"
            ).fetchone()
            assert row is not None
            r.nodes, r.projects = int(row[0]), int(row[1])

    return _each_partition(proxy_url, one, (psycopg.Error,))[1]


def _pg_tool(name: str) -> str:
    return str(find_pg_bin() / name)


def move(
    proxy_url: str,
    number: int,
    to_server: str,
    *,
    proxy_role: str = DEFAULT_PROXY_ROLE,
    proxy_password: str | None = None,
    admin_user: str = "postgres",
    plpython_root: Path | None = None,
    lock_timeout_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> Partition:
    """Move partition ``number`` to ``to_server`` (a libpq connection string without dbname
    or user) without losing a write (docs/scaling.md#moving-a-partition):

    1. on the proxy, take the partition's lock exclusively: writes to it wait (each write
       holds it shared for its call), reads go on from the old copy;
    2. make the partition's roles on the new server (``migrate`` of a scratch database with
       its role prefix), copy the database (pg_dump | pg_restore), let the proxy's role in;
    3. point the partition's option at the new copy and commit: the waiting writes go there;
    4. close the old copy to connections (kept for the DBA to drop).
    """

    def say(line: str) -> None:
        if progress:
            progress(line)

    with psycopg.connect(proxy_url, autocommit=True) as proxy:
        parts = {p.number: p for p in partitions(proxy)}
        if number not in parts:
            raise ShardError(f"no partition {number}", hint=f"partitions: 0..{len(parts) - 1}")
        old = parts[number]
        new = Partition(number, make_conninfo(to_server, dbname=old.dbname))
        if conninfo_to_dict(new.conninfo) == conninfo_to_dict(old.conninfo):
            raise ShardError(f"partition {number} is already on {to_server}")
        with proxy.transaction():
            proxy.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{int(lock_timeout_s * 1000)}ms")
                )
            )
            say(f"partition {number}: waiting for its writes to finish")
            proxy.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_KEY, number))
            proxy.execute("SET LOCAL lock_timeout = 0")
            with connect(old.admin(admin_user)) as src:
                row = src.execute("SELECT reader FROM memory.roles()").fetchone()
                assert row is not None
                role_prefix = str(row[0]).removesuffix("_memory_reader")
            say(f"partition {number}: roles {role_prefix}_memory_* on the new server")
            scratch = f"{old.dbname}_roles"
            _create_database(new.admin(admin_user), scratch)
            try:
                with connect(
                    make_conninfo(new.admin(admin_user), dbname=scratch), autocommit=True
                ) as s:
                    migrate(s, plpython_root, role_prefix=role_prefix)
            finally:
                _drop_database(new.admin(admin_user), scratch)
            _create_database(new.admin(admin_user), new.dbname)
            say(f"partition {number}: copying {old.conninfo} -> {new.conninfo}")
            _copy_database(old.admin(admin_user), new.admin(admin_user))
            with connect(new.admin(admin_user), autocommit=True) as dst:
                migrate(dst, plpython_root, role_prefix=role_prefix)
                apply_shard_sql(dst, proxy_role, proxy_password)
            proxy.execute(
                sql.SQL("ALTER SERVER {} OPTIONS (SET {} {})").format(
                    sql.Identifier(SERVER), sql.Identifier(f"p{number}"), sql.Literal(new.conninfo)
                )
            )
            proxy.execute(
                "INSERT INTO memory_proxy.moves (partition, from_conninfo, to_conninfo)"
                " VALUES (%s, %s, %s)",
                (number, old.conninfo, new.conninfo),
            )
        say(f"partition {number}: now on {new.conninfo}; closing the old copy")
        _close_database(old.admin(admin_user))
    return new


def _copy_database(src: str, dst: str) -> None:
    """pg_dump | pg_restore, the whole database: every table, sequence, grant and the
    PL/Python module stored in it."""
    with tempfile.TemporaryFile() as dump_err:
        with subprocess.Popen(
            [_pg_tool("pg_dump"), "-Fc", "-d", src], stdout=subprocess.PIPE, stderr=dump_err
        ) as dump:
            restore = subprocess.run(
                [_pg_tool("pg_restore"), "--exit-on-error", "-d", dst],
                stdin=dump.stdout,
                capture_output=True,
                text=True,
                check=False,
            )
        dump_err.seek(0)
        said = dump_err.read().decode(errors="replace")
    if dump.returncode != 0 or restore.returncode != 0:
        raise ShardError(
            "copying the partition failed; the proxy still points at the old copy",
            detail=(said + restore.stderr).strip()[-2000:],
            hint="drop the new database and run `shard move` again",
        )


def _drop_database(server_admin: str, dbname: str) -> None:
    with psycopg.connect(make_conninfo(server_admin, dbname="postgres"), autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


def _close_database(admin: str) -> None:
    """The old copy refuses connections (a stale route fails loudly rather than writing
    there) and is kept for the DBA to drop."""
    dbname = str(conninfo_to_dict(admin)["dbname"])
    try:
        with psycopg.connect(make_conninfo(admin, dbname="postgres"), autocommit=True) as c:
            c.execute(
                sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(dbname))
            )
            c.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (dbname,),
            )
    except psycopg.Error as exc:  # the move is done; the old copy is the DBA's to close
        raise ClusterError(
            f"the partition moved, but its old copy {dbname} stays open",
            detail=str(exc),
            hint=f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS false, then drop it",
        ) from exc
