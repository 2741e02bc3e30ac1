"""Apply versioned migrations once (frozen by checksum), then re-apply sql/ on every deploy.

Everything runs in one transaction under an advisory lock, so a failed deploy leaves the
database as it was and two concurrent deploys serialise. A lock that cannot be taken within
``lock_timeout`` fails the deploy with a clear message instead of waiting forever.

pgvector may live in any schema (``CREATE EXTENSION vector SCHEMA extensions``): migrate
finds it, creates the functions with that schema on the session's search_path and pins it
in the ``search_path`` of every function that names ``public`` or sets none.

``check`` reports drift: it applies sql/ inside a transaction that it rolls back and lists
every function whose definition (body, settings, comment) differs from what the files produce,
and every difference in what protects the data (row-level security, policies, indexes,
triggers, the grants to PUBLIC and the product's roles, default privileges and the product's
keys in memory.config): the state before, compared with the state the files leave.

A deploy that changes nothing takes no lock a query or a write would wait for: sql/ compares
before it re-creates a trigger, policy, index or comment. DDL that must run waits at most a
short ``lock_timeout`` per attempt (a queued ACCESS EXCLUSIVE request blocks every query
behind it) and is retried, as a whole transaction, until ``--lock-timeout`` is spent.

The large projects' own HNSW graphs (sql/088_indexes.sql) are the exception to the one
transaction: a plain CREATE INDEX would hold writes off memory.nodes for the whole build
(minutes at a million nodes), so migrate builds them after its commit with CREATE INDEX
CONCURRENTLY (``build_project_graphs``), one at a time; a build that fails leaves an INVALID
index, which the next migrate drops and builds again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from poimen_core.vocabulary import sql_literals
from poimen_memory.db.roles import KINDS, LEGACY, Roles, prefix_for
from poimen_memory.errors import MigrationError

ROOT = Path(__file__).resolve().parents[3]
MIGRATIONS_DIR = ROOT / "migrations"
SQL_DIR = ROOT / "sql"
PLPYTHON_SRC = ROOT / "plpython" / "poimen_core"
TOKENIZER = ROOT / "service" / "poimen_memory" / "data" / "tokenizer.json"
_LOCK_KEY = 0x706F696D656E  # "poimen"
# Held for the session while the project graphs are built (after the transaction, whose
# advisory lock is gone by then): a second migrate waits for the first's builds instead of
# dropping an index the first is still building, which looks INVALID until it is done.
_BUILD_LOCK_KEY = _LOCK_KEY + 1
# How long each concurrent build waits for a lock, or for the transactions it must outlast
# (CREATE INDEX CONCURRENTLY waits for every writer, then every older snapshot, to finish).
# Writes and queries do not wait behind it, so this can be long; migrate --build-lock-timeout.
GRAPH_BUILD_LOCK_TIMEOUT_S = 600.0
_COPY_NAME = re.compile(r"^[0-9a-f]{16}(\.tmp\d+)?$")

_LEDGER = """
CREATE SCHEMA IF NOT EXISTS memory;
CREATE TABLE IF NOT EXISTS memory.schema_migrations (
    version    text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""

# The functions sql/ owns: everything in schema memory and the public.memory_* aliases.
_OUR_FUNCTIONS = """
SELECT p.oid::regprocedure::text AS signature, p.prosecdef, p.proconfig
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'memory'
   OR (n.nspname = 'public' AND p.proname IN ('memory_query', 'memory_optimize_query'))
"""

# Bodies and settings only: who may run a function is compared apart (_PROTECTION, as the
# set of privileges PUBLIC and the product's roles hold), so an ACL that differs only in its
# grantor or its order (a restore into another cluster) is no finding.
_SNAPSHOT = f"""
SELECT f.signature,
       md5(pg_catalog.pg_get_functiondef(f.signature::regprocedure)
           || coalesce(p.proparallel::text, '')
           || coalesce(pg_catalog.obj_description(p.oid, 'pg_proc'), ''))
FROM ({_OUR_FUNCTIONS}) f JOIN pg_catalog.pg_proc p ON p.oid = f.signature::regprocedure
WHERE p.prokind <> 'a'
"""


# What protects the data, as (kind, object, state) rows: compared before and after sql/ is
# applied, so the files are the one source of truth for what it should be. Grants are the
# privileges of PUBLIC and the product's roles only (the owner's and a DBA's own roles' are
# the DBA's), one row per privilege, grantor and order ignored; the default privileges are
# those of the roles that create the product's objects (the one migrating, the schema's
# owner), which is what a function such a role adds later gets.
_PROTECTION = """
WITH grantee(oid, name) AS (
    SELECT 0::oid, 'PUBLIC'
    UNION ALL
    SELECT r.oid, r.rolname::text FROM pg_catalog.pg_roles r
    WHERE r.rolname IN (@grantees@)
), rels AS (
    SELECT c.oid, c.relname, c.relkind, c.relacl, c.relowner, c.relrowsecurity,
           c.relforcerowsecurity
    FROM pg_catalog.pg_class c
    WHERE c.relnamespace = 'memory'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
), creators AS (
    SELECT r.oid, r.rolname FROM pg_catalog.pg_roles r
    WHERE r.rolname = current_user
       OR r.oid = (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'memory')
)
SELECT 'row-level security', 'memory.' || c.relname,
       CASE WHEN c.relrowsecurity THEN 'enabled' ELSE 'disabled' END
       || CASE WHEN c.relforcerowsecurity THEN ', forced' ELSE '' END
FROM rels c WHERE c.relkind IN ('r', 'p')
UNION ALL
SELECT 'policy', p.polname || ' on memory.' || c.relname,
       pg_catalog.format('%s FOR %s TO %s USING (%s) WITH CHECK (%s)',
           CASE WHEN p.polpermissive THEN 'PERMISSIVE' ELSE 'RESTRICTIVE' END, p.polcmd,
           (SELECT pg_catalog.string_agg(CASE WHEN r = 0 THEN 'PUBLIC'
                                              ELSE pg_catalog.pg_get_userbyid(r)::text END, ', ')
            FROM pg_catalog.unnest(p.polroles) r),
           pg_catalog.pg_get_expr(p.polqual, p.polrelid),
           pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid))
FROM pg_catalog.pg_policy p JOIN rels c ON c.oid = p.polrelid
UNION ALL
SELECT 'index', 'memory.' || ic.relname,
       pg_catalog.pg_get_indexdef(i.indexrelid)
       || CASE WHEN i.indisvalid THEN '' ELSE ' (invalid)' END
FROM pg_catalog.pg_index i JOIN rels c ON c.oid = i.indrelid
JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
UNION ALL
SELECT 'trigger', t.tgname || ' on memory.' || c.relname,
       pg_catalog.pg_get_triggerdef(t.oid)
       || CASE t.tgenabled WHEN 'O' THEN '' WHEN 'D' THEN ' (disabled)'
                           WHEN 'R' THEN ' (replica only)' ELSE ' (always)' END
FROM pg_catalog.pg_trigger t JOIN rels c ON c.oid = t.tgrelid
WHERE NOT t.tgisinternal AND t.tgparentid = 0
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON %s memory.%I%s TO %s',
           a.privilege_type, CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
           c.relname, coalesce(' (' || pg_catalog.quote_ident(x.col) || ')', ''), g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM rels c
CROSS JOIN LATERAL (
    SELECT NULL::name AS col,
           coalesce(c.relacl, pg_catalog.acldefault(
               CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner)) AS acl
    UNION ALL
    SELECT at.attname, at.attacl FROM pg_catalog.pg_attribute at
    WHERE at.attrelid = c.oid AND at.attnum > 0 AND NOT at.attisdropped
      AND at.attacl IS NOT NULL) x
CROSS JOIN LATERAL pg_catalog.aclexplode(x.acl) a
JOIN grantee g ON g.oid = a.grantee
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON FUNCTION %s TO %s', a.privilege_type,
                                  p.oid::regprocedure, g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))) a
JOIN grantee g ON g.oid = a.grantee
WHERE n.nspname = 'memory'
   OR (n.nspname = 'public' AND p.proname IN ('memory_query', 'memory_optimize_query'))
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON SCHEMA memory TO %s', a.privilege_type, g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM pg_catalog.pg_namespace n
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a
JOIN grantee g ON g.oid = a.grantee
WHERE n.nspname = 'memory'
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON DATABASE %I TO %s', a.privilege_type, d.datname, g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM pg_catalog.pg_database d
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(d.datacl, pg_catalog.acldefault('d', d.datdba))) a
JOIN grantee g ON g.oid = a.grantee
WHERE d.datname = pg_catalog.current_database() AND a.privilege_type = 'CONNECT'
UNION ALL
SELECT 'default privilege',
       pg_catalog.format('%s on the %s %I creates%s: %s', a.privilege_type, k.kind, r.rolname,
                         CASE WHEN d.defaclnamespace = 0 THEN '' ELSE ' in schema memory' END,
                         g.name),
       'granted'
FROM creators r
CROSS JOIN (VALUES ('f'::"char", 'f'::"char", 'functions'), ('r', 'r', 'tables'),
                   ('S', 's', 'sequences'), ('T', 'T', 'types')) k(objtype, acltype, kind)
JOIN pg_catalog.pg_namespace m ON m.nspname = 'memory'
-- The global entry (or, without one, the built-in default), then the schema's additions.
CROSS JOIN LATERAL (
    SELECT 0::oid AS defaclnamespace,
           coalesce((SELECT d0.defaclacl FROM pg_catalog.pg_default_acl d0
                     WHERE d0.defaclrole = r.oid AND d0.defaclnamespace = 0
                       AND d0.defaclobjtype = k.objtype),
                    pg_catalog.acldefault(k.acltype, r.oid)) AS acl
    UNION ALL
    SELECT d1.defaclnamespace, d1.defaclacl FROM pg_catalog.pg_default_acl d1
    WHERE d1.defaclrole = r.oid AND d1.defaclnamespace = m.oid AND d1.defaclobjtype = k.objtype
) d
CROSS JOIN LATERAL pg_catalog.aclexplode(d.acl) a
JOIN grantee g ON g.oid = a.grantee
UNION ALL
SELECT 'config', 'memory.config ' || c.key, c.value FROM memory.config c
WHERE c.key IN ('plpython_path', 'plpython_checksum', 'plpython_deps', 'role_prefix')
"""


def _protection(conn: psycopg.Connection[Any], *roles: Roles) -> dict[tuple[str, str], str]:
    """What protects the data, for PUBLIC and the given roles' privileges (this database's,
    and the shared ones it moves away from)."""
    names = sorted({n for r in roles for n in r.all})
    grantees = ", ".join(sql.Literal(n).as_string(conn) for n in names)
    rows = conn.execute(_PROTECTION.replace("@grantees@", grantees).encode()).fetchall()
    return {(str(r[0]), str(r[1])): str(r[2]) for r in rows}


def _findings(before: dict[tuple[str, str], str], after: dict[tuple[str, str], str]) -> list[str]:
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


def _deps_target(home: Path) -> Path | None:
    """Where server_python_deps puts (or finds) the embedder's packages, computed without
    copying anything: what migrate would record as plpython_deps."""
    src = Path(sys.prefix) / "server-python"
    stamps = sorted(src.glob("*/.poimen-deps"))
    if not stamps:
        return None
    if _unreachable_ancestor(src) is None:
        return src
    digest = hashlib.sha256(b"".join(p.parent.name.encode() + p.read_bytes() for p in stamps))
    return home / "server-python" / digest.hexdigest()[:16]


def server_python_deps(home: Path) -> Path | None:
    """Where the server imports the in-database embedder's packages from: the directory
    `make setup` filled (one subdirectory per Python X.Y of the PostgreSQL server,
    scripts/setup.sh), or None when it did not. When the server's OS user cannot reach that
    directory (a checkout under /root), it is copied once under ``home``, named by the
    setup stamps so a new install gets a new copy, and older copies are removed."""
    src = Path(sys.prefix) / "server-python"
    target = _deps_target(home)
    if target is None or target == src:
        return target
    base = home / "server-python"
    if not target.is_dir():
        base.mkdir(parents=True, exist_ok=True)
        base.chmod(0o755)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, symlinks=True)
        for d, _dirs, _files in os.walk(tmp):
            os.chmod(d, 0o755)
        tmp.rename(target)
    for old in base.iterdir():
        if old != target and _COPY_NAME.match(old.name):
            shutil.rmtree(old, ignore_errors=True)
    return target


