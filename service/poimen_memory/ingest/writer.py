"""Idempotent ingestion of memory nodes: validate, embed new nodes in batches, write nodes,
edges and OpenSearch outbox rows in transactions.

Policy (docs/ingest.md): the whole input is validated before anything is written. Any
invalid line aborts the run with every error listed, unless ``skip_invalid`` is set, in
which case those lines are skipped and reported. Writes are committed per batch; because
keys are content hashes, re-running after a crash finishes the job without duplicates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pgvector.psycopg import register_vector
from psycopg.types.json import Jsonb

from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder
from poimen_memory.errors import IngestError
from poimen_memory.ingest.nodes import LineError, NodeRecord
from poimen_memory.progress import Progress

VACUUM_AFTER = 1000  # inserted nodes that make a bulk load worth a VACUUM ANALYZE


@dataclass
class IngestReport:
    inserted: int = 0
    duplicates: int = 0
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
            f"inserted {self.inserted}, duplicates skipped {self.duplicates}, edges {self.edges}, "
            f"invalid lines {len(self.invalid)}, unresolved parents {len(self.unresolved)}, "
            f"{self.seconds:.1f}s ({self.rate:.1f} nodes/s; embedding {self.embed_seconds:.1f}s)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "inserted": self.inserted,
            "duplicates": self.duplicates,
            "edges": self.edges,
            "invalid": [str(e) for e in self.invalid],
            "unresolved": [f"line {ln}: parent {p!r} not found" for ln, p in self.unresolved],
            "seconds": round(self.seconds, 3),
        }


def ensure_embedding_model(conn: psycopg.Connection[Any], embedder: Embedder) -> None:
    register_vector(conn)  # the connection may predate CREATE EXTENSION vector
    with conn.transaction():
        conn.execute(q("configure_embedding"), {"model": embedder.model_name, "dim": embedder.dim})


def ingest(
    conn: psycopg.Connection[Any],
    records: Sequence[NodeRecord],
    embedder: Embedder,
    *,
    invalid: Sequence[LineError] = (),
    skip_invalid: bool = False,
    batch_size: int = 64,
    outbox: bool = False,
    progress: bool = True,
) -> IngestReport:
    if invalid and not skip_invalid:
        shown = "\n".join(str(e) for e in invalid[:20])
        more = f"\n... and {len(invalid) - 20} more" if len(invalid) > 20 else ""
        raise IngestError(
            f"{len(invalid)} invalid line(s); nothing was written",
            detail=shown + more,
            hint="fix the lines, or pass --skip-invalid to load the valid ones",
        )
    started = time.monotonic()
    report = IngestReport(invalid=list(invalid))
    ensure_embedding_model(conn, embedder)
    with conn.transaction():
        conn.execute(q("ensure_projects"), {"names": sorted({r.project for r in records})})
    project_ids = dict(
        conn.execute(q("project_ids"), {"names": sorted({r.project for r in records})}).fetchall()
    )

    # Duplicates (already stored, or repeated within the input) are never re-embedded.
    shas = [r.sha256 for r in records]
    stored: dict[bytes, int] = {}
    for i in range(0, len(shas), 5000):
        stored.update(
            dict(conn.execute(q("existing_sha256"), {"shas": shas[i : i + 5000]}).fetchall())
        )
    todo: list[NodeRecord] = []
    seen: set[bytes] = set(stored)
    for r, sha in zip(records, shas, strict=True):
        if sha in seen:
            report.duplicates += 1
        else:
            seen.add(sha)
            todo.append(r)

    with Progress(len(todo), "ingest", "nodes", enabled=progress) as bar:
        for i in range(0, len(todo), batch_size):
            batch = todo[i : i + batch_size]
            t0 = time.monotonic()
            vectors = embedder.embed_documents([r.text for r in batch])
            report.embed_seconds += time.monotonic() - t0
            params = [
                {
                    "sha256": r.sha256,
                    "project_id": project_ids[r.project],
                    "level": r.level,
                    "external_id": r.external_id,
                    "title": r.title,
                    "breadcrumb": list(r.breadcrumb),
                    "text": r.text,
                    "source": r.source,
                    "ts": r.timestamp,
                    "metadata": Jsonb(r.metadata),
                    "embedding": vec,
                }
                for r, vec in zip(batch, vectors, strict=True)
            ]
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(q("insert_node"), params, returning=True)
                new_ids: list[int] = []
                while True:
                    row = cur.fetchone()
                    if row is not None:
                        stored[bytes(row[1])] = row[0]
                        new_ids.append(row[0])
                    if not cur.nextset():
                        break
                report.inserted += len(new_ids)
                # A concurrent ingest may have won the race for some keys.
                report.duplicates += len(batch) - len(new_ids)
                if outbox and new_ids:
                    cur.execute(q("enqueue_outbox"), {"ids": new_ids})
            bar.update(len(batch))

    report.edges, report.unresolved = _write_edges(conn, records, stored)
    if report.inserted >= VACUUM_AFTER and conn.autocommit:
        # Fresh statistics for the planner, and a visibility map so BM25 scoring can use
        # index-only scans of the postings (VACUUM cannot run inside a transaction).
        conn.execute(q("vacuum_postings"))
        conn.execute(q("analyze_nodes"))
    report.seconds = time.monotonic() - started
    return report


def _write_edges(
    conn: psycopg.Connection[Any], records: Sequence[NodeRecord], stored: dict[bytes, int]
) -> tuple[int, list[tuple[int, str]]]:
    """Resolve parents by external id: first within the input, then among stored nodes."""
    by_ext: dict[tuple[str, str], int] = {}
    for r in records:
        if r.external_id is not None and r.sha256 in stored:
            by_ext.setdefault((r.project, r.external_id), stored[r.sha256])
    wanted = sorted({(r.project, p) for r in records for p in r.parents} - set(by_ext))
    if wanted:
        rows = conn.execute(
            q("ids_by_external_id"),
            {"projects": [w[0] for w in wanted], "external_ids": [w[1] for w in wanted]},
        ).fetchall()
        by_ext.update({(proj, ext): nid for proj, ext, nid in rows})
    child: list[int] = []
    parent: list[int] = []
    precedence: list[int] = []
    unresolved: list[tuple[int, str]] = []
    for r in records:
        cid = stored.get(r.sha256)
        for pos, p in enumerate(r.parents):
            pid = by_ext.get((r.project, p))
            if pid is None or cid is None or pid == cid:
                unresolved.append((r.line_no, p))
                continue
            child.append(cid)
            parent.append(pid)
            precedence.append(pos)
    written = 0
    for i in range(0, len(child), 10_000):
        with conn.transaction():
            cur = conn.execute(
                q("insert_edges"),
                {
                    "child": child[i : i + 10_000],
                    "parent": parent[i : i + 10_000],
                    "precedence": precedence[i : i + 10_000],
                },
            )
            written += cur.rowcount
    return written, unresolved
