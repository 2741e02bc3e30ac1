"""`poimen-memory keys`: API keys of the HTTP service."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import psycopg

from poimen_core import vocabulary
from poimen_memory.cli.common import load_settings, started_url
from poimen_memory.db.connect import (
    connect,
)


def cmd_keys(args: argparse.Namespace) -> int:
    from poimen_memory.api.auth import key_hash, new_key
    from poimen_memory.db.migrate import migrate
    from poimen_memory.db.queries import q

    s = load_settings()
    with connect(started_url(s), autocommit=True) as conn:
        if args.action == "create":
            if not args.project:
                print("error: keys create needs at least one --project", file=sys.stderr)
                return 2
            # The same rule as memory.projects: a key for '*' or 'a,b' would otherwise assert
            # every project (or two) to row-level security (db/tenant.py joins them with ',').
            bad = [p for p in args.project if not vocabulary.PROJECT_NAME_RE.fullmatch(p)]
            if bad:
                print(f"error: invalid project name {bad[0]!r}", file=sys.stderr)
                print(
                    f"hint: a project name matches {vocabulary.PROJECT_NAME} "
                    "(no '*', no ',': a key lists each of its projects with its own --project)",
                    file=sys.stderr,
                )
                return 2
            migrate(conn, s.plpython_root_for_database, role_prefix=s.role_prefix)
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
            for kid, prefix, projects, write, note, _created, revoked, aside in conn.execute(
                q("keys_list")
            ).fetchall():
                state = f"revoked {revoked:%Y-%m-%d}" if revoked else "active"
                state += " (set aside)" if aside else ""
                mode = "read-write" if write else "read-only"
                print(f"{kid}\t{prefix}…\t{mode}\t{','.join(projects)}\t{state}\t{note or ''}")
        elif args.action == "anonymous":
            return _anonymous(conn, yes=args.yes)
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


def _anonymous(conn: psycopg.Connection[Any], *, yes: bool) -> int:
    """The way back to anonymous mode: revoking the last key locks the service (a revoke
    never widens access); this, with no key active, sets the revoked keys aside, and the
    service answers without a key again (within POIMEN_AUTH_CACHE_S)."""
    from poimen_memory.db.queries import q

    active = [r for r in conn.execute(q("keys_list")).fetchall() if r[6] is None]
    if active:
        shown = ", ".join(f"{r[0]} ({r[1]}…)" for r in active)
        print(f"error: {len(active)} key(s) active: {shown}", file=sys.stderr)
        print("hint: revoke them first (poimen-memory keys revoke <id>)", file=sys.stderr)
        return 3
    if not yes:
        print(
            "error: anonymous mode lets anyone who reaches the service read and write every "
            "project; pass --yes to open it",
            file=sys.stderr,
        )
        return 2
    rows = conn.execute(q("keys_set_aside")).fetchall()
    print(
        f"anonymous mode: {len(rows)} revoked key(s) set aside; the service answers without "
        "a key (within POIMEN_AUTH_CACHE_S) until the next `keys create`"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ky = sub.add_parser("keys", help="API keys for the HTTP service")
    ky.add_argument(
        "action",
        choices=["create", "list", "revoke", "anonymous"],
        help="anonymous: with every key revoked, let requests without a key in again",
    )
    ky.add_argument("key", nargs="?", help="revoke: the key's id or prefix")
    ky.add_argument("--project", action="append", help="a project the key covers (repeat)")
    ky.add_argument("--write", action="store_true", help="also allow POST /memory/nodes")
    ky.add_argument("--note", help="who or what the key is for")
    ky.add_argument("--yes", action="store_true", help="anonymous: yes, open the service")
    ky.set_defaults(func=cmd_keys)
