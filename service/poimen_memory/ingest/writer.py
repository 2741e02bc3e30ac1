"""Idempotent ingestion of memory nodes: validate everything, embed new nodes, then hand
them in batches to the one writer, memory._write_nodes (sql/068_write.sql), which writes
nodes and their provenance edges (triggers queue the OpenSearch outbox).

Policy (docs/ingest.md): the whole input is validated before anything is written, against
itself and against what the database already holds; any invalid line aborts the run with
every error listed, unless ``skip_invalid`` is set. Two write modes:

- ``atomic=True`` (one HTTP request): one transaction for everything, projects included,
  so a failure leaves nothing behind.
- bulk (the CLI): one transaction per batch, each with its nodes' edges. Records go in level
  order (L0, L1, L2) and an edge always points one level down, so every parent is committed
  in an earlier batch or the same one; the report counts exactly what was committed.

Keys are content hashes, so re-running after a crash finishes the job without duplicates.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from poimen_memory.db.queries import q
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.embedders.base import Embedder
from poimen_memory.errors import IngestError
from poimen_memory.ingest.nodes import (
    Key,
    LineError,
    NodeRecord,
    new_records,
    reference_keys,
    validate,
    write_row,
)
from poimen_memory.progress import Progress

VACUUM_AFTER = 1000  # inserted nodes that make a bulk load worth a VACUUM ANALYZE


@dataclass
class IngestReport:
    inserted: int = 0
    duplicates: int = 0
    updated: int = 0  # of the inserted: new versions of stored ids (the old ones superseded)
    edges: int = 0
    invalid: list[LineError] = field(default_factory=list)
    unresolved: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0
    embed_seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.inserted / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (
            f"inserted {self.inserted} (new versions {self.updated}), "
            f"duplicates skipped {self.duplicates}, edges {self.edges}, "
            f"invalid lines {len(self.invalid)}, unresolved parents {len(self.unresolved)}, "
            f"{self.seconds:.1f}s ({self.rate:.1f} nodes/s; embedding {self.embed_seconds:.1f}s)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "inserted": self.inserted,
            "duplicates": self.duplicates,
            "updated": self.updated,
            "edges": self.edges,
            "invalid": [str(e) for e in self.invalid],
            "unresolved": [f"line {ln}: parent {p!r} not found" for ln, p in self.unresolved],
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class StoredNode:
    project: str
    external_id: str
    id: int
    level: str
    sha256: bytes
    revision: int


def ensure_embedding_model(conn: psycopg.Connection[Any], embedder: Embedder) -> None:
    register_vector(conn)  # the connection may predate CREATE EXTENSION vector
    conn.execute(q("configure_embedding"), {"model": embedder.model_name, "dim": embedder.dim})


def _stored_by_key(conn: psycopg.Connection[Any], keys: Sequence[Key]) -> dict[Key, StoredNode]:
    out: dict[Key, StoredNode] = {}
    with conn.cursor(row_factory=class_row(StoredNode)) as cur:
        for i in range(0, len(keys), 5000):
            chunk = keys[i : i + 5000]
            cur.execute(
                q("stored_nodes"),
                {"projects": [k[0] for k in chunk], "external_ids": [k[1] for k in chunk]},
            )
            out.update({(r.project, r.external_id): r for r in cur.fetchall()})
    return out


def ingest(
    conn: psycopg.Connection[Any],
    records: Sequence[NodeRecord],
    embedder: Embedder,
    *,
    invalid: Sequence[LineError] = (),
    skip_invalid: bool = False,
    batch_size: int = 64,
    embed_group: int = 256,
    progress: bool = True,
    atomic: bool = False,
) -> IngestReport:
    """Validate, then write. ``conn`` must be in autocommit mode (transactions are ours).
    Nodes are written ``batch_size`` to a transaction and embedded ``embed_group`` at a time
    (rounded to whole batches), after a first group of one batch so that writing starts
    early. The local embedder sorts what it is given by length, so a larger group wastes
    less of its work on padding."""
    started = time.monotonic()
    with wrap_exceptions("ingest"):
        stored = _stored_by_key(conn, reference_keys(records))
        problems = [*invalid, *validate(records, stored)]
        bad_lines = {e.line_no for e in problems}
        if problems and not skip_invalid:
            shown = "\n".join(str(e) for e in problems[:20])
            more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise IngestError(
                f"{len(problems)} invalid line(s); nothing was written",
                detail=shown + more,
                hint="fix the lines, or skip them (--skip-invalid, ?skip_invalid=true)",
                front_hint="fix the lines, or skip them ({skip_invalid=true})",
            )
        records = [r for r in records if r.line_no not in bad_lines]
        report = IngestReport(invalid=sorted(problems, key=lambda e: e.line_no))
        writer = _Writer(conn, records, stored, report)
        todo = writer.new_records()
        if atomic:
            vectors = _embed(embedder, todo, report)
            with conn.transaction():
                ensure_embedding_model(conn, embedder)
                writer.write(todo, vectors)
                writer.link(records, todo)
        else:
            with conn.transaction():
                ensure_embedding_model(conn, embedder)
                # In a short transaction of their own: on the partitioned layout a new
                # project's partitions lock the tables until the transaction that made
                # them ends, and queries of every project wait that long.
                writer.ensure_projects(todo)
            group = max(1, embed_group // batch_size) * batch_size
            groups = [todo[:batch_size]] + [
                todo[i : i + group] for i in range(batch_size, len(todo), group)
            ]
            # One thread embeds the next group while this one writes the current group, so
            # the embedder and the database work at the same time, not in turns.
            ahead = ThreadPoolExecutor(1, thread_name_prefix="ingest-embed")
            # The embedding thread runs in this thread's context (a write's deadline,
            # embedders/base.py WRITE_DEADLINE, is a context variable).
            ctx = contextvars.copy_context()
            with Progress(len(todo), "ingest", "nodes", enabled=progress) as bar:
                nxt = ahead.submit(ctx.run, _embed, embedder, groups[0], report) if todo else None
                try:
                    for i, nodes in enumerate(groups):
                        if nxt is None:
                            break
                        vectors = nxt.result()
                        nxt = None
                        if i + 1 < len(groups):
                            run = ctx.copy().run
                            nxt = ahead.submit(run, _embed, embedder, groups[i + 1], report)
                        for at in range(0, len(nodes), batch_size):
                            batch = nodes[at : at + batch_size]
                            with conn.transaction():
                                writer.write(batch, vectors[at : at + batch_size])
                            bar.update(len(batch))
                except BaseException:
                    # Do not wait for the group being embedded (a remote embedder may take
                    # minutes over a whole group): the error surfaces now, the thread
                    # finishes on its own and its vectors are dropped.
                    ahead.shutdown(wait=False, cancel_futures=True)
                    raise
                ahead.shutdown()
            # Edges of the nodes stored before this run (by an earlier, interrupted one).
            with conn.transaction():
                writer.link(records, todo)
        report.unresolved.sort()
        # A bulk load only: an HTTP request must not wait for VACUUM (autovacuum follows).
        if report.inserted >= VACUUM_AFTER and conn.autocommit and not atomic:
            # Fresh statistics for the planner, and a visibility map so BM25 scoring can use
            # index-only scans of the postings (VACUUM cannot run inside a transaction).
            conn.execute(q("vacuum_postings"))
            conn.execute(q("analyze_nodes"))
    report.seconds = time.monotonic() - started
    return report


def _embed(embedder: Embedder, batch: Sequence[NodeRecord], report: IngestReport) -> Any:
    t0 = time.monotonic()
    try:
        return embedder.embed_documents([r.text for r in batch]) if batch else []
    finally:
        report.embed_seconds += time.monotonic() - t0


class _Writer:
    """One ingest run's calls into memory._write_nodes, and what they report."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        records: Sequence[NodeRecord],
        stored: dict[Key, StoredNode],
        report: IngestReport,
    ) -> None:
        self.conn, self.report = conn, report
        self.records = records
        self.stored_shas: set[bytes] = {s.sha256 for s in stored.values()}
        shas = [r.sha256 for r in records]
        for i in range(0, len(shas), 5000):
            rows = conn.execute(q("stored_hashes"), {"shas": shas[i : i + 5000]}).fetchall()
            self.stored_shas.update(bytes(sha) for sha, _ in rows)

    def new_records(self) -> list[NodeRecord]:
        """Records not stored yet, once each, in level order (a parent before its child)."""
        todo, duplicates = new_records(self.records, self.stored_shas)
        self.report.duplicates += duplicates
        return todo

    def ensure_projects(self, records: Sequence[NodeRecord]) -> None:
        self.conn.execute(q("ensure_projects"), {"names": sorted({r.project for r in records})})

    def write(self, batch: Sequence[NodeRecord], vectors: Any) -> None:
        """New nodes with their vectors, and their edges (a parent is one level down, so it
        was written in an earlier batch or is in this one)."""
        if not batch:
            return
        embeddings = [np.asarray(v, dtype=np.float32) for v in vectors]
        if len(embeddings) != len(batch):
            raise ValueError(f"{len(batch)} nodes but {len(embeddings)} vectors")
        out = self._call(q("write_nodes"), batch, embeddings)
        self.report.inserted += out["inserted"]
        self.report.updated += out["updated"]
        # A concurrent ingest may have stored some first (ON CONFLICT waited for it).
        self.report.duplicates += out["duplicates"]

    def link(self, records: Sequence[NodeRecord], written: Sequence[NodeRecord]) -> None:
        """The edges of the records not written by this run (stored before it), idempotent."""
        done = {id(r) for r in written}
        rest = [r for r in records if id(r) not in done]
        for i in range(0, len(rest), 5000):
            self._call(q("link_nodes"), rest[i : i + 5000], None)

    def _call(
        self, query: Any, batch: Sequence[NodeRecord], embeddings: list[Any] | None
    ) -> dict[str, Any]:
        params = {"nodes": Jsonb([write_row(r) for r in batch]), "embeddings": embeddings}
        row = self.conn.execute(query, params).fetchone()
        assert row is not None
        out: dict[str, Any] = row[0]
        self.report.edges += out["edges"]
        self.report.unresolved += [(batch[n - 1].line_no, p) for n, p in out["unresolved"]]
        return out
