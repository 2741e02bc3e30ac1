"""`poimen-memory`: the embedded cluster, migrations, ingest, queries and the server."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import psycopg

from poimen_core import vocabulary
from poimen_memory.db.connect import (
    connect,
    database_url,
    embedded_cluster,
    embedded_replica,
    ensure_service_login,
    service_database_url,
)
from poimen_memory.db.wrap import translate
from poimen_memory.errors import PoimenError
from poimen_memory.settings import Settings


def _settings() -> Settings:
    return Settings.from_env()


def _url(s: Settings) -> str:
    """The database URL, starting the embedded cluster first when none is configured."""
    return database_url(s, start=True)


def cmd_db(args: argparse.Namespace) -> int:
    s = _settings()
    if s.database_url and args.action != "url":
        print("POIMEN_DATABASE_URL is set: the embedded cluster is not used", file=sys.stderr)
        return 2
    if args.action == "replica":
        return _replica(s, args.replica_action)
    if args.replica_action:
        print(f"error: `db {args.action}` takes no further argument", file=sys.stderr)
        return 2
    if args.action == "url":
        print(database_url(s))
        return 0
    cluster = embedded_cluster(s)
    if args.action == "start":
        cluster.start()
        print(f"running: {cluster.url()}  (data {cluster.data_dir}, log {cluster.log_file})")
    elif args.action == "stop":
        cluster.stop()
        print("stopped")
    elif args.action == "status":
        up = cluster.initialized() and cluster.running()
        print(
            f"{'running' if up else 'stopped'}: data {cluster.data_dir}, port {cluster.port}, "
            f"socket {cluster.socket_dir}"
        )
        return 0 if up else 3
    return 0


def _replica(s: Settings, action: str | None) -> int:
    """`db replica start|stop|status|url`: a streaming standby of the embedded cluster, made
    with pg_basebackup under POIMEN_HOME/replica on POIMEN_REPLICA_PG_PORT."""
    if action is None:
        print("error: db replica needs start, stop, status or url", file=sys.stderr)
        return 2
    replica = embedded_replica(s)
    # The URL for POIMEN_READ_URLS is the service's own login role, as `serve` uses on the
    # primary: as postgres (a superuser) replica reads would skip row-level security.
    read_url = replica.url(user=s.service_role)
    if action == "url":
        print(read_url)
        return 0
    if action == "start":
        primary = embedded_cluster(s)
        primary.start()
        replica.make_standby_of(primary)
        replica.start()
        print(
            f"streaming standby running: {replica.url()}  (data {replica.data_dir}, "
            f"log {replica.log_file})"
        )
        print(f"hint: POIMEN_READ_URLS={read_url}", file=sys.stderr)
    elif action == "stop":
        replica.stop()
        print("stopped")
    else:
        if not (replica.initialized() and replica.running()):
            print(f"stopped: data {replica.data_dir}, port {replica.port}")
            return 3
        from poimen_memory.db.queries import q

        primary_lsn = None
        if embedded_cluster(s).running():
            with connect(database_url(s)) as conn:
                primary_lsn = conn.execute(q("primary_wal_lsn")).fetchone()[0]  # type: ignore[index]
        with connect(replica.url()) as conn:
            row = conn.execute(q("replica_state"), {"primary_lsn": primary_lsn}).fetchone()
            assert row is not None
            recovery, behind, since, paused = row
            receiver = conn.execute(q("wal_receiver_status")).fetchone()
        lag = 0.0 if not behind or behind <= 0 else since
        print(
            f"running: {'standby' if recovery else 'NOT a standby (promoted?)'}, "
            f"wal receiver {receiver[0] if receiver else 'not running'}, "
            f"behind {int(behind or 0)} bytes, lag "
            f"{'unknown' if lag is None else f'{lag:.3f}s'}"
            f"{', replay paused' if paused else ''}; port {replica.port}, data {replica.data_dir}"
        )
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from poimen_memory.db.migrate import check, migrate

    s = _settings()
    if args.check:
        with connect(_url(s), autocommit=True) as conn:
            drift = check(conn, lock_timeout_s=args.lock_timeout)
        for label, items in (
            ("pending migration", drift.pending_migrations),
            ("changed by hand (differs from sql/)", drift.changed),
            ("missing (sql/ defines it)", drift.missing),
            ("not from sql/ (left alone)", drift.extra),
        ):
            for item in items:
                print(f"{label}: {item}")
        print(
            "no drift"
            if drift.clean
            else "drift found: run `poimen-memory migrate` to re-apply sql/"
        )
        return 0 if drift.clean else 1
    root = None if args.no_plpython else s.plpython_root
    with connect(_url(s), autocommit=True) as conn:
        report = migrate(conn, root, lock_timeout_s=args.lock_timeout)
        if not s.database_url:  # a DBA's cluster: the DBA makes the service's login role
            ensure_service_login(conn, s.service_role)
    for notice in report.notices:
        print(f"notice: {notice}", file=sys.stderr)
    print(
        f"migrations applied: {report.applied or 'none'}; already: {len(report.already)}; "
        f"sql files: {len(report.sql_files)}; plpython: {report.plpython_path}; "
        f"embedder packages: {report.embedder_path or 'none (run `make setup`)'}; "
        f"vector schema: {report.vector_schema}"
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
    with connect(_url(s), autocommit=True) as conn:
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


def _embedder(s: Settings) -> Any:
    from poimen_memory.embedders.factory import build_embedder

    return build_embedder(s.embedding)


def cmd_ingest(args: argparse.Namespace) -> int:
    from poimen_memory.db.migrate import migrate
    from poimen_memory.ingest.nodes import parse_lines
    from poimen_memory.ingest.writer import ingest

    s = _settings()
    path = Path(args.file)
    if not path.exists():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    with path.open(encoding="utf-8") as f:
        records, invalid = parse_lines(f, args.project)
    embedder = _embedder(s)
    with connect(_url(s), autocommit=True) as conn:
        migrate(conn, s.plpython_root)
        if s.opensearch.url is not None:
            from poimen_memory.ingest.outbox import enable_outbox

            enable_outbox(conn)
        report = ingest(
            conn,
            records,
            embedder,
            invalid=invalid,
            skip_invalid=args.skip_invalid,
            batch_size=args.batch or s.ingest_batch,
            embed_group=s.ingest_embed_group,
            progress=not args.quiet,
        )
    for err in report.invalid[:20]:
        print(f"skipped {err}", file=sys.stderr)
    for line_no, parent in report.unresolved[:20]:
        print(f"unresolved parent on line {line_no}: {parent!r}", file=sys.stderr)
    print(report.summary())
    if args.json:
        print(json.dumps(report.to_json()))
    return 0


def cmd_reembed(args: argparse.Namespace) -> int:
    from poimen_memory.db.queries import q
    from poimen_memory.progress import Progress

    s = _settings()
    embedder = _embedder(s)
    with connect(_url(s), autocommit=True) as conn:
        total = conn.execute(q("count_nodes")).fetchone()[0]  # type: ignore[index]
        with conn.transaction():
            conn.execute(q("reset_embedding"), {"model": embedder.model_name, "dim": embedder.dim})
        from pgvector.psycopg import register_vector

        register_vector(conn)
        after = 0
        with Progress(total, "reembed", "nodes") as bar:
            while True:
                rows = conn.execute(
                    q("nodes_for_reembed"), {"after": after, "limit": 256}
                ).fetchall()
                if not rows:
                    break
                vecs = embedder.embed_documents([r[1] for r in rows])
                with conn.transaction(), conn.cursor() as cur:
                    cur.executemany(
                        q("update_embedding"),
                        [{"id": r[0], "embedding": v} for r, v in zip(rows, vecs, strict=True)],
                    )
                after = rows[-1][0]
                bar.update(len(rows))
    print(f"re-embedded {total} nodes with {embedder.model_name} ({embedder.dim} dims)")
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    import asyncio

    from poimen_memory.cli.render import render_response

    s = _settings()
    if args.url:
        import httpx

        params = {
            "query": args.text,
            "level": args.level,
            "limit": str(args.limit),
            "timeout_seconds": str(args.timeout),
        }
        if args.project:
            params["project"] = args.project
        if args.fusion:
            params["fusion"] = args.fusion
        r = httpx.get(
            f"{args.url.rstrip('/')}/memory/query", params=params, timeout=args.timeout + 5
        )
        body = r.json()
        if r.status_code != 200:
            print(f"HTTP {r.status_code}: {json.dumps(body)}", file=sys.stderr)
            return 1
        print(json.dumps(body, indent=2) if args.json else render_response(body))
        return 0
    from dataclasses import replace

    from poimen_memory.retrieval.models import QueryRequest
    from poimen_memory.services import open_services

    url = _url(s)

    async def run() -> dict[str, Any]:
        # The same wiring as the server (reranker and OpenSearch included), on a small pool.
        small = replace(s, pool_min=1, pool_max=4)
        async with open_services(small, url=url, wait=True) as svc:
            req = QueryRequest(
                query=args.text,
                project=args.project,
                levels=tuple(args.level.split(",")),
                limit=max(1, min(args.limit, s.max_limit)),
                timeout_s=args.timeout,
                fusion=args.fusion,
            )
            return await svc.retriever.query(req)

    resp = asyncio.run(run())
    if args.json:
        print(json.dumps(resp, indent=2, default=str))
    else:
        print(render_response(resp))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from poimen_memory.api.app import create_app
    from poimen_memory.api.http_protocol import FirstRequestDeadline

    s = _settings()
    # Start the embedded cluster (when no URL is configured) before serving.
    url = _url(s)
    if not _loopback(args.host) and not args.allow_anonymous and not _has_keys(url):
        print(
            f"error: refusing to serve on {args.host} without authentication",
            file=sys.stderr,
        )
        print(
            "hint: create API keys (poimen-memory keys create), bind 127.0.0.1 (the "
            "default), or pass --allow-anonymous if a proxy in front authenticates clients",
            file=sys.stderr,
        )
        return 2
    # The superuser only migrates; the service runs as its own role, under row-level security.
    app = create_app(_service_settings(s))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # The JSON request log replaces the access log, which would print query text.
        access_log=False,
        # Also the time a new connection has to send its first request (http_protocol.py).
        http=FirstRequestDeadline,
        timeout_keep_alive=s.http_keep_alive_s,
        limit_concurrency=s.http_max_concurrency,
        h11_max_incomplete_event_size=s.http_max_header_bytes,
    )
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    import asyncio

    from poimen_memory.api.mcp_server import serve_stdio

    # As `serve`: the service's role under row-level security, the key from the environment
    # (stdout is the protocol's: nothing else may print there).
    s = _service_settings(_settings())
    asyncio.run(serve_stdio(s, api_key=s.api_key))
    return 0


def _service_settings(s: Settings) -> Settings:
    """What `serve` and `mcp` run with: the embedded cluster (when no URL is configured)
    started and migrated, and the service's own role, never the superuser."""
    from dataclasses import replace

    from poimen_memory.db.migrate import migrate

    url = _url(s)
    if not s.database_url:
        with connect(url, autocommit=True) as conn:
            migrate(conn, s.plpython_root)  # the service's role needs memory_service
            ensure_service_login(conn, s.service_role)
    return replace(s, database_url=service_database_url(s))


