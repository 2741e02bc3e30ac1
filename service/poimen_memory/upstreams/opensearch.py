"""Optional OpenSearch lexical engine (docs/opensearch.md).

Postgres stays the source of truth: the index is rebuilt from it (outbox.reindex) and
fed through the outbox (outbox.sync_outbox). Every call carries an explicit timeout and
the client never retries, because query calls run against the request's deadline and
the outbox drainer owns its own retry policy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

from opensearchpy import OpenSearch
from opensearchpy.exceptions import (
    ConnectionError,
    ConnectionTimeout,
    OpenSearchException,
    RequestError,
    TransportError,
)

from poimen_memory.errors import OpenSearchUnavailable
from poimen_memory.settings import OpenSearchSettings

log = logging.getLogger(__name__)

SEARCH_FIELDS = ["content^2", "section_title^1.5", "breadcrumb", "source"]

# "strict" turns a doc-shape bug into a visible per-item failure instead of a silently
# widened mapping.
MAPPINGS: dict[str, Any] = {
    "dynamic": "strict",
    "properties": {
        # content.exact: unstemmed, for the query grammar's #tags and @mentions (an index
        # made before it has no such field: `poimen-memory opensearch reindex` adds it)
        "content": {
            "type": "text",
            "analyzer": "english",
            "fields": {"exact": {"type": "text", "analyzer": "standard"}},
        },
        "section_title": {"type": "text"},
        "breadcrumb": {"type": "text"},
        "source": {
            "type": "text",
            "fields": {"keyword": {"type": "keyword", "ignore_above": 1024}},
        },
        "project_id": {"type": "keyword"},
        "level": {"type": "keyword"},
        "sha256": {"type": "keyword"},
    },
}

# Item statuses worth another try: the cluster was busy, not the document wrong.
RETRIABLE_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class LexicalHit:
    sha256: str
    rank: int
    score: float


@dataclass(frozen=True)
class Doc:
    """One node as indexed; its ``sha256`` (hex) is the document _id."""

    sha256: str
    content: str
    section_title: str | None
    breadcrumb: str
    source: str | None
    project_id: str
    level: str

    def source_json(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "section_title": self.section_title,
            "breadcrumb": self.breadcrumb,
            "source": self.source,
            "project_id": self.project_id,
            "level": self.level,
            "sha256": self.sha256,
        }


@dataclass(frozen=True)
class BulkOp:
    op: Literal["index", "delete"]
    sha256: str
    doc: Doc | None = None


@dataclass(frozen=True)
class BulkResult:
    sha256: str
    ok: bool
    status: int
    error: str | None = None

    @property
    def retriable(self) -> bool:
        return not self.ok and self.status in RETRIABLE_STATUSES


# The fields the query grammar's operands are matched on: a phrase or an excluded term as
# BM25 stems it (content's english analyzer, like Postgres' tsvector), a tag or mention as
# the exact token (content.exact; titles and breadcrumbs are not stemmed).
_STEMMED_FIELDS = ["content", "section_title", "breadcrumb"]
_EXACT_FIELDS = ["content.exact", "section_title", "breadcrumb"]


def _operand(item: dict[str, Any]) -> dict[str, Any]:
    """One operand of memory.parse_query's parse as an OpenSearch clause."""
    exact = item["kind"] in ("tag", "mention")
    return {
        "multi_match": {
            "query": item["value"],
            "type": "phrase",
            "fields": list(_EXACT_FIELDS if exact else _STEMMED_FIELDS),
        }
    }


