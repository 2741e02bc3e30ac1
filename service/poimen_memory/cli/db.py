"""The embedded PostgreSQL cluster and its streaming replica: `poimen-memory db`."""

from __future__ import annotations

import argparse
import sys

from poimen_memory.cli.common import load_settings
from poimen_memory.db.connect import (
    connect,
    database_url,
    embedded_cluster,
    embedded_replica,
)
from poimen_memory.settings import Settings


def cmd_db(args: argparse.Namespace) -> int:
    s = load_settings()
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
        print(f"running: {cluster.url()}  (data {cluster.data_dir}, log {cluster.log_dir})")
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
            f"log {replica.log_dir})"
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


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    db = sub.add_parser("db", help="the embedded PostgreSQL cluster")
    db.add_argument("action", choices=["start", "stop", "status", "url", "replica"])
    db.add_argument(
        "replica_action",
        nargs="?",
        choices=["start", "stop", "status", "url"],
        help="with `replica`: a streaming standby of the embedded cluster (docs/scaling.md)",
    )
    db.set_defaults(func=cmd_db)
