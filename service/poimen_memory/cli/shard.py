"""`poimen-memory shard`: partitions over several PostgreSQL servers behind a PL/Proxy proxy
database (docs/scaling.md#pl-proxy): init, migrate (--check), status, move."""

from __future__ import annotations

import argparse
import sys

from poimen_memory.cli.common import load_settings, notice
from poimen_memory.errors import ValidationError
from poimen_memory.settings import Settings
from poimen_memory.shard import DEFAULT_PROXY_ROLE, PartitionReport, init, migrate_all, move, status

PROXY_URL_ENV = "POIMEN_PROXY_URL"
PASSWORD_ENV = "POIMEN_PROXY_PASSWORD"


def _proxy(args: argparse.Namespace, s: Settings) -> str:
    url = args.proxy or s.proxy_url
    if not url:
        raise ValidationError(
            "which proxy database?",
            hint=f"--proxy URL (as the proxy's owner), or {PROXY_URL_ENV}",
        )
    return str(url)


def _line(r: PartitionReport) -> str:
    head = f"p{r.partition.number} {r.partition.conninfo}"
    if r.error:
        return f"{head}: ERROR {r.error}"
    if r.drift is not None:
        d = r.drift
        what = (
            "no drift"
            if d.clean
            else (
                f"drift: {len(d.pending_migrations)} pending, {len(d.changed)} changed, "
                f"{len(d.missing)} missing, {len(d.findings)} findings"
            )
        )
        return "\n  ".join(
            [f"{head}: {what}", *d.pending_migrations, *d.changed, *d.missing, *d.findings]
        )
    if r.migrate is not None:
        return f"{head}: migrated (applied: {r.migrate.applied or 'none'})"
    return f"{head}: {r.nodes} current nodes, {r.projects} projects"


def cmd_shard(args: argparse.Namespace) -> int:
    s = load_settings()
    proxy = _proxy(args, s)
    password = s.proxy_password
    common = {
        "proxy_role": args.proxy_role,
        "proxy_password": password,
        "admin_user": args.admin_user,
    }
    root = None if getattr(args, "no_plpython", False) else s.plpython_root
    if args.action == "init":
        reports = init(
            proxy,
            args.server,
            args.partitions,
            prefix=args.prefix,
            service_role=s.service_role,
            plpython_root=root,
            progress=notice,
            **common,
        )
    elif args.action == "migrate":
        reports = migrate_all(
            proxy, service_role=s.service_role, plpython_root=root, only_check=args.check, **common
        )
    elif args.action == "status":
        reports = status(proxy, admin_user=args.admin_user)
    else:
        moved = move(proxy, args.partition, args.to, plpython_root=root, progress=notice, **common)
        print(f"p{moved.number} {moved.conninfo}: moved")
        return 0
    for r in reports:
        print(_line(r))
    bad = [r for r in reports if r.error or (r.drift is not None and not r.drift.clean)]
    if bad:
        print(f"{len(bad)} of {len(reports)} partitions need attention", file=sys.stderr)
    return 1 if bad else 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sh = sub.add_parser(
        "shard",
        help="partitions over several servers behind a PL/Proxy proxy (docs/scaling.md)",
    )
    sh.add_argument("--proxy", help=f"the proxy database's URL (default: ${PROXY_URL_ENV})")
    sh.add_argument(
        "--proxy-role",
        default=DEFAULT_PROXY_ROLE,
        help="the role the proxy logs in to the partitions as (its password: "
        f"${PASSWORD_ENV}; none: peer or trust authentication)",
    )
    sh.add_argument(
        "--admin-user",
        default="postgres",
        help="the superuser the command connects to each server as",
    )
    acts = sh.add_subparsers(dest="action", required=True)
    i = acts.add_parser("init", help="make the partition databases, migrate them, set the proxy up")
    i.add_argument(
        "--server",
        action="append",
        required=True,
        help="a server, as a libpq connection string without dbname or user "
        "(e.g. 'host=10.0.0.2 port=5432'); repeat for each",
    )
    i.add_argument(
        "--partitions",
        type=int,
        default=16,
        help="a power of two, at least the servers (default 16)",
    )
    i.add_argument("--prefix", default="poimen", help="partition databases are <prefix>_p<N>")
    i.add_argument("--no-plpython", action="store_true", help="as `migrate --no-plpython`")
    m = acts.add_parser("migrate", help="migrate every partition, then the proxy's SQL")
    m.add_argument("--check", action="store_true", help="`migrate --check` on each partition")
    m.add_argument("--no-plpython", action="store_true", help="as `migrate --no-plpython`")
    acts.add_parser("status", help="each partition: where, reachable, nodes and projects")
    mv = acts.add_parser("move", help="move a partition to another server (writes wait)")
    mv.add_argument("partition", type=int)
    mv.add_argument("--to", required=True, help="the new server (libpq, no dbname or user)")
    mv.add_argument("--no-plpython", action="store_true", help="as `migrate --no-plpython`")
    sh.set_defaults(func=cmd_shard)