@dataclass(frozen=True)
class MigrateReport:
    applied: list[str]
    already: list[str]
    sql_files: list[str]
    plpython_path: str | None
    vector_schema: str = "public"
    removed_copies: list[str] = field(default_factory=list)
    embedder_path: str | None = None
    notices: list[str] = field(default_factory=list)
    """What the migrations applied now told the operator (RAISE NOTICE in their DO blocks):
    e.g. 0008 names the roles that row-level security now shows no project."""
    lock_waits: list[str] = field(default_factory=list)
    """Each attempt that gave up on a lock (and was retried): what it waited for."""
    plpython_installed: bool = True
    """False on a database without plpython3u (a managed service): the functions that need
    it raise PM503 (docs/managed-postgres.md)."""
    roles: Roles = field(default_factory=lambda: LEGACY)
    """This database's own roles (db/roles.py)."""
    warnings: list[str] = field(default_factory=list)
    """This database's roles holding privileges in another database too."""
    scale_warnings: list[str] = field(default_factory=list)
    """What the store has outgrown (memory.scale_warnings(), issue 28), one line each."""
    project_graphs: list[GraphBuild] = field(default_factory=list)
    """The large projects' own HNSW graphs built after the transaction (CONCURRENTLY)."""


@dataclass(frozen=True)
class DriftReport:
    """What `migrate --check` found: nothing is changed in the database."""

    pending_migrations: list[str]
    changed: list[str]  # functions whose definition differs from sql/
    missing: list[str]  # functions sql/ defines that the database lacks
    extra: list[str]  # functions in schema memory that sql/ does not define (a DBA's own)
    # What protects the data and differs from what sql/ makes: row-level security, policies,
    # indexes, triggers, grants, default privileges, the product's memory.config keys.
    findings: list[str] = field(default_factory=list)
    lock_waits: list[str] = field(default_factory=list)
    # Not drift from sql/ (nothing migrate would change), but worth a DBA's look: this
    # database's roles holding privileges in another database too.
    warnings: list[str] = field(default_factory=list)
    # Not drift either: what the store has outgrown (memory.scale_warnings(), issue 28).
    scale_warnings: list[str] = field(default_factory=list)
    # The large projects' own HNSW graphs the next migrate builds (concurrently, after its
    # transaction), one line each: not drift, as migrate's transaction leaves them to it too.
    project_graphs: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.pending_migrations or self.changed or self.missing or self.findings)


