"""`poimen-memory expire`: end the nodes whose expiry has passed (docs/lifecycle.md,
expiry and retention). Answers already leave them out (the expiry is tested with valid
time); this retires them, or erases them where their level's retention says so, through
memory.forget's implementation (memory.expire), so history, the BM25 statistics,
OpenSearch and derived nodes follow as for any forget. One transaction per batch: a stop
midway keeps what was done, and the next run goes on."""

from __future__ import annotations

import argparse

from poimen_memory.cli.common import load_settings, notice, started_url
from poimen_memory.db.connect import connect


def cmd_expire(args: argparse.Namespace) -> int:
    s = load_settings()
    with connect(started_url(s), autocommit=True) as conn:
        projects = args.project or [
            str(r[0]) for r in conn.execute("SELECT name FROM memory.projects ORDER BY name")
        ]
        totals = {"retired": 0, "erased": 0, "derived_ended": 0}
        for project in projects:
            while True:
                row = conn.execute("SELECT memory.expire(%s, %s)", (project, args.batch)).fetchone()
                assert row is not None
                done = row[0]
                ended = done["retired"] + done["erased"]
                for k in totals:
                    totals[k] += done[k]
                if ended:
                    notice(
                        f"expire: {project}: retired {done['retired']}, erased "
                        f"{done['erased']}, derived ended {done['derived_ended']}; "
                        f"{done['remaining']} expired node(s) left"
                    )
                # A batch that ended nothing while some remain would loop forever (rows
                # another session holds, or hidden by row-level security): stop.
                if not done["remaining"] or not ended:
                    break
        print(
            f"expired: {totals['retired']} retired, {totals['erased']} erased, "
            f"{totals['derived_ended']} derived ended, in {len(projects)} project(s)"
        )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ex = sub.add_parser(
        "expire",
        help="retire (or erase, per the project's retention) the nodes whose expiry passed",
    )
    ex.add_argument("--project", action="append", help="only this project (repeat); default all")
    ex.add_argument(
        "--batch", type=int, default=1000, help="nodes ended per transaction (default 1000)"
    )
    ex.set_defaults(func=cmd_expire)