def search_body(
    query: str,
    project: str | None,
    levels: Sequence[str] | None,
    k: int,
    grammar: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The seed's query body; filters appear only when asked for. ``grammar`` (the plan's
    parse, memory.parse_query) adds the operators: each required group as a filter that one
    of its operands satisfies, each exclusion as must_not, and only the words it scores."""
    filters: list[dict[str, Any]] = []
    if project is not None:
        filters.append({"term": {"project_id": project}})
    if levels:
        filters.append({"terms": {"level": list(levels)}})
    must_not: list[dict[str, Any]] = []
    if grammar and grammar.get("operators"):
        query = grammar["text"]
        for group in grammar["required"]:
            filters.append(
                {"bool": {"should": [_operand(i) for i in group], "minimum_should_match": 1}}
            )
        for item in grammar["exclude"]:
            clause = _operand(item)
            must_not.append(clause)
            if item["kind"] in ("term", "phrase"):
                # the word itself too, whatever the stemmer makes of it
                exact = {**clause["multi_match"], "fields": list(_EXACT_FIELDS)}
                must_not.append({"multi_match": exact})
    body: dict[str, Any] = {
        "size": k,
        "query": {
            "bool": {
                "must": [
                    {
                        "multi_match": {
                            "query": query,
                            "fields": list(SEARCH_FIELDS),
                            "fuzziness": "AUTO",
                        }
                    }
                ],
                "filter": filters,
            }
        },
    }
    if must_not:
        body["query"]["bool"]["must_not"] = must_not
    return body


def _unavailable(exc: OpenSearchException, what: str) -> OpenSearchUnavailable:
    if isinstance(exc, ConnectionTimeout):
        return OpenSearchUnavailable(f"{what}: timed out", reason="timeout")
    if isinstance(exc, ConnectionError):
        return OpenSearchUnavailable(f"{what}: connection failed ({exc.info})", reason="transport")
    if isinstance(exc, TransportError) and isinstance(exc.status_code, int):
        return OpenSearchUnavailable(
            f"{what}: HTTP {exc.status_code} {exc.error}",
            reason="http_status",
            status=exc.status_code,
        )
    return OpenSearchUnavailable(f"{what}: {exc}", reason="transport")


def _item_error(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('type', 'error')}: {error.get('reason', '')}".strip()
    return str(error)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _off_the_loop(call: Callable[_P, _R]) -> Callable[_P, Awaitable[_R]]:
    """A blocking call as a coroutine function with the same parameters, run in a thread."""

    async def in_a_thread(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await asyncio.to_thread(call, *args, **kwargs)

    return in_a_thread


class OpenSearchEngine:
    def __init__(
        self,
        url: str,
        index: str = "poimen-memory",
        *,
        timeout_s: float = 2.0,
        bulk_timeout_s: float = 30.0,
        verify_certs: bool = True,
        ca_certs: str | None = None,
    ) -> None:
        self.url, self.index = url, index
        self.timeout_s, self.bulk_timeout_s = timeout_s, bulk_timeout_s
        self._client = OpenSearch(
            hosts=[url],
            timeout=timeout_s,
            max_retries=0,
            retry_on_timeout=False,
            verify_certs=verify_certs,
            ca_certs=ca_certs,
            ssl_show_warn=False,  # engine_from_settings logs the unverified-TLS choice once
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> OpenSearchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ensure_index(self) -> bool:
        """Create the index when missing; True when this call created it."""
        try:
            if self._client.indices.exists(index=self.index, request_timeout=self.timeout_s):
                return False
            self._client.indices.create(
                index=self.index, body={"mappings": MAPPINGS}, request_timeout=self.bulk_timeout_s
            )
        except RequestError as exc:
            if exc.error == "resource_already_exists_exception":
                return False  # a concurrent drainer won the race
            raise _unavailable(exc, "create index") from exc
        except OpenSearchException as exc:
            raise _unavailable(exc, "create index") from exc
        return True

    def delete_index(self) -> None:
        try:
            self._client.indices.delete(
                index=self.index, ignore=[404], request_timeout=self.bulk_timeout_s
            )
        except OpenSearchException as exc:
            raise _unavailable(exc, "delete index") from exc

    def refresh(self) -> None:
        try:
            self._client.indices.refresh(index=self.index, request_timeout=self.bulk_timeout_s)
        except OpenSearchException as exc:
            raise _unavailable(exc, "refresh") from exc

    def bulk(self, ops: Sequence[BulkOp]) -> list[BulkResult]:
        """One _bulk request; a result per op, in order. Raises only when the whole
        request failed; per-item failures come back as results with ``ok=False``."""
        if not ops:
            return []
        lines: list[dict[str, Any]] = []
        for op in ops:
            lines.append({op.op: {"_id": op.sha256}})
            if op.op == "index":
                assert op.doc is not None, "index ops carry a doc"
                lines.append(op.doc.source_json())
        try:
            resp = self._client.bulk(
                body=lines, index=self.index, request_timeout=self.bulk_timeout_s
            )
        except OpenSearchException as exc:
            raise _unavailable(exc, "bulk") from exc
        items = resp.get("items") if isinstance(resp, dict) else None
        if not isinstance(items, list) or len(items) != len(ops):
            reason = f"bulk: malformed response ({str(resp)[:200]})"
            raise OpenSearchUnavailable(reason, reason="bad_response")
        results: list[BulkResult] = []
        for op, item in zip(ops, items, strict=True):
            body = item.get(op.op, {}) if isinstance(item, dict) else {}
            status = int(body.get("status", 500))
            # Deleting what is already gone is the outcome we wanted.
            ok = 200 <= status < 300 or (op.op == "delete" and status == 404)
            error = None if ok else _item_error(body.get("error", f"HTTP {status}"))
            results.append(BulkResult(op.sha256, ok, status, error))
        return results

    def bulk_index(self, docs: Iterable[Doc]) -> list[BulkResult]:
        return self.bulk([BulkOp("index", d.sha256, d) for d in docs])

    def bulk_delete(self, sha256s: Iterable[str]) -> list[BulkResult]:
        return self.bulk([BulkOp("delete", s) for s in sha256s])

    def search(
        self,
        query: str,
        project: str | None,
        levels: list[str] | None,
        k: int,
        timeout_s: float,
        grammar: dict[str, Any] | None = None,
    ) -> list[LexicalHit]:
        if grammar and grammar.get("operators"):
            query = grammar["text"]  # only exclusions: nothing to score, nothing to return
        if k <= 0 or not query.strip():
            return []
        if timeout_s <= 0:
            raise OpenSearchUnavailable(
                "search: no time left before the deadline", reason="deadline"
            )
        try:
            # _source=false keeps the payload small without touching the seed body.
            resp = self._client.search(
                index=self.index,
                body=search_body(query, project, levels, k, grammar),
                params={"_source": "false"},
                request_timeout=timeout_s,
            )
        except OpenSearchException as exc:
            raise _unavailable(exc, "search") from exc
        try:
            hits = resp["hits"]["hits"]
            return [
                LexicalHit(str(h["_id"]), rank, float(h["_score"] or 0.0))
                for rank, h in enumerate(hits, start=1)
            ]
        except (KeyError, TypeError, ValueError) as exc:
            reason = f"search: malformed response ({exc!r})"
            raise OpenSearchUnavailable(reason, reason="bad_response") from exc

    # `search` off the event loop, with the same parameters; timeout_s should be the
    # request's remaining deadline, which also bounds how long the worker thread outlives a
    # cancellation.
    asearch = _off_the_loop(search)

    def healthy(self, timeout_s: float | None = None) -> bool:
        try:
            health = self._client.cluster.health(request_timeout=timeout_s or self.timeout_s)
        except Exception:  # a health probe reports, it never raises
            return False
        return isinstance(health, dict) and health.get("status") in ("green", "yellow")


def engine_from_settings(settings: OpenSearchSettings) -> OpenSearchEngine | None:
    if not settings.url:
        return None
    if not settings.verify_certs:
        log.warning("OpenSearch TLS certificates are not verified (POIMEN_OPENSEARCH_VERIFY_CERTS)")
    return OpenSearchEngine(
        settings.url,
        settings.index,
        timeout_s=settings.timeout_s,
        bulk_timeout_s=settings.bulk_timeout_s,
        verify_certs=settings.verify_certs,
        ca_certs=str(settings.ca_certs) if settings.ca_certs else None,
    )
