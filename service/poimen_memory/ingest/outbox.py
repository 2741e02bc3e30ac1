"""Draining the OpenSearch outbox, and rebuilding the index from Postgres.

Delivery is at least once: a batch's rows are locked (FOR UPDATE SKIP LOCKED, so drainers
can run side by side), pushed, and deleted in the same transaction only when OpenSearch
acknowledged them. A crash between the push and the commit replays the rows, which is
harmless because documents are keyed by content hash.

Over a PL/Proxy proxy (docs/opensearch.md#over-a-pl-proxy-proxy) the same code drains every
partition's outbox into the one index: the *_proxy statements read and acknowledge rows on
their partitions, by global row ids, without holding row locks across the push.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from poimen_memory.db import tenant
from poimen_memory.db.queries import q
from poimen_memory.errors import DatabaseUnavailable, Forbidden, OpenSearchUnavailable
from poimen_memory.progress import Progress
from poimen_memory.upstreams.opensearch import BulkOp, Doc, OpenSearchEngine

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
MAX_ERROR_CHARS = 1000


@dataclass
class SyncReport:
    indexed: int = 0
    deleted: int = 0
    failed: int = 0
    remaining: int = 0
    seconds: float = 0.0
    skipped: int = 0
    """Rows whose node no longer exists: nothing left to index, and no _id to delete by."""
    stopped: str | None = None
    """Why the run gave up early (OpenSearch stayed unavailable); None when it finished."""
    unreached: tuple[int, ...] = ()
    """Over a proxy: the partitions out of reach, whose queued rows were neither drained
    nor counted in ``remaining``."""

    @property
    def complete(self) -> bool:
        """Nothing left queued anywhere this run could see, and nothing it could not."""
        return self.remaining == 0 and not self.unreached

    def summary(self) -> str:
        text = (
            f"indexed {self.indexed}, deleted {self.deleted}, failed {self.failed}, "
            f"skipped {self.skipped}, remaining {self.remaining}, {self.seconds:.1f}s"
        )
        if self.unreached:
            text += f"; partitions out of reach, not drained: {list(self.unreached)}"
        return text + (f"; stopped: {self.stopped}" if self.stopped else "")


def _doc(
    sha: str,
    text: str,
    title: str | None,
    breadcrumb: Sequence[str] | None,
    source: str | None,
    level: str,
    project: str,
) -> Doc:
    return Doc(
        sha256=sha,
        content=text,
        section_title=title,
        breadcrumb=" > ".join(breadcrumb or ()),
        source=source,
        project_id=project,
        level=level,
    )


def _op(row: tuple[Any, ...]) -> BulkOp | None:
    _id, _node, op, sha, text, title, breadcrumb, source, level, project = row
    if sha is None:
        return None
    if op == "delete":
        return BulkOp("delete", sha)
    if text is None:  # the node is gone; its delete row follows in the queue
        return None
    return BulkOp("index", sha, _doc(sha, text, title, breadcrumb, source, level, project))


def _proxied(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn`` is a PL/Proxy proxy in front of partition databases. If so, the
    session asserts every project (the drain and the reindex serve them all): a partition
    shows a proxy's call only the projects it asserts."""
    row = conn.execute(q("is_proxy")).fetchone()
    if not (row and row[0]):
        return False
    # Only a member of the proxy's service role has its projects forwarded: anyone else
    # would see no partition's nodes, and a reindex would drop the index and write none.
    try:
        trusted = conn.execute(q("proxy_trusted")).fetchone()
    except psycopg.errors.InsufficientPrivilege:
        trusted = None
    if not (trusted and trusted[0]):
        raise Forbidden(
            "this role cannot drain or reindex through the proxy: the partitions show it no nodes",
            hint="connect as the proxy's service role (the one `shard init` makes LOGIN), "
            "as the service does (docs/opensearch.md)",
        )
    tenant.assert_for_session(conn, tenant.ALL_PROJECTS)
    return True