def scale_warnings(conn: psycopg.Connection[Any]) -> list[str]:
    """memory.scale_warnings(), one line each, naming the project: none on a database whose
    sql/ predates the function (a database migrated only to an old level has none)."""
    found = conn.execute("SELECT to_regprocedure('memory.scale_warnings()') IS NOT NULL")
    if found.fetchone() != (True,):
        return []
    rows = conn.execute("SELECT project, what, hint FROM memory.scale_warnings()").fetchall()
    return [
        f"{what}{'' if project is None else f' (project {project})'}: {hint}"
        for project, what, hint in rows
    ]


@dataclass(frozen=True)
class GraphBuild:
    """A large project's own HNSW graph that build_project_graphs built."""

    index: str
    project_id: int
    was: str
    """What it was before: missing, invalid (a failed or interrupted build's leftover, which
    was dropped first) or differs (from its definition in sql/; dropped first too)."""
    seconds: float

    def line(self) -> str:
        return (
            f"memory.{self.index} (project {self.project_id}, was {self.was})"
            f" in {self.seconds:.1f} s"
        )


def missing_project_graphs(conn: psycopg.Connection[Any]) -> list[tuple[str, int, str, str]]:
    """memory._missing_project_graphs(): (index, project id, state, CREATE INDEX CONCURRENTLY
    statement) of each large project's graph that is missing, invalid or differs; none on a
    database whose sql/ predates the function."""
    found = conn.execute("SELECT to_regprocedure('memory._missing_project_graphs()') IS NOT NULL")
    if found.fetchone() != (True,):
        return []
    rows = conn.execute(
        "SELECT index_name, project_id, state, statement FROM memory._missing_project_graphs()"
    ).fetchall()
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
    saved = conn.execute(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
    ).fetchone()
    assert saved is not None
    built: list[GraphBuild] = []
    try:
        conn.execute(
            "SELECT set_config('lock_timeout', %s, false)",
            (f"{max(int(lock_timeout_s * 1000), 1)}ms",),
        )
        # A build of minutes must not be cut short by a role's statement_timeout.
        conn.execute("SELECT set_config('statement_timeout', '0', false)")
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
                        conn.execute(
                            sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS memory.{}").format(
                                sql.Identifier(name)
                            )
                        )
                    conn.execute(statement.encode())
                except psycopg.Error as exc:
                    raise _build_error(name, exc, lock_timeout_s) from exc
                done = GraphBuild(name, project_id, state, time.monotonic() - t0)
                built.append(done)
                tell(f"built {done.line()}")
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_advisory_unlock(%s)", (_BUILD_LOCK_KEY,))
    finally:
        with contextlib.suppress(psycopg.Error):
            conn.execute(
                "SELECT set_config('lock_timeout', %s, false),"
                " set_config('statement_timeout', %s, false)",
                (saved[0], saved[1]),
            )
    return built


