"""A project whose nodes have known timestamps, for the time-filter tests (SQL and HTTP).

January's notes match the query best, February's weakly, and a few strong matches carry no
timestamp: an unfiltered top 10 holds no February node, so a February filter that still
returns 10 rows must have been applied inside the legs, before their top k."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from poimen_memory.embedders.base import Embedder

PROJECT = "timeline"
QUERY = "kong gateway body buffer for large uploads"
FEB = ("2023-02-01", "2023-02-28")
FEB_START = datetime(2023, 2, 1, tzinfo=UTC)
MAR_START = datetime(2023, 3, 1, tzinfo=UTC)


def notes() -> list[tuple[str, datetime | None]]:
    jan = [
        (
            f"Kong gateway body buffer raised for large uploads, change {i}",
            datetime(2023, 1, 1, 13, tzinfo=UTC) + timedelta(days=i),
        )
        for i in range(30)
    ]
    feb = [
        (
            f"Kong gateway invoice review {i}: billing totals checked",
            datetime(2023, 2, 1, 13, tzinfo=UTC) + timedelta(days=i),
        )
        for i in range(20)
    ]
    undated = [(f"Kong gateway body buffer for large uploads, draft {i}", None) for i in range(5)]
    return jan + feb + undated


def load(conn: psycopg.Connection[Any], embedder: Embedder) -> None:
    rows = notes()
    vectors = embedder.embed_documents([t for t, _ in rows])
    conn.execute("INSERT INTO memory.projects (name) VALUES (%s)", (PROJECT,))
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO memory.nodes (sha256, project_id, level, text, ts, embedding) "
            "SELECT pg_catalog.sha256(pg_catalog.convert_to(%(t)s, 'UTF8')), p.id, 'L0', "
            "%(t)s, %(ts)s, %(e)s FROM memory.projects p WHERE p.name = %(p)s",
            [
                {"t": t, "ts": ts, "e": v, "p": PROJECT}
                for (t, ts), v in zip(rows, vectors, strict=True)
            ],
        )


def in_february(ts: datetime | None) -> bool:
    return ts is not None and FEB_START <= ts < MAR_START
