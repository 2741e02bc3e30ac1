"""`poimen-memory`: the embedded cluster, migrations, ingest, queries and the server.

One module per command (its parser and what it runs) over the domain modules; this one
only assembles them, with the commands other installed packages register."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

import psycopg

from poimen_memory.cli import (
    db,
    doctor,
    expire,
    ingest,
    keys,
    mcp,
    migrate,
    opensearch,
    query,
    serve,
    shard,
)
from poimen_memory.db.wrap import translate
from poimen_memory.errors import PoimenError

COMMANDS = (db, migrate, doctor, ingest, query, serve, keys, mcp, opensearch, expire, shard)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The product's commands, and those other installed packages register.

    Given the command line, the other packages' commands are left out when it names one of
    the product's: loading them imports their modules (the lab's pull in numpy, httpx and
    the retrieval stack), which took a `poimen-memory keys list` from 0.4 to 1.3 s of CPU."""
    p = argparse.ArgumentParser(prog="poimen-memory", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    if argv and argv[0] in sub.choices:
        return p
    # Commands from other installed packages (the lab's eval and bench), by entry point;
    # each target once: metadata from before the lab was a distribution of its own (the
    # product's, naming the same target) may still be installed beside the lab's.
    targets = {ep.value: ep for ep in entry_points(group="poimen_memory.commands")}
    for ep in targets.values():
        ep.load()(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    line = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(line).parse_args(line)
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
