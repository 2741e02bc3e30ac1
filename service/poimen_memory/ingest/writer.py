"""Idempotent ingestion of memory nodes: validate everything, embed new nodes, then hand
them in batches to the one writer, memory._write_nodes (sql/068_write.sql), which writes
nodes and their provenance edges (triggers queue the OpenSearch outbox). The steps and their
order are the write sequence memory.add_nodes runs too (poimen_core.writes), here over
psycopg; this module is the service's side of it: embedding, batches and transactions.

Policy (docs/ingest.md): the whole input is validated before anything is written, against
itself and against what the database already holds; any invalid line aborts the run with
every error listed, unless ``skip_invalid`` is set. Two write modes:

- ``atomic=True`` (one HTTP request): one transaction for everything, projects included,
  so a failure leaves nothing behind.
- bulk (the CLI): embedding pipelined with writing, batch by batch, all in one transaction
  (the projects excepted: they are made first, in a short transaction of their own). With
  ``commit_every_batch`` each batch is its own transaction, with its nodes' edges. Records
  go in level order (L0, L1, L2) and an edge always points one level down, so every parent
  is committed in an earlier batch or the same one; a failure then says exactly how many
  nodes were committed.

Every record reaches the writer, the stored ones without a vector (they cost no embedding):
the writer decides whether each is unchanged or a new version (a change of metadata or
timestamp alone), and answers per node with its id, revision and status.

Keys are content hashes, so re-running after a crash finishes the job without duplicates.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector
from psycopg.rows import dict_row

from poimen_core.writes import Checked, StoredNode, Writer, write_nodes
from poimen_memory.db.queries import q
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.embedders.base import Embedder
from poimen_memory.errors import IngestError, PoimenError, StaleRevision
from poimen_memory.ingest.nodes import Key, LineError, NodeRecord, stale_revisions
from poimen_memory.progress import Progress

VACUUM_AFTER = 1000  # inserted nodes that make a bulk load worth a VACUUM ANALYZE
LINK_CHUNK = 5000  # stored records in one call of the writer


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
    # One entry per written record, in input order (invalid lines skipped): project, id,
    # node_id, revision, status. Kept only when asked for (a bulk load does not hold them).
    nodes: list[dict[str, Any]] | None = None
    committed: int = 0  # nodes written in transactions that committed (commit_every_batch)

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
            **({} if self.nodes is None else {"nodes": self.nodes}),
            "inserted": self.inserted,
            "duplicates": self.duplicates,
            "updated": self.updated,
            "edges": self.edges,
            "invalid": [str(e) for e in self.invalid],
            "unresolved": [f"line {ln}: parent {p!r} not found" for ln, p in self.unresolved],
            "seconds": round(self.seconds, 3),
        }


def ensure_embedding_model(conn: psycopg.Connection[Any], embedder: Embedder) -> None:
    register_vector(conn)  # the connection may predate CREATE EXTENSION vector
    conn.execute(q("configure_embedding"), {"model": embedder.model_name, "dim": embedder.dim})


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
    commit_every_batch: bool = False,
    report_nodes: bool = False,
) -> IngestReport:
    """Validate, then write. ``conn`` must be in autocommit mode (transactions are ours).
    Nodes are written ``batch_size`` to a statement and embedded ``embed_group`` at a time
    (rounded to whole batches), after a first group of one batch so that writing starts
    early. The local embedder sorts what it is given by length, so a larger group wastes
    less of its work on padding. The bulk mode writes in one transaction unless
    ``commit_every_batch``. ``report_nodes``: keep the per-node answer (report.nodes)."""
    started = time.monotonic()
    report = IngestReport()
    side: _Atomic | _Bulk
    if atomic:
        side = _Atomic(conn, embedder, report, invalid, skip_invalid, report_nodes)
    else:
        side = _Bulk(conn, embedder, report, invalid, skip_invalid, report_nodes,
                     batch_size, embed_group, progress, commit_every_batch)  # fmt: skip
    with wrap_exceptions("ingest"):
        writer = write_nodes(_Psycopg(conn), records, side)
        report.inserted, report.updated = writer.inserted, writer.updated
        report.duplicates, report.edges = writer.duplicates, writer.edges
        report.unresolved = sorted(writer.unresolved)
        if report_nodes:
            report.nodes = writer.answers()
        # A bulk load only: an HTTP request must not wait for VACUUM (autovacuum follows).
        if report.inserted >= VACUUM_AFTER and conn.autocommit and not atomic:
            # Fresh statistics for the planner, and a visibility map so BM25 scoring can use
            # index-only scans of the postings (VACUUM cannot run inside a transaction).
            conn.execute(q("vacuum_postings"))
            conn.execute(q("analyze_nodes"))
    report.seconds = time.monotonic() - started
    return report


def _bulk(
    conn: psycopg.Connection[Any],
    writer: Writer,
    records: Sequence[NodeRecord],
    todo: list[NodeRecord],
    embedder: Embedder,
    report: IngestReport,
    batch_size: int,
    embed_group: int,
    progress: bool,
    commit_every_batch: bool,
) -> None:
    """The bulk write: each group embedded in a second thread while the previous one is
    written, batch by batch; each batch its own transaction with ``commit_every_batch``
    (else the caller's one transaction holds them all)."""
    group = max(1, embed_group // batch_size) * batch_size
    groups = [todo[:batch_size]] + [
        todo[i : i + group] for i in range(batch_size, len(todo), group)
    ]
    each = conn.transaction if commit_every_batch else contextlib.nullcontext
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
                    with each():
                        inserted = _write(writer, batch, vectors[at : at + batch_size])
                    if commit_every_batch:
                        report.committed += inserted
                    bar.update(len(batch))
        except BaseException:
            # Do not wait for the group being embedded (a remote embedder may take
            # minutes over a whole group): the error surfaces now, the thread
            # finishes on its own and its vectors are dropped.
            ahead.shutdown(wait=False, cancel_futures=True)
            raise
        ahead.shutdown()
    # The records stored before this run: their edges (of an earlier, interrupted run),
    # and the writer's decision on each (unchanged, or a new version when its metadata or
    # timestamp changed: it reuses the stored vector).
    with each():
        inserted = _link(writer, records, todo)
    if commit_every_batch:
        report.committed += inserted


def _refuse_stale(records: Sequence[NodeRecord], stored: Mapping[Key, StoredNode]) -> None:
    stale = stale_revisions(records, stored)
    if not stale:
        return
    lines = [
        f"line {r.line_no}: node {r.external_id} of project {r.project} is at revision "
        f"{current or 'none (no current version)'}, not {r.revision}"
        for r, current in stale
    ]
    more = f"\n... and {len(lines) - 20} more" if len(lines) > 20 else ""
    raise StaleRevision(
        f"{len(stale)} node(s) name a stale revision; nothing was written",
        detail="\n".join(lines[:20]) + more,
        hint="Read the nodes again (memory.history, GET /memory/nodes/{id}/history), merge, "
        "and write naming their current revisions; or name none to write on top of them.",
    )


def _what_was_written(
    err: PoimenError, report: IngestReport, per_batch: bool, made: list[str]
) -> None:
    """Completes the error of a bulk load with what it left written: with
    commit_every_batch the nodes of the batches that committed; otherwise nothing (one
    transaction), but for what was made up front (projects, the first model record)."""
    detail = err.detail or ""
    if per_batch:
        # The writer's "Nothing was written." speaks of its batch, not of the load.
        detail = detail.replace("Nothing was written.", "Nothing of the failing batch was written.")
        note = (
            f"{report.committed} node(s) were written and committed before the failure "
            "(--commit-every-batch), the rest were not; running the same file again writes "
            "the rest (the committed ones are unchanged)."
        )
    else:
        note = "Nothing was written: the load is one transaction, rolled back."
        if made:
            note += f" Made before it, and kept: {', '.join(made)}."
    err.detail = f"{detail}\n{note}" if detail else note


def _embed(embedder: Embedder, batch: Sequence[NodeRecord], report: IngestReport) -> Any:
    t0 = time.monotonic()
    try:
        return embedder.embed_documents([r.text for r in batch]) if batch else []
    finally:
        report.embed_seconds += time.monotonic() - t0


class _Psycopg:
    """The write sequence's Executor over a psycopg connection: the statements of
    queries.sql by the sequence's names."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, statement: str, params: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(q(statement), params)
            return cur.fetchall() if cur.description else []


@dataclass
class _Service:
    """The service's side of the write sequence, both modes: the reads run in autocommit,
    each its own transaction, so nothing is locked before the writes (the writer makes a
    request's projects in its transaction; a bulk load, in a short one of its own)."""

    conn: psycopg.Connection[Any]
    embedder: Embedder
    report: IngestReport
    invalid: Sequence[LineError]
    skip_invalid: bool
    keep_answers: bool

    def before_reading(self, records: Sequence[NodeRecord]) -> None:
        pass

    def screen(self, checked: Checked) -> list[NodeRecord]:
        problems = [*self.invalid, *checked.problems]
        if problems and not self.skip_invalid:
            shown = "\n".join(str(e) for e in problems[:20])
            more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise IngestError(
                f"{len(problems)} invalid line(s); nothing was written",
                detail=shown + more,
                hint="fix the lines, or skip them (--skip-invalid, ?skip_invalid=true)",
                front_hint="fix the lines, or skip them ({skip_invalid=true})",
            )
        self.report.invalid = sorted(problems, key=lambda e: e.line_no)
        bad_lines = {e.line_no for e in problems}
        return [r for r in checked.records if r.line_no not in bad_lines]


class _Atomic(_Service):
    """One HTTP request: one transaction for everything, projects included, so a failure
    leaves nothing behind; the new records are embedded before it begins."""

    vectors: Any = None

    def writing(self, todo: Sequence[NodeRecord]) -> contextlib.AbstractContextManager[Any]:
        self.vectors = _embed(self.embedder, todo, self.report)
        return self.conn.transaction()

    def ensure_model(self, todo: Sequence[NodeRecord]) -> None:
        ensure_embedding_model(self.conn, self.embedder)

    def write(self, writer: Writer, records: Sequence[NodeRecord], todo: list[NodeRecord]) -> None:
        _write(writer, todo, self.vectors)
        _link(writer, records, todo)


@dataclass
class _Bulk(_Service):
    """The CLI's load: embedding pipelined with writing, batch by batch (see ingest)."""

    batch_size: int = 64
    embed_group: int = 256
    progress: bool = True
    commit_every_batch: bool = False
    made: list[str] = field(default_factory=list)  # what it made up front, and kept

    def screen(self, checked: Checked) -> list[NodeRecord]:
        kept = super().screen(checked)
        # A bulk load finds a stale revision before it writes anything (a request is one
        # transaction: there the writer's own refusal, PM419, comes first).
        _refuse_stale(kept, checked.stored)
        return kept

    def writing(self, todo: Sequence[NodeRecord]) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # each step takes the transactions it needs

    def ensure_model(self, todo: Sequence[NodeRecord]) -> None:
        with self.conn.transaction():
            had_model = self.conn.execute(q("embedding_model")).fetchone() is not None
            ensure_embedding_model(self.conn, self.embedder)
            # In a short transaction of their own: on the partitioned layout a new
            # project's partitions lock the tables until the transaction that made
            # them ends, and queries of every project wait that long.
            self.made = [f"project {p}" for p in _ensure_projects(self.conn, todo)]
        if not had_model:
            self.made.append(f"the embedding model ({self.embedder.model_name})")

    def write(self, writer: Writer, records: Sequence[NodeRecord], todo: list[NodeRecord]) -> None:
        per_batch = self.commit_every_batch
        try:
            with (
                wrap_exceptions("ingest"),
                self.conn.transaction() if not per_batch else contextlib.nullcontext(),
            ):
                _bulk(self.conn, writer, records, todo, self.embedder, self.report,
                      self.batch_size, self.embed_group, self.progress, per_batch)  # fmt: skip
        except PoimenError as err:
            _what_was_written(err, self.report, per_batch, self.made)
            raise


def _ensure_projects(conn: psycopg.Connection[Any], records: Sequence[NodeRecord]) -> list[str]:
    """Makes the projects of these records; the names of those not there before."""
    names = sorted({r.project for r in records})
    if not names:
        return []
    rows = conn.execute(q("projects_existing"), {"names": names}).fetchall()
    before = {str(r[0]) for r in rows}
    conn.execute(q("ensure_projects"), {"names": names})
    return [n for n in names if n not in before]


def _write(writer: Writer, batch: Sequence[NodeRecord], vectors: Any) -> int:
    """New nodes with their vectors, and their edges (a parent is one level down, so it was
    written in an earlier batch or is in this one); how many it inserted."""
    if not batch:
        return 0
    embeddings = [np.asarray(v, dtype=np.float32) for v in vectors]
    if len(embeddings) != len(batch):
        raise ValueError(f"{len(batch)} nodes but {len(embeddings)} vectors")
    return writer.call("write_nodes", batch, embeddings)


def _link(writer: Writer, records: Sequence[NodeRecord], written: Sequence[NodeRecord]) -> int:
    """The records not written by this run (stored before it, or twice in the input): their
    edges (idempotent), and the writer's decision on each; how many it inserted (new
    versions: the same content with other metadata or timestamp)."""
    done = {id(r) for r in written}
    rest = [r for r in records if id(r) not in done]
    inserted = 0
    for i in range(0, len(rest), LINK_CHUNK):
        inserted += writer.call("link_nodes", rest[i : i + LINK_CHUNK])
    return inserted