def _query(name: str, proxy: bool) -> str:
    """The statement ``name``, or its variant over a proxy's partitions."""
    return f"{name}_proxy" if proxy else name


def _count(conn: psycopg.Connection[Any], query: str, proxy: bool = False) -> int:
    row = conn.execute(q(_query(query, proxy))).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _failed(conn: psycopg.Connection[Any], ids: list[int], error: str, proxy: bool) -> None:
    conn.execute(q(_query("outbox_failed", proxy)), {"ids": ids, "error": error[:MAX_ERROR_CHARS]})


def _push(
    conn: psycopg.Connection[Any],
    engine: OpenSearchEngine,
    pending: dict[int, BulkOp],
    proxy: bool = False,
) -> tuple[dict[int, BulkOp], dict[int, BulkOp], str | None]:
    """One try at ``pending``: the rows that succeeded, those worth another try, and the
    reason when the whole request failed. Failed rows get attempts+1 and last_error."""
    try:
        engine.ensure_index()
        results = engine.bulk(list(pending.values()))
    except OpenSearchUnavailable as exc:
        _failed(conn, list(pending), str(exc), proxy)
        return {}, pending, str(exc)
    done: dict[int, BulkOp] = {}
    retry: dict[int, BulkOp] = {}
    errors: dict[str, list[int]] = {}
    for (row_id, op), res in zip(pending.items(), results, strict=True):
        if res.ok:
            done[row_id] = op
            continue
        errors.setdefault(f"HTTP {res.status} {res.error}", []).append(row_id)
        if res.retriable:
            retry[row_id] = op
    for error, ids in errors.items():
        _failed(conn, ids, error, proxy)
    return done, retry, None


def sync_outbox(
    conn: psycopg.Connection[Any],
    engine: OpenSearchEngine,
    *,
    batch_size: int = 500,
    max_attempts: int = 5,
    backoff_base_s: float = 0.5,
    max_batches: int | None = None,
    progress: bool = True,
) -> SyncReport:
    """Drain memory.opensearch_outbox once, oldest first.

    Each batch gets up to ``max_attempts`` tries with exponential backoff for transient
    trouble (the request failed, or items answered 429/5xx). When OpenSearch stays
    unavailable the run stops with ``report.stopped`` set and the rows still queued.
    Rows failing for good (e.g. a mapping error) keep their last_error and are retried
    by the next run, not this one. Pass an autocommit connection: each batch then
    commits on its own instead of inside the caller's transaction.
    """
    started = time.monotonic()
    report = SyncReport()
    after, batches = 0, 0
    # Over a proxy: every partition's outbox, by global row ids (none locked meanwhile).
    proxy = _proxied(conn)
    total = _count(conn, "outbox_depth", proxy)
    with Progress(total, "opensearch sync", "rows", enabled=progress) as bar:
        while report.stopped is None and (max_batches is None or batches < max_batches):
            with conn.transaction():
                rows = conn.execute(
                    q(_query("outbox_batch_after", proxy)), {"after": after, "limit": batch_size}
                ).fetchall()
                if not rows:
                    break
                batches += 1
                after = rows[-1][0]
                ops = [(r[0], _op(r)) for r in rows]
                orphans = [row_id for row_id, op in ops if op is None]
                pending = {row_id: op for row_id, op in ops if op is not None}
                done = _drain_batch(
                    conn, engine, pending, max_attempts, backoff_base_s, report, proxy
                )
                conn.execute(q(_query("outbox_done", proxy)), {"ids": list(done) + orphans})
            report.skipped += len(orphans)
            report.indexed += sum(1 for op in done.values() if op.op == "index")
            report.deleted += sum(1 for op in done.values() if op.op == "delete")
            report.failed += len(pending) - len(done)
            bar.update(len(rows))
    if report.skipped:
        log.warning(
            "%d outbox rows referred to deleted nodes; run reindex to drop any "
            "documents they leave behind",
            report.skipped,
        )
    if proxy:
        # One call over the partitions for both: what remains, and where it could not look.
        row = conn.execute(q("outbox_depth_proxy")).fetchone()
        report.remaining = int(row[0] or 0) if row else 0
        report.unreached = tuple(row[1] or ()) if row else ()
    else:
        report.remaining = _count(conn, "outbox_depth")
    report.seconds = time.monotonic() - started
    return report


