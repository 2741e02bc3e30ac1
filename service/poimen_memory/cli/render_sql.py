"""`poimen-memory migrate --render-sql FILE`: the SQL migrate would run on the configured
database, as a psql script a DBA reads, keeps and applies (db/migrate/script.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from poimen_memory.cli.common import started_url
from poimen_memory.db.connect import connect
from poimen_memory.settings import Settings


def render_sql(args: argparse.Namespace, s: Settings) -> int:
    from poimen_memory.db.migrate.script import render_script, write_script

    with connect(started_url(s), autocommit=True) as conn:
        script = render_script(conn, role_prefix=s.role_prefix)
    out = None if args.render_sql == "-" else Path(args.render_sql)
    write_script(script, out)
    print(
        f"rendered {script.statements} statements"
        f" (migrations: {', '.join(script.migrations) or 'none'})"
        + ("" if out is None else f" into {out}")
        + "; apply with psql -1 -v ON_ERROR_STOP=1 -f, then check with migrate --check",
        file=sys.stderr,
    )
    return 0
