"""`poimen-memory doctor`: which capabilities this database has, and what each missing one
costs (memory.capabilities(); docs/managed-postgres.md). Exit 0 when everything the product
needs is there (optional capabilities that are off are warnings), 1 when a required one is
missing."""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap

from poimen_memory.cli.common import load_settings, started_url
from poimen_memory.db.capabilities import Report, report
from poimen_memory.db.connect import connect


def render(rep: Report, width: int = 100) -> str:
    """The report as a table for a person: name, status, detail, and under each capability
    that is off what it costs."""
    name_w = max(len("capability"), *(len(c.name) for c in rep.capabilities)) + 2
    status_w = len("status") + 2
    indent = " " * (name_w + status_w)
    text_w = max(width - len(indent), 40)
    lines = [f"{rep.database} as {rep.role}", ""]
    lines.append(f"{'capability':<{name_w}}{'status':<{status_w}}detail")

    def wrap(text: str, w: int) -> list[str]:
        return textwrap.wrap(text, w, break_on_hyphens=False) or [""]

    for c in rep.capabilities:
        detail = wrap(c.detail, text_w)
        lines.append(f"{c.name:<{name_w}}{c.status:<{status_w}}{detail[0]}")
        lines += [indent + d for d in detail[1:]]
        # "needs plpython3u", "needs the schema": that one's cost is the one to read.
        if c.cost is not None and not c.detail.startswith("needs "):
            lines += [indent + d for d in wrap("without it: " + c.cost, text_w)]
    lines.append("")
    if rep.missing:
        lines += wrap(
            "missing (required): "
            + ", ".join(c.name for c in rep.missing)
            + ": poimen-memory cannot run on this database as it is",
            width,
        )
    else:
        lines.append("ok: everything poimen-memory needs is here")
    if rep.warnings:
        lines += wrap("warning: off (optional): " + ", ".join(c.name for c in rep.warnings), width)
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    s = load_settings()
    with connect(started_url(s), autocommit=True) as conn:
        rep = report(conn, s.role_prefix)
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
    else:
        print(render(rep, shutil.get_terminal_size((100, 24)).columns))
    return 0 if rep.ok else 1


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    dr = sub.add_parser(
        "doctor",
        help="report the capabilities this database has and what each missing one costs "
        "(exit 1 when a required one is missing)",
    )
    dr.add_argument("--json", action="store_true", help="the report as JSON")
    dr.set_defaults(func=cmd_doctor)