def _drain_batch(
    conn: psycopg.Connection[Any],
    engine: OpenSearchEngine,
    pending: dict[int, BulkOp],
    max_attempts: int,
    backoff_base_s: float,
    report: SyncReport,
    proxy: bool = False,
) -> dict[int, BulkOp]:
    done: dict[int, BulkOp] = {}
    if not pending:
        return done
    for attempt in range(max(1, max_attempts)):
        if attempt:
            # The rows stay locked while we wait, so a parallel drainer skips them.
            time.sleep(min(backoff_base_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        ok, pending, report.stopped = _push(conn, engine, pending, proxy)
        done.update(ok)
        if not pending:
            break
    return done


def reindex(
    conn: psycopg.Connection[Any],
    engine: OpenSearchEngine,
    *,
    batch_size: int = 500,
    progress: bool = True,
) -> int:
    """Drop and rebuild the index from memory.nodes; returns how many documents went in.

    Queued outbox rows are left alone: replaying them afterwards rewrites identical
    documents, whereas deleting them could lose a node committed after our snapshot.
    """
    proxy = _proxied(conn)
    if proxy:
        row = conn.execute(q("count_nodes_proxy")).fetchone()
        total, missing = (int(row[0] or 0), list(row[1] or [])) if row else (0, [])
        if missing:
            # Checked before the index is dropped: a partition out of reach would leave
            # its documents (and those of every partition after it) out of the new index.
            raise DatabaseUnavailable(
                f"partitions {missing} are unreachable: the index is left as it is",
                hint="`poimen-memory shard status` names their servers; reindex once they are back",
            )
    else:
        total = _count(conn, "count_nodes")
    engine.delete_index()
    engine.ensure_index()
    indexed, failed, first_error = 0, 0, None
    with (
        Progress(total, "opensearch reindex", "nodes", enabled=progress) as bar,
        conn.transaction(),  # a server-side cursor lives inside a transaction
    ):
        for rows in _proxy_pages(conn, batch_size) if proxy else _pages(conn, batch_size):
            results = engine.bulk_index([_doc(*row) for row in rows])
            bad = [r for r in results if not r.ok]
            indexed += len(results) - len(bad)
            failed += len(bad)
            first_error = first_error or next((f"{r.sha256}: {r.error}" for r in bad), None)
            bar.update(len(rows))
    engine.refresh()
    if failed:
        log.warning("reindex: %d of %d documents failed, first: %s", failed, total, first_error)
    return indexed


def _pages(conn: psycopg.Connection[Any], batch_size: int) -> Iterator[list[tuple[Any, ...]]]:
    """Every node's document, through a server-side cursor (inside a transaction)."""
    with conn.cursor(name="opensearch_reindex") as cur:
        cur.execute(q("opensearch_docs"))
        while rows := cur.fetchmany(batch_size):
            yield rows


def _proxy_pages(conn: psycopg.Connection[Any], batch_size: int) -> Iterator[list[tuple[Any, ...]]]:
    """Every partition's documents through a proxy, keyset-paged by global node ids (a
    partition out of reach fails the reindex: 08006)."""
    after = 0
    while rows := conn.execute(
        q("opensearch_docs_proxy"), {"after": after, "limit": batch_size}
    ).fetchall():
        after = rows[-1][0]
        yield [row[1:] for row in rows]


def enable_outbox(conn: psycopg.Connection[Any]) -> None:
    """From now on the triggers on memory.nodes queue every change for OpenSearch."""
    with conn.transaction():
        conn.execute(q("outbox_on"))
