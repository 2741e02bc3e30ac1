"""The scratch databases the benches create next to a database of the cluster and drop
afterwards, and the arguments every bench run as a module takes
(`python -m poimen_lab.bench.<name> --url ...`)."""

from __future__ import annotations

import argparse
import uuid

import psycopg
from psycopg.conninfo import make_conninfo


def fresh_database(url: str, prefix: str = "poimen_bench") -> tuple[str, str]:
    """A new, empty database on url's cluster: its name and its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(make_conninfo(url, dbname="postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return name, make_conninfo(url, dbname=name)


def drop_database(url: str, name: str) -> None:
    """Drops a database fresh_database made (or a copy of one), whoever is still connected."""
    with psycopg.connect(make_conninfo(url, dbname="postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def module_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments of a bench module: the cluster (--url), the synthetic corpus (--nodes,
    --dim) and whether its scratch databases stay (--keep-db); the module adds its own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    ap.add_argument("--url", required=True, help="a database on the cluster to use")
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--keep-db", action="store_true")
    return ap