def _build_lock(
    conn: psycopg.Connection[Any], lock_timeout_s: float, tell: Callable[[str], None]
) -> None:
    """The session's build lock (_BUILD_LOCK_KEY), waiting at most lock_timeout_s (the
    session's lock_timeout) for a session that holds it, named."""
    got = conn.execute("SELECT pg_try_advisory_lock(%s)", (_BUILD_LOCK_KEY,)).fetchone()
    if got == (True,):
        return
    holder = conn.execute(
        "SELECT string_agg(pid::text, ', ') FROM pg_catalog.pg_locks"
        " WHERE locktype = 'advisory' AND granted AND objid = %s AND pid <> pg_backend_pid()",
        (_BUILD_LOCK_KEY & 0xFFFFFFFF,),
    ).fetchone()
    who = f"pid {holder[0]}" if holder and holder[0] else "another session"
    tell(f"waiting for {who}, which is building project graphs")
    try:
        conn.execute("SELECT pg_advisory_lock(%s)", (_BUILD_LOCK_KEY,))
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


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plpython_checksum() -> str:
    h = hashlib.sha256()
    for f in sorted(PLPYTHON_SRC.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _unreachable_ancestor(root: Path) -> Path | None:
    """The first ancestor of root the server's OS user cannot traverse, if we run as root
    (the embedded server then runs as postgres); None when every ancestor is reachable."""
    if os.geteuid() != 0:
        return None
    for p in reversed(root.parents):
        if p.exists() and (p.stat().st_mode & 0o001) == 0:
            return p
    return None


def _module_root(plpython_root: Path | None) -> Path | None:
    """Where this host installs the PL/Python module for the server to import, or None
    when the server imports it from the database alone (memory._plpython_modules): no root,
    or one the server's OS user cannot reach (a database on another host, where no path of
    this one means anything, is the same case). migrate and check both decide it here."""
    if plpython_root is None or _unreachable_ancestor(plpython_root) is not None:
        return None
    return plpython_root


def install_plpython(root: Path) -> Path:
    """Copy the stdlib-only module where the server's postgres user can import it.

    The directory is named by content hash, so a new version never overwrites code that a
    running backend has loaded; the shim notices the path change and re-imports. Only
    directories the project owns (root and below) are created or have their mode set.
    memory.embed reads the tokenizer beside the package (its digest is checked on load).
    """
    blocked = _unreachable_ancestor(root)
    if blocked is not None:
        raise MigrationError(
            f"the PL/Python directory {root} is not reachable by the database server",
            detail=f"{blocked} has no execute (traverse) permission for other users",
            hint="set POIMEN_HOME to a directory the postgres user can reach (the default "
            "for root is /var/lib/poimen-memory), or run migrate --no-plpython",
        )
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    target = root / plpython_checksum()[:16]
    pkg = target / "poimen_core"
    if not (pkg / "__init__.py").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(
            PLPYTHON_SRC, tmp / "poimen_core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        for d in (tmp, tmp / "poimen_core"):
            d.chmod(0o755)
        shutil.copyfile(TOKENIZER, tmp / TOKENIZER.name)
        for f in [*(tmp / "poimen_core").iterdir(), tmp / TOKENIZER.name]:
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def remove_old_copies(root: Path, keep: Path) -> list[str]:
    """Delete earlier content-hashed copies (and abandoned temporaries) under root. Backends
    that imported an old copy keep it in memory; the shim re-imports from the new path."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        if d.is_dir() and d != keep and _COPY_NAME.match(d.name):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return sorted(removed)


def vector_schema(conn: psycopg.Connection[Any]) -> str | None:
    """The schema pgvector is installed in; None where it is not installed."""
    row = conn.execute(
        "SELECT n.nspname FROM pg_catalog.pg_extension e"
        " JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'vector'"
    ).fetchone()
    return None if row is None else str(row[0])


def _use_vector_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    path = ["public"] if schema == "public" else ["public", schema]
    conn.execute(
        sql.SQL("SET LOCAL search_path = {}").format(sql.SQL(", ").join(map(sql.Identifier, path)))
    )


_MARK = "pg_temp.poimen_xact_mark"
# Functions (re)created by this transaction: their pg_proc row carries its xid, like the
# marker table created at its start. A DBA's own functions in the schema are left alone.
_TOUCHED = f"""
SELECT f.* FROM ({_OUR_FUNCTIONS}) f
JOIN pg_catalog.pg_proc p ON p.oid = f.signature::regprocedure
WHERE p.xmin = (SELECT c.xmin FROM pg_catalog.pg_class c WHERE c.oid = '{_MARK}'::regclass)
"""


# The predicates PostgreSQL must inline into the statements that call them (the planner
# inlines no function with a SET clause): they get no search_path, and name everything they
# call schema-qualified instead (sql/019_visibility.sql; tests/test_sql_hygiene.py).
INLINED = frozenset({"memory._visible"})


def _pin_search_path(conn: psycopg.Connection[Any], schema: str) -> None:
    """Every function sql/ defines gets a fixed search_path: the one in its file (public
    already replaced by pgvector's schema), or, where a file sets none, pg_catalog +
    pgvector's schema (pg_catalog only for SECURITY DEFINER functions); not the INLINED
    predicates."""
    for signature, secdef, config in conn.execute(_TOUCHED).fetchall():
        if any(c.startswith("search_path=") for c in config or []):
            continue
        if str(signature).split("(", 1)[0] in INLINED:
            continue
        parts = ["pg_catalog", "pg_temp"] if secdef else ["pg_catalog", schema, "pg_temp"]
        conn.execute(
            sql.SQL("ALTER FUNCTION {} SET search_path = {}").format(
                sql.SQL(signature),
                sql.SQL(", ").join(sql.Identifier(p) for p in parts),
            )
        )


_SET_PATH_LINE = re.compile(r"^(SET search_path = )(.*)$", re.MULTILINE)


def _with_vector_schema(text: str, schema: str) -> str:
    """The files name pgvector's schema as public in their `SET search_path = ...` function
    clauses; CREATE FUNCTION validates a body under that path, so it must be the real one."""
    if schema == "public":
        return text
    quoted = sql.Identifier(schema).as_string(None)
    return _SET_PATH_LINE.sub(
        lambda m: m.group(1) + re.sub(r"\bpublic\b", quoted, m.group(2)), text
    )


_VOCABULARY = re.compile(r"@vocabulary\.(\w+)@")


def _with_vocabulary(text: str, path: Path) -> str:
    """The shared words (poimen_core.vocabulary) in place of the file's markers."""
    words = sql_literals()

    def word(m: re.Match[str]) -> str:
        if m.group(1) not in words:
            raise MigrationError(
                f"{path.name} names an unknown vocabulary word {m.group(0)}",
                hint=f"poimen_core/vocabulary.py defines: {', '.join(sorted(words))}",
            )
        return words[m.group(1)]

    return _VOCABULARY.sub(word, text)


# PL/Python is an add-on: a managed PostgreSQL (RDS, Cloud SQL, Azure, Supabase, Neon)
# never offers plpython3u, and only a superuser may create it. Without it every PL/Python
# function is made as a PL/pgSQL function of the same signature that raises PM503, which
# the planner already answers (routing as Hybrid; the lexical leg where memory.embed is
# missing) and callers already expect where the module is not installed on a host.
_PLPYTHON_EXTENSION = re.compile(r"^CREATE EXTENSION IF NOT EXISTS plpython3u;$", re.MULTILINE)
_PLPYTHON_FUNCTION = re.compile(
    r"(?P<head>CREATE OR REPLACE FUNCTION (?P<name>[\w.]+)\((?:(?!\$\$).)*?)"
    r"LANGUAGE plpython3u(?P<tail>(?:(?!\$\$).)*?)AS \$\$\n.*?\n\$\$;",
    re.DOTALL,
)
_PLPYTHON_STATUS = """
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'plpython3u'),
       EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'plpython3u')
       OR ((SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
           AND EXISTS (SELECT 1 FROM pg_catalog.pg_available_extensions
                       WHERE name = 'plpython3u'))
"""


def plpython_status(conn: psycopg.Connection[Any]) -> tuple[bool, bool]:
    """(installed in this database, installed or creatable by this role)."""
    row = conn.execute(_PLPYTHON_STATUS).fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1])


def _without_plpython(text: str) -> str:
    def stub(m: re.Match[str]) -> str:
        return (
            f"{m.group('head')}LANGUAGE plpgsql{m.group('tail')}AS $$\nBEGIN\n"
            f"    RAISE EXCEPTION '{m.group('name')} needs PL/Python, which this database "
            "does not have'\n"
            "        USING ERRCODE = @vocabulary.sqlstate_component_unavailable@,\n"
            "              HINT = 'plpython3u is a superuser''s extension (managed services do "
            "not offer it): pass query_embedding, write through the service, or see "
            "docs/managed-postgres.md';\n"
            "END $$;"
        )

    return _PLPYTHON_FUNCTION.sub(stub, text)


# PL/Python prefixes an error's message with the Python exception's type ("plpy.Error: ...");
# the functions users call are PL/pgSQL fronts over the PL/Python bodies, whose exception
# handler re-raises through memory._plain_error (sql/060_optimizer.sql). The handler is one
# text, here: a front's file writes the marker `@plain_errors@` on its own line where the
# handler goes (after the block's statements), and holds only the call of its body.
_PLAIN_ERRORS = re.compile(r"^(?P<indent>[ \t]*)@plain_errors@[ \t]*$", re.MULTILINE)
_PLAIN_ERRORS_HANDLER = """\
EXCEPTION WHEN OTHERS THEN
    DECLARE
        st text; m text; d text; h text;
    BEGIN
        GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, m = MESSAGE_TEXT,
                                d = PG_EXCEPTION_DETAIL, h = PG_EXCEPTION_HINT;
        PERFORM memory._plain_error(st, m, d, h);
    END;"""


def _with_plain_errors(text: str) -> str:
    def handler(m: re.Match[str]) -> str:
        return "\n".join(m.group("indent") + line for line in _PLAIN_ERRORS_HANDLER.split("\n"))

    return _PLAIN_ERRORS.sub(handler, text)


def render_sql(
    text: str, path: Path, *, roles: Roles, schema: str = "public", plpython: bool = True
) -> str:
    """A sql/ file's text (or a part of one, read from ``path``) as this database runs it:
    PL/Python functions as PM503 stubs where it has no plpython3u, the PL/pgSQL fronts'
    exception handler (``@plain_errors@``), the vocabulary's words,
    this database's role names, and pgvector's ``schema`` in the functions' search_path.
    Everything that runs the files' SQL renders it here, so no copy misses a marker."""
    text = _with_vocabulary(text if plpython else _without_plpython(text), path)
    return _with_vector_schema(roles.render(_with_plain_errors(text)), schema)


def _apply_sql_files(conn: psycopg.Connection[Any], schema: str, roles: Roles) -> list[Path]:
    files = sorted(SQL_DIR.glob("*.sql"))
    conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {_MARK} () ON COMMIT DROP")
    installed, _ = plpython_status(conn)
    # pgvector's hnsw.* settings exist once its library is loaded in this backend; before,
    # they are placeholders, which `SET hnsw.ef_search` in a function's definition may name
    # only as a superuser (42501). Reading a vector loads the library.
    conn.execute("SELECT '[1]'::vector")
    for path in files:
        text = render_sql(path.read_text(), path, roles=roles, schema=schema, plpython=installed)
        conn.execute(text.encode())
    _pin_search_path(conn, schema)
    if schema not in ("public", "pg_catalog"):
        # Readers resolve pgvector's type and operators through its schema.
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(schema), sql.Identifier(roles.reader)
            )
        )
    return files


