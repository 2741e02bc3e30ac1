"""Connection helpers: the database URL (explicit or the embedded cluster) and connections
with pgvector's types registered."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
from pgvector.psycopg import register_vector, register_vector_async

from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.errors import PoimenError, from_sqlstate
from poimen_memory.settings import Settings


def embedded_cluster(settings: Settings) -> Cluster:
    return Cluster(
        data_dir=settings.data_dir,
        socket_dir=settings.socket_dir,
        port=settings.pg_port,
        bin_dir=find_pg_bin(settings.pg_bin_dir),
    )


def database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    return embedded_cluster(settings).url()


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, **kwargs)
    # The vector extension does not exist until the first migrate.
    with contextlib.suppress(psycopg.ProgrammingError):
        register_vector(conn)
    return conn


async def configure_async(conn: psycopg.AsyncConnection[Any]) -> None:
    await register_vector_async(conn)


def translate(exc: psycopg.Error) -> PoimenError:
    diag = exc.diag
    return from_sqlstate(
        exc.sqlstate, diag.message_primary or str(exc), diag.message_detail, diag.message_hint
    )
