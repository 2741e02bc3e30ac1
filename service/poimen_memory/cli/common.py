"""What every command shares: the settings, parsed once, and the database to talk to."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace

from poimen_memory.db.connect import (
    connect,
    database_url,
    ensure_service_login,
    service_database_url,
)
from poimen_memory.settings import Settings


def seconds(raw: str) -> float:
    """An argparse type: a finite, positive number of seconds (a bad one exits 2, named)."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a positive number of seconds")
    return value


def notice(line: str) -> None:
    """Progress of long work (a project graph's build: minutes on a large store), on
    stderr as it happens."""
    print(f"notice: {line}", file=sys.stderr, flush=True)


def load_settings() -> Settings:
    return Settings.from_env()


def started_url(s: Settings) -> str:
    """The database URL, starting the embedded cluster first when none is configured."""
    return database_url(s, start=True)


def service_settings(s: Settings) -> Settings:
    """What `serve` and `mcp` run with: the embedded cluster (when no URL is configured)
    started and migrated, and the service's own role, never the superuser."""
    from poimen_memory.db.migrate import migrate

    url = started_url(s)
    if not s.database_url:
        with connect(url, autocommit=True) as conn:
            # makes the service role
            migrate(conn, s.plpython_root_for_database, role_prefix=s.role_prefix)
            ensure_service_login(conn, s.service_role)
    return replace(s, database_url=service_database_url(s))