def _has_keys(url: str) -> bool:
    from poimen_memory.db.queries import q

    with connect(url) as conn:
        return any(r[6] is None for r in conn.execute(q("keys_list")).fetchall())


def cmd_keys(args: argparse.Namespace) -> int:
    from poimen_memory.api.auth import key_hash, new_key
    from poimen_memory.db.migrate import migrate
    from poimen_memory.db.queries import q

    s = _settings()
    with connect(_url(s), autocommit=True) as conn:
        if args.action == "create":
            if not args.project:
                print("error: keys create needs at least one --project", file=sys.stderr)
                return 2
            from poimen_memory.ingest.nodes import PROJECT_NAME

            # The same rule as memory.projects: a key for '*' or 'a,b' would otherwise assert
            # every project (or two) to row-level security (db/tenant.py joins them with ',').
            bad = [p for p in args.project if not PROJECT_NAME.fullmatch(p)]
            if bad:
                print(f"error: invalid project name {bad[0]!r}", file=sys.stderr)
                print(
                    f"hint: a project name matches {vocabulary.PROJECT_NAME} "
                    "(no '*', no ',': a key lists each of its projects with its own --project)",
                    file=sys.stderr,
                )
                return 2
            migrate(conn, s.plpython_root)
            key = new_key()
            conn.execute(
                q("key_insert"),
                {
                    "key_hash": key_hash(key),
                    "prefix": key[:12],
                    "projects": sorted(set(args.project)),
                    "can_write": args.write,
                    "note": args.note,
                },
            )
            print(key)
            print(
                "keep it: it is shown once; every request now needs Authorization: Bearer <key>",
                file=sys.stderr,
            )
        elif args.action == "list":
            for kid, prefix, projects, write, note, _created, revoked in conn.execute(
                q("keys_list")
            ).fetchall():
                state = f"revoked {revoked:%Y-%m-%d}" if revoked else "active"
                mode = "read-write" if write else "read-only"
                print(f"{kid}\t{prefix}…\t{mode}\t{','.join(projects)}\t{state}\t{note or ''}")
        else:
            if not args.key:
                print("error: keys revoke needs the key's id or prefix", file=sys.stderr)
                return 2
            rows = conn.execute(q("key_revoke"), {"key": args.key}).fetchall()
            if not rows:
                print(f"error: no active key {args.key!r}", file=sys.stderr)
                return 3
            print(f"revoked key {rows[0][0]} ({rows[0][1]}…)")
    return 0


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_opensearch(args: argparse.Namespace) -> int:
    from poimen_memory.ingest.outbox import enable_outbox, reindex, sync_outbox
    from poimen_memory.upstreams.opensearch import engine_from_settings

    s = _settings()
    engine = engine_from_settings(s.opensearch)
    if engine is None:
        print("error: POIMEN_OPENSEARCH_URL is not set", file=sys.stderr)
        return 2
    with connect(_url(s), autocommit=True) as conn:
        enable_outbox(conn)
        if args.action == "sync":
            report = sync_outbox(
                conn,
                engine,
                batch_size=s.opensearch.sync_batch,
                max_attempts=s.opensearch.max_attempts,
                backoff_base_s=s.opensearch.backoff_s,
            )
            print(report)
            return 0 if report.remaining == 0 else 4
        n = reindex(conn, engine, batch_size=s.opensearch.sync_batch)
        print(f"reindexed {n} nodes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poimen-memory", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    db = sub.add_parser("db", help="the embedded PostgreSQL cluster")
    db.add_argument("action", choices=["start", "stop", "status", "url", "replica"])
    db.add_argument(
        "replica_action",
        nargs="?",
        choices=["start", "stop", "status", "url"],
        help="with `replica`: a streaming standby of the embedded cluster (docs/scaling.md)",
    )
    db.set_defaults(func=cmd_db)
    mg = sub.add_parser("migrate", help="apply migrations, then sql/ (one transaction)")
    mg.add_argument(
        "--no-plpython",
        action="store_true",
        help="do not install the PL/Python module (remote database server)",
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
        help="change nothing: report pending migrations and sql/ functions edited by hand (exit 1)",
    )
    mg.add_argument(
        "--lock-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="give up when a lock is not granted within this time (default 10)",
    )
    mg.set_defaults(func=cmd_migrate)
    ing = sub.add_parser("ingest", help="load a nodes.jsonl file (idempotent)")
    ing.add_argument("file")
    ing.add_argument("--project", help="project for lines that name none")
    ing.add_argument(
        "--skip-invalid", action="store_true", help="skip bad lines instead of aborting"
    )
    ing.add_argument("--batch", type=int, help="nodes per insert transaction (POIMEN_INGEST_BATCH)")
    ing.add_argument("--quiet", action="store_true")
    ing.add_argument("--json", action="store_true", help="also print the report as JSON")
    ing.set_defaults(func=cmd_ingest)
    re_ = sub.add_parser("reembed", help="re-embed every node after an embedding model change")
    re_.set_defaults(func=cmd_reembed)
    qy = sub.add_parser("query", help="query and print results with their citations")
    qy.add_argument("text")
    qy.add_argument("--project")
    qy.add_argument("--level", default="L1,L2")
    qy.add_argument("--limit", type=int, default=5)
    qy.add_argument("--timeout", type=float, default=10.0, help="seconds (server clamps to 1-30)")
    qy.add_argument("--fusion", choices=["rrf", "convex"], default=None)
    qy.add_argument("--json", action="store_true")
    qy.add_argument("--url", help="query a running server (e.g. http://127.0.0.1:8765) instead")
    qy.set_defaults(func=cmd_query)
    sv = sub.add_parser("serve", help="run the HTTP service (uvicorn)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--log-level", default="info")
    sv.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve on a non-loopback address without authentication",
    )
    sv.set_defaults(func=cmd_serve)
    ky = sub.add_parser("keys", help="API keys for the HTTP service")
    ky.add_argument("action", choices=["create", "list", "revoke"])
    ky.add_argument("key", nargs="?", help="revoke: the key's id or prefix")
    ky.add_argument("--project", action="append", help="a project the key covers (repeat)")
    ky.add_argument("--write", action="store_true", help="also allow POST /memory/nodes")
    ky.add_argument("--note", help="who or what the key is for")
    ky.set_defaults(func=cmd_keys)
    mc = sub.add_parser(
        "mcp",
        help="the MCP server for agents on stdin/stdout (docs/mcp.md; the service also "
        "serves it at POST /mcp); POIMEN_API_KEY is its key",
    )
    mc.set_defaults(func=cmd_mcp)
    os_ = sub.add_parser("opensearch", help="OpenSearch dual-write maintenance")
    os_.add_argument("action", choices=["sync", "reindex"])
    os_.set_defaults(func=cmd_opensearch)
    # Commands from other installed packages (the lab's eval and bench), by entry point.
    for ep in entry_points(group="poimen_memory.commands"):
        ep.load()(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except psycopg.Error as exc:
        return _report(translate(exc))
    except PoimenError as err:
        return _report(err)
    except KeyboardInterrupt:
        return 130


def _report(err: PoimenError) -> int:
    """One typed error as a few lines on stderr: what, the context, and what to do."""
    where = f" ({err.sqlstate})" if err.sqlstate else ""
    print(f"error{where}: {err.message}", file=sys.stderr)
    if err.detail:
        print(err.detail, file=sys.stderr)
    if err.hint:
        print(f"hint: {err.hint}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