# ---------------------------------------------------------------------------------------
# This database's roles (db/roles.py): chosen at the first migrate, recorded, then kept.
_LEGACY_HERE = """
SELECT CASE WHEN pg_catalog.to_regrole('memory_reader') IS NULL THEN false
            ELSE pg_catalog.has_schema_privilege('memory_reader', 'memory', 'USAGE') END
"""


def _recorded_prefix(conn: psycopg.Connection[Any]) -> str | None:
    """The prefix this database's first migrate recorded; None before it."""
    row = conn.execute("SELECT pg_catalog.to_regclass('memory.config') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return None
    found = conn.execute("SELECT value FROM memory.config WHERE key = 'role_prefix'").fetchone()
    return None if found is None else str(found[0])


def _default_prefix(conn: psycopg.Connection[Any]) -> str:
    name = conn.execute("SELECT pg_catalog.current_database()").fetchone()
    assert name is not None
    return prefix_for(str(name[0]))


def database_roles(conn: psycopg.Connection[Any], configured: str | None = None) -> Roles:
    """The roles the sql/ files name in this database: the recorded ones, else those its
    first migrate would choose (``configured``: POIMEN_ROLE_PREFIX)."""
    recorded = _recorded_prefix(conn)
    return Roles(recorded if recorded is not None else configured or _default_prefix(conn))


def _choose_roles(
    conn: psycopg.Connection[Any], configured: str | None
) -> tuple[Roles, Roles | None, bool]:
    """This database's roles; the cluster-wide ones its grants and members move from when
    it was migrated before roles were per database; whether its prefix is recorded. The
    first migrate records it (_record_roles: POIMEN_ROLE_PREFIX, else the database's name),
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
    legacy = conn.execute(_LEGACY_HERE).fetchone()
    moving = legacy is not None and bool(legacy[0]) and roles != LEGACY
    return roles, (LEGACY if moving else None), False


def _record_roles(conn: psycopg.Connection[Any], roles: Roles) -> None:
    conn.execute(
        "INSERT INTO memory.config (key, value) VALUES ('role_prefix', %s)", (roles.prefix,)
    )


def _move_roles(conn: psycopg.Connection[Any], old: Roles, new: Roles, schema: str) -> list[str]:
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
        if conn.execute("SELECT pg_catalog.to_regrole(%s)", (was,)).fetchone() == (None,):
            continue
        members = [
            str(r[0])
            for r in conn.execute(
                "SELECT m.rolname FROM pg_catalog.pg_auth_members a"
                " JOIN pg_catalog.pg_roles m ON m.oid = a.member"
                " WHERE a.roleid = pg_catalog.to_regrole(%s) AND m.rolname <> ALL (%s)"
                " ORDER BY 1",
                (was, ours),
            )
        ]
        for member in members:
            grant = sql.SQL("GRANT {} TO {}")
            conn.execute(grant.format(sql.Identifier(now), sql.Identifier(member)))
        conn.execute(
            "INSERT INTO memory.project_grants (role_name, project, can_write, granted_at)"
            " SELECT %s, g.project, g.can_write, g.granted_at FROM memory.project_grants g"
            " WHERE g.role_name = %s ON CONFLICT DO NOTHING",
            (now, was),
        )
        conn.execute("DELETE FROM memory.project_grants WHERE role_name = %s", (was,))
        ident = sql.Identifier(was)
        for what in ("TABLES", "FUNCTIONS", "SEQUENCES"):
            revoke = sql.SQL("REVOKE ALL ON ALL {} IN SCHEMA memory FROM {}")
            conn.execute(revoke.format(sql.SQL(what), ident))
        conn.execute(sql.SQL("REVOKE ALL ON SCHEMA memory FROM {}").format(ident))
        for (fn,) in conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p"
            " WHERE p.pronamespace = 'public'::regnamespace"
            " AND p.proname IN ('memory_query', 'memory_optimize_query')"
        ).fetchall():
            conn.execute(sql.SQL("REVOKE ALL ON FUNCTION {} FROM {}").format(sql.SQL(fn), ident))
        if schema not in ("public", "pg_catalog"):
            conn.execute(
                sql.SQL("REVOKE USAGE ON SCHEMA {} FROM {}").format(sql.Identifier(schema), ident)
            )
        if members:
            told.append(
                f"this database's roles are its own now: {now} in place of the cluster-wide"
                f" {was}, whose members here were granted {now}: {', '.join(members)}."
                f" {was} is shared by every database of the cluster: revoke {now} from any"
                " of them made for another database"
            )
    return told


_SHARED_ROLES = """
SELECT DISTINCT r.rolname::text, d.datname::text
FROM pg_catalog.pg_shdepend s
JOIN pg_catalog.pg_roles r ON r.oid = s.refobjid
JOIN pg_catalog.pg_database d ON d.oid = s.dbid
WHERE s.refclassid = 'pg_catalog.pg_authid'::regclass
  AND r.rolname = ANY (%s) AND d.datname <> pg_catalog.current_database()
ORDER BY 1, 2
"""


def _shared_roles(conn: psycopg.Connection[Any], roles: Roles, shown: int = 5) -> list[str]:
    """This database's roles holding privileges in other databases too (a TEMPLATE copy
    of this one, or one given the same POIMEN_ROLE_PREFIX): a grant made to them here
    reaches there. One warning, naming the first few of those databases."""
    dbs = sorted({str(db) for _role, db in conn.execute(_SHARED_ROLES, (list(roles.all),))})
    if not dbs:
        return []
    named = ", ".join(dbs[:shown]) + (f" and {len(dbs) - shown} more" if len(dbs) > shown else "")
    return [
        f"this database's roles ({', '.join(roles.all)}) also hold privileges in {named}:"
        " a grant made to them in one database reaches the others (a database gets roles of"
        " its own from POIMEN_ROLE_PREFIX at its first migrate)"
    ]


# Each attempt waits at most this long for a table's lock: a DDL statement queued behind a
# long reader makes every later query on that table queue behind it, so it must give up
# soon and try again later rather than wait the whole --lock-timeout.
_LOCK_ATTEMPT_S = 0.5

_T = TypeVar("_T")


def _lock(conn: psycopg.Connection[Any], wait_s: float, attempt_s: float) -> None:
    """The advisory lock (another migrate: waiting for it blocks nobody's query) within
    wait_s, then a short lock_timeout for everything else the transaction locks."""
    conn.execute(
        sql.SQL("SET LOCAL lock_timeout = {}").format(
            sql.Literal(f"{max(int(wait_s * 1000), 1)}ms")
        )
    )
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
    conn.execute(
        sql.SQL("SET LOCAL lock_timeout = {}").format(
            sql.Literal(f"{max(int(attempt_s * 1000), 1)}ms")
        )
    )


# Who holds a lock on the memory schema's relations (or migrate's advisory lock): named when
# an attempt gave up, so the operator knows what it waited for.
_HOLDERS = r"""
SELECT coalesce(l.relation::regclass::text, 'the advisory lock of another migrate'), l.mode,
       a.pid, a.usename, a.state,
       extract(epoch FROM (now() - coalesce(a.xact_start, a.query_start)))::integer,
       left(regexp_replace(a.query, '\s+', ' ', 'g'), 120)
FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.pid <> pg_catalog.pg_backend_pid()
  AND ((l.locktype = 'relation' AND l.database = (SELECT oid FROM pg_catalog.pg_database
                                                   WHERE datname = current_database())
        AND l.relation IN (SELECT c.oid FROM pg_catalog.pg_class c
                           WHERE c.relnamespace = 'memory'::regnamespace))
       OR (l.locktype = 'advisory' AND l.objid = %s))
ORDER BY 1, 3
"""


def _waited_for(conn: psycopg.Connection[Any], exc: psycopg.errors.LockNotAvailable) -> str:
    """The statement that gave up (PostgreSQL's context names it) and the sessions holding
    locks on the schema at that moment."""
    where = (exc.diag.context or "").strip().splitlines()
    stmt = where[0] if where else (exc.diag.message_primary or str(exc)).strip()
    try:
        holders = conn.execute(_HOLDERS, (_LOCK_KEY & 0xFFFFFFFF,)).fetchall()
    except psycopg.Error:
        holders = []
    held = "; ".join(
        f"{rel} {mode} held by pid {pid} ({user}, {state} for {age} s: {query})"
        for rel, mode, pid, user, state, age, query in holders
    )
    return f"{stmt}" + (f" -- {held}" if held else "")


def _retrying(
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
            return attempt(left, min(_LOCK_ATTEMPT_S, left)), waits
        except psycopg.errors.LockNotAvailable as exc:
            waits.append(_waited_for(conn, exc))
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
        f"{_LOCK_ATTEMPT_S:g} s)",
        detail=f"{str(exc).strip()}; waited for: {waits[-1] if waits else '?'}",
        hint="another migrate, a long transaction or a DBA session holds a lock on the memory "
        "schema: find it in pg_stat_activity / pg_locks, or retry with a longer --lock-timeout",
    )


def _notice_text(source: str, diag: psycopg.errors.Diagnostic) -> str:
    parts = [f"{source}: {diag.message_primary}"]
    parts += [
        f"{k}: {v}" for k, v in (("detail", diag.message_detail), ("hint", diag.message_hint)) if v
    ]
    return "\n".join(parts)


def plpython_sources() -> dict[str, str]:
    """poimen_core's files as memory._plpython_modules holds them (name to source), and the
    tokenizer memory.embed loads (the model itself comes with the embedder's packages)."""
    out = {f.name: f.read_text() for f in sorted(PLPYTHON_SRC.glob("*.py"))}
    out[TOKENIZER.name] = TOKENIZER.read_text()
    return out


def _write_modules(conn: psycopg.Connection[Any]) -> None:
    """This code's poimen_core into memory._plpython_modules (migration 0017), so that the
    database imports it without reading any file of this host; a row already right is not
    rewritten, and a file this version no longer has is removed."""
    if conn.execute("SELECT to_regclass('memory._plpython_modules')").fetchone() == (None,):
        return  # a ledger staged before 0017 (tests of older releases' upgrades)
    src = plpython_sources()
    rows = [(n, t, hashlib.sha256(t.encode()).hexdigest()) for n, t in src.items()]
    conn.execute("DELETE FROM memory._plpython_modules WHERE NOT (name = ANY(%s))", (list(src),))
    with conn.cursor() as cur:
        cur.executemany(
            """INSERT INTO memory._plpython_modules (name, source, checksum) VALUES (%s, %s, %s)
               ON CONFLICT (name) DO UPDATE SET source = EXCLUDED.source,
                   checksum = EXCLUDED.checksum
               WHERE memory._plpython_modules.source IS DISTINCT FROM EXCLUDED.source""",
            rows,
        )


def _module_findings(conn: psycopg.Connection[Any]) -> list[str]:
    """How memory._plpython_modules differs from this code's poimen_core: a row edited by
    hand (its source, or its checksum column), missing, or not from this code."""
    if conn.execute("SELECT to_regclass('memory._plpython_modules')").fetchone() == (None,):
        return []
    have = {
        str(n): (str(t), str(c))
        for n, t, c in conn.execute("SELECT name, source, checksum FROM memory._plpython_modules")
    }
    out: list[str] = []
    for name, text in plpython_sources().items():
        digest = hashlib.sha256(text.encode()).hexdigest()
        if name not in have:
            out.append(f"plpython module missing (migrate restores it): {name}")
        elif have[name][0] != text or have[name][1] != digest:
            out.append(
                f"plpython module changed by hand: {name}: sha256 "
                f"{hashlib.sha256(have[name][0].encode()).hexdigest()[:16]}, recorded "
                f"{have[name][1][:16]} (migrate makes it: {digest[:16]})"
            )
    out += [
        f"plpython module not from this code (migrate removes it): {n}"
        for n in sorted(set(have) - set(plpython_sources()))
    ]
    return out


def _write_config(conn: psycopg.Connection[Any], py_path: str, deps: Path | None) -> None:
    """The product's keys in memory.config (where PL/Python imports from), as migrate sets
    them; a row already right is not rewritten."""
    conn.execute(
        """INSERT INTO memory.config (key, value) VALUES
               ('plpython_path', %s), ('plpython_checksum', %s)
           ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
           WHERE memory.config.value IS DISTINCT FROM EXCLUDED.value""",
        (py_path, plpython_checksum()),
    )
    if deps is None:  # memory.embed then says to run `make setup` on this host
        conn.execute("DELETE FROM memory.config WHERE key = 'plpython_deps'")
    else:
        conn.execute(
            """INSERT INTO memory.config (key, value) VALUES ('plpython_deps', %s)
               ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
               WHERE memory.config.value IS DISTINCT FROM EXCLUDED.value""",
            (str(deps),),
        )


def migrate(
    conn: psycopg.Connection[Any],
    plpython_root: Path | None,
    *,
    lock_timeout_s: float = 10.0,
    role_prefix: str | None = None,
    build_lock_timeout_s: float = GRAPH_BUILD_LOCK_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> MigrateReport:
    """Migrations, then sql/, in one transaction; then, committed, the large projects' own
    HNSW graphs that are missing (build_project_graphs: concurrently, each waiting at most
    build_lock_timeout_s; progress is told of each). role_prefix: POIMEN_ROLE_PREFIX, used by
    the first migrate of a database only (db/roles.py)."""
    for d in (MIGRATIONS_DIR, SQL_DIR):
        if not d.is_dir():
            raise MigrationError(
                f"{d} does not exist",
                hint="run from a source checkout (pip install -e .); the SQL ships beside the code",
            )
    py_target: Path | None = None
    in_database = plpython_root is not None and _module_root(plpython_root) is None
    plpython_root = _module_root(plpython_root)
    if plpython_root is not None:
        py_target = install_plpython(plpython_root)
    py_path = None if py_target is None else str(py_target)
    deps = None if plpython_root is None else server_python_deps(plpython_root.parent)

    def attempt(
        wait_s: float, attempt_s: float
    ) -> tuple[list[str], list[str], list[str], str, list[Path], Roles]:
        applied: list[str] = []
        already: list[str] = []
        notices: list[str] = []
        with conn.transaction():
            _lock(conn, wait_s, attempt_s)
            conn.execute(_LEDGER)
            # Independent of the session's search_path (even ''): public, plus pgvector's schema.
            _use_vector_schema(conn, vector_schema(conn) or "public")
            rows = conn.execute("SELECT version, checksum FROM memory.schema_migrations").fetchall()
            recorded: dict[str, str] = {str(r[0]): str(r[1]) for r in rows}
            for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
                version, checksum = path.stem, _checksum(path)
                if version in recorded:
                    if recorded[version] != checksum:
                        raise MigrationError(
                            f"migration {path.name} was edited after it was applied",
                            detail=f"recorded checksum {recorded[version]}, file has {checksum}",
                            hint="released migrations are frozen: add a new migration instead",
                        )
                    already.append(version)
                    continue

                # Only the migrations' own notices: the sql/ files' "already exists,
                # skipping" would bury them.
                def tell(diag: psycopg.errors.Diagnostic, name: str = path.name) -> None:
                    notices.append(_notice_text(name, diag))

                conn.add_notice_handler(tell)
                text = path.read_text()
                if not plpython_status(conn)[1]:
                    text = _PLPYTHON_EXTENSION.sub(
                        "-- plpython3u: not in this database, and this role may not create it",
                        text,
                    )
                try:
                    conn.execute(text.encode())
                finally:
                    conn.remove_notice_handler(tell)
                conn.execute(
                    "INSERT INTO memory.schema_migrations (version, checksum) VALUES (%s, %s)",
                    (version, checksum),
                )
                applied.append(version)
            unknown = set(recorded) - {p.stem for p in MIGRATIONS_DIR.glob("*.sql")}
            if unknown:
                raise MigrationError(
                    f"database has migrations this code does not know: {sorted(unknown)}",
                    hint="deploy a newer poimen-memory; migrations are forward-only",
                )
            schema = vector_schema(conn) or "public"
            _use_vector_schema(conn, schema)
            if py_path is not None:
                _write_config(conn, py_path, deps)
            _write_modules(conn)
            if in_database:
                conn.execute("DELETE FROM memory.config WHERE key = 'plpython_path'")
            conn.execute(
                """INSERT INTO memory.config (key, value) VALUES ('plpython_checksum', %s)
                   ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
                   WHERE memory.config.value IS DISTINCT FROM EXCLUDED.value""",
                (plpython_checksum(),),
            )
            roles, move_from, kept = _choose_roles(conn, role_prefix)
            if not kept:
                _record_roles(conn, roles)
            sql_files = _apply_sql_files(conn, schema, roles)
            if move_from is not None:
                notices.extend(_move_roles(conn, move_from, roles, schema))
        return applied, already, notices, schema, sql_files, roles

    (applied, already, notices, schema, sql_files, roles), waits = _retrying(
        conn, lock_timeout_s, attempt
    )
    graphs = build_project_graphs(conn, lock_timeout_s=build_lock_timeout_s, progress=progress)
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
        _shared_roles(conn, roles),
        scale_warnings(conn),
        graphs,
    )


def _plpython_findings(
    conn: psycopg.Connection[Any], plpython_root: Path | None
) -> tuple[str | None, list[str]]:
    """The plpython_path migrate would record (when this host installs the module), and
    what is wrong with the recorded keys that comparing with it cannot tell."""
    code = plpython_checksum()
    plpython_root = _module_root(plpython_root)
    if plpython_root is not None:
        expected = plpython_root / code[:16]
        found = (
            []
            if (expected / "poimen_core" / "__init__.py").exists()
            else [f"config missing (migrate restores it): PL/Python module directory {expected}"]
        )
        return str(expected), found
    rows = dict(
        conn.execute(
            "SELECT key, value FROM memory.config"
            " WHERE key IN ('plpython_path', 'plpython_checksum')"
        ).fetchall()
    )
    found = []
    if "plpython_path" in rows:
        if rows.get("plpython_checksum") != code:
            found.append(
                "config changed by hand: memory.config plpython_checksum: "
                f"{rows.get('plpython_checksum')} (this code: {code})"
            )
        if Path(str(rows["plpython_path"])).name != code[:16]:
            found.append(
                "config changed by hand: memory.config plpython_path: "
                f"{rows['plpython_path']} (migrate installs the module into <root>/{code[:16]})"
            )
    return None, found


def check(
    conn: psycopg.Connection[Any],
    *,
    lock_timeout_s: float = 10.0,
    plpython_root: Path | None = None,
    role_prefix: str | None = None,
) -> DriftReport:
    """Compare the database with migrations/ and sql/ without changing it. plpython_root:
    where migrate installs the PL/Python module on this host (then memory.config is compared
    with what migrate would write there); without it only the keys' consistency is."""

    def attempt(wait_s: float, attempt_s: float) -> DriftReport:
        with conn.transaction(force_rollback=True):
            _lock(conn, wait_s, attempt_s)
            if conn.execute("SELECT to_regclass('memory.schema_migrations')").fetchone() == (None,):
                pending = sorted(p.stem for p in MIGRATIONS_DIR.glob("*.sql"))
                return DriftReport(pending, [], [], [])
            recorded = {
                str(r[0]) for r in conn.execute("SELECT version FROM memory.schema_migrations")
            }
            pending = sorted(p.stem for p in MIGRATIONS_DIR.glob("*.sql") if p.stem not in recorded)
            schema = vector_schema(conn) or "public"
            _use_vector_schema(conn, schema)
            before = dict(conn.execute(_SNAPSHOT).fetchall())
            if pending:  # the files need the pending migrations' tables: report those only
                return DriftReport(pending, [], [], [])
            roles, move_from, kept = _choose_roles(conn, role_prefix)
            compared = (roles,) if move_from is None else (roles, move_from)
            protected = _protection(conn, *compared)
            if not kept:  # a finding: "config missing (migrate restores it)"
                _record_roles(conn, roles)
            py_path, found = _plpython_findings(conn, plpython_root)
            if py_path is not None and plpython_root is not None:
                _write_config(conn, py_path, _deps_target(plpython_root.parent))
            # Nothing is dropped for a rollback either (sql/088_indexes.sql reads this).
            conn.execute("SELECT set_config('poimen.migrate_check', 'on', true)")
            _apply_sql_files(conn, schema, roles)
            if move_from is not None:
                _move_roles(conn, move_from, roles, schema)
            after = dict(conn.execute(_SNAPSHOT).fetchall())
            touched = {str(r[0]) for r in conn.execute(_TOUCHED)}
            found = (
                _findings(protected, _protection(conn, *compared)) + found + _module_findings(conn)
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
            extra=sorted(s for s in before if s not in touched),
            findings=found,
            warnings=_shared_roles(conn, roles),
            scale_warnings=outgrown,
            project_graphs=graphs,
        )

    report, waits = _retrying(conn, lock_timeout_s, attempt)
    return replace(report, lock_waits=waits)
