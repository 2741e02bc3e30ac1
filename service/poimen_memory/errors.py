"""Typed errors, and the one table mapping SQLSTATE to HTTP status and error code."""

from __future__ import annotations

import logging

from poimen_core.vocabulary import SQLSTATES

log = logging.getLogger("poimen_memory")

# How each front takes a request's parameters, for the hints that ask for one: HTTP's
# query string, an MCP tool's arguments; None: the neutral name (the CLI's report, logs).
FRONTS = ("http", "mcp")


def parameter(spec: str, front: str | None) -> str:
    """How ``front`` takes a parameter, in a hint's words: ``spec`` is its name, or
    ``name=value``."""
    name, _, value = spec.partition("=")
    if front == "http":
        return f"?{name}={value}"
    if front == "mcp":
        return f"the `{name}` argument" + (f" set to {value}" if value else "")
    return f"`{spec}`"


class _Parameters(dict[str, str]):
    def __init__(self, front: str | None) -> None:
        super().__init__()
        self.front = front

    def __missing__(self, name: str) -> str:
        return parameter(name, self.front)


class PoimenError(Exception):
    """Base class: every error carries a stable code, a detail and a hint.

    ``front_hint``, where the hint asks for a parameter, says it in each front's words:
    ``{project}`` is how that front takes ``project``, ``{skip_invalid=true}`` how it sets
    it (`parameter`). Given (or set on the
    class), it is what the fronts answer (`hint_for`), in place of the hint the error was
    raised with (a SQL function's own words, ``project => ...``)."""

    code = "internal_error"
    http_status = 500
    front_hint: str | None = None

    def __init_subclass__(cls, code: str | None = None, status: int | None = None) -> None:
        # Each error names its API code and HTTP status in its class line.
        super().__init_subclass__()
        if code is not None:
            cls.code = code
        if status is not None:
            cls.http_status = status

    def __init__(
        self,
        message: str,
        *,
        detail: str | None = None,
        hint: str | None = None,
        front_hint: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.detail = detail
        if front_hint is not None:
            self.front_hint = front_hint
        if hint is None and self.front_hint is not None:
            hint = self.front_hint.format_map(_Parameters(None))
        self.hint = hint
        self.sqlstate: str | None = None

    def response_headers(self) -> dict[str, str]:
        """Headers an HTTP answer of this error carries beside its JSON body (each front
        that answers over HTTP sends them)."""
        return {}

    def hint_for(self, front: str | None) -> str | None:
        """The hint in this front's words (FRONTS); None: the hint as raised."""
        if front is None or self.front_hint is None:
            return self.hint
        return self.front_hint.format_map(_Parameters(front))

    def public_json(self, front: str | None = None) -> dict[str, str]:
        """What a client is shown (an HTTP error body, an MCP tool or resource error): the
        error in our words. A database error in the server's own words (one no class names,
        or of a class that describes the server: a data file's path when the disk is full,
        a host that refused) is shown as its SQLSTATE; the words go to the service's log."""
        if not _servers_words(self):
            return self.to_json(front)
        log.error("database error %s: %s (%s)", self.sqlstate, self.message, self.detail or "")
        return {
            "error": self.code,
            "detail": "the database could not complete the request "
            f"(SQLSTATE {self.sqlstate or 'none: no connection'})",
            "hint": "the service's log has the server's message, under this X-Request-ID",
        }

    def to_json(self, front: str | None = None) -> dict[str, str]:
        """The error body; ``front`` (FRONTS) words the hint for the caller's front."""
        body = {"error": self.code, "detail": self.message}
        if self.detail:
            body["context"] = self.detail
        hint = self.hint_for(front)
        if hint:
            body["hint"] = hint
        return body


class ClusterError(PoimenError, code="cluster_error"):
    """The embedded cluster could not be created, started or stopped."""


class MigrationError(PoimenError, code="migration_error"):
    """A migration is unknown, changed after release, or failed to apply."""


class ValidationError(PoimenError, code="invalid_parameter", status=400):
    """A request or SQL argument is out of range or malformed (22023, 22P02, 22000)."""


class QueryTooCostly(PoimenError, code="query_too_costly", status=400):
    """A query over the work budget memory._plan checks before it runs (PM400): more
    distinct terms, or postings to read, than the policy allows (query_max_terms,
    query_max_postings); the hint names the limit."""


class UnknownProject(PoimenError, code="unknown_project", status=404):
    """The named project has no row in memory.projects (PM404)."""


class UnknownNode(PoimenError, code="unknown_node", status=404):
    """No node of this id that the caller may read (PM444): another project's node is as
    unknown as one that never existed."""


class AmbiguousNode(PoimenError, code="ambiguous_node", status=409):
    """The id names nodes in several of the caller's projects and no project was named
    (PMA09)."""

    front_hint = "name the project with {project} (ids are unique per project)"


class UnknownReviewItem(PoimenError, code="unknown_review_item", status=404):
    """No open review item of this id that the caller may see (PM446): done, or another
    project's."""


class ReviewConflict(PoimenError, code="review_conflict", status=409):
    """A review item cannot be confirmed as it stands (PM449): a parent it rests on is
    itself in doubt (review that one first), or none of its parents is left."""


class DatabaseUnavailable(PoimenError, code="database_unavailable", status=503):
    """No connection to PostgreSQL, or the server refused one (08xxx, 53xxx, 57P01)."""


class DeadlineExceeded(PoimenError, code="timeout", status=503):
    """The request's deadline passed; PostgreSQL cancelled the statement (57014)."""


class IngestError(PoimenError, code="invalid_node", status=400):
    """A node failed validation; nothing of the batch was written."""


class Unauthorized(PoimenError, code="unauthorized", status=401):
    """No API key, or one that is unknown or revoked, while keys are required."""


class Forbidden(PoimenError, code="forbidden", status=403):
    """The API key does not cover this project, or it is read-only and this is a write."""


class PayloadTooLarge(PoimenError, code="payload_too_large", status=413):
    """A request body over POIMEN_MAX_BODY_BYTES; it was not read to the end."""


class ResponseTooLarge(PoimenError, code="response_too_large", status=413):
    """An answer over POIMEN_HTTP_MAX_RESPONSE_BYTES even with its provenance texts cut
    (policy provenance_text_chars): refused whole rather than sent in part."""


class RequestTimeout(PoimenError, code="request_timeout", status=408):
    """The request body did not arrive within POIMEN_HTTP_BODY_TIMEOUT_S."""


class Busy(PoimenError, code="busy", status=503):
    """At capacity: every ingest slot (POIMEN_INGEST_WORKERS + POIMEN_INGEST_QUEUE), or the
    admission queue (POIMEN_HTTP_MAX_INFLIGHT + POIMEN_HTTP_QUEUE), is taken; retry later."""


class ConflictError(PoimenError, code="conflict", status=409):
    """A write collided with stored data (23505: a unique key, e.g. a project's node id)."""


class StaleRevision(PoimenError, code="stale_revision", status=409):
    """A write named the revision it read, and another write came first (PM419)."""


class UnsupportedMediaType(PoimenError, code="unsupported_media_type", status=415):
    """A write's body in a type a browser sends across origins without asking (text/plain,
    a form): refused, so no web page can write (api/app.py); and a POST /mcp body that is
    not application/json (api/mcp_server.py)."""


class UnsupportedEncoding(UnsupportedMediaType):
    """A request body in a Content-Encoding (gzip, br, ...): no route decodes one
    (api/body.py). The answer names the one coding taken, as RFC 9110 (15.5.16) asks."""

    def response_headers(self) -> dict[str, str]:
        return {"Accept-Encoding": "identity"}


class OverShare(PoimenError, code="too_many_requests", status=429):
    """One client (an API key, or an address in anonymous mode) has its share of the
    service in use (POIMEN_HTTP_CLIENT_INFLIGHT) or has sent its rate's worth
    (POIMEN_HTTP_CLIENT_RATE): retry after Retry-After; the other clients are served."""


class TooManyNodes(PoimenError, code="too_many_nodes", status=422):
    """A forget would end more nodes than its bound (max_nodes, POIMEN_FORGET_MAX_NODES:
    PM422); nothing was forgotten."""


class ConfigError(PoimenError, ValueError, code="config_error"):
    """A setting (environment variable) has an unusable value; the message names it."""


class EmbeddingModelMismatch(PoimenError, code="embedding_model_mismatch", status=409):
    """A vector's model or dimension differs from the database's (PM409)."""


class EmbeddingNotConfigured(PoimenError, code="embedding_not_configured", status=412):
    """The database has no embedding model recorded yet (PM412)."""


class ComponentUnavailable(PoimenError, code="component_unavailable", status=503):
    """A part of the database install is missing on this host (PM503: the PL/Python module)."""


class UpstreamUnavailable(PoimenError, code="upstream_unavailable", status=503):
    """An upstream server (embedder, reranker, OpenSearch) gave no usable answer.

    ``reason`` is one short stable tag, the same vocabulary for every upstream, used in
    ``degraded`` entries, logs and metrics: ``timeout``, ``transport`` (refused, reset, DNS),
    ``http_status`` (with ``status``), ``bad_response``, ``model`` (local model files),
    ``deadline`` (no time left to try). The message is for humans and names the URL.
    """

    upstream = "upstream"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        status: int | None = None,
        detail: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, detail=detail, hint=hint)
        self.reason = reason
        self.status = status

    @property
    def tag(self) -> str:
        """``reason``, with the status folded in (``http_503``) where there is one."""
        return (
            f"http_{self.status}" if self.reason == "http_status" and self.status else self.reason
        )


class EmbeddingUnavailable(UpstreamUnavailable, code="embedding_service_unavailable"):
    upstream = "embedder"


class EmbeddingModelError(EmbeddingUnavailable):
    """The local model or tokenizer file is missing or fails its sha256 check: permanent, so
    the service loads the embedder at start-up and refuses to start instead."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="model")


class RerankUnavailable(UpstreamUnavailable, code="rerank_unavailable"):
    upstream = "reranker"


class OpenSearchUnavailable(UpstreamUnavailable, code="opensearch_unavailable"):
    upstream = "opensearch"


class NotMigrated(PoimenError, code="not_migrated", status=503):
    """The database lacks the memory schema or one of its objects (3F000, 42P01, 42883)."""


class DatabaseError(PoimenError, code="database_error"):
    """A database error the table below does not name."""


# The single SQLSTATE -> error class table; each class carries its API code and HTTP status.
# Codes in class PM are raised by our own SQL functions (see sql/); the rest are
# PostgreSQL's own. A full code wins over its two-letter class.
SQLSTATE_TABLE: dict[str, type[PoimenError]] = {
    SQLSTATES["unknown_project"]: UnknownProject,
    SQLSTATES["embedding_model_mismatch"]: EmbeddingModelMismatch,
    SQLSTATES["embedding_not_configured"]: EmbeddingNotConfigured,
    SQLSTATES["component_unavailable"]: ComponentUnavailable,
    SQLSTATES["stale_revision"]: StaleRevision,
    SQLSTATES["unknown_node"]: UnknownNode,
    SQLSTATES["too_many_nodes"]: TooManyNodes,
    SQLSTATES["ambiguous_node"]: AmbiguousNode,
    SQLSTATES["unknown_review_item"]: UnknownReviewItem,
    SQLSTATES["review_conflict"]: ReviewConflict,
    SQLSTATES["query_too_costly"]: QueryTooCostly,
    "22023": ValidationError,
    "22P02": ValidationError,
    "22000": ValidationError,
    "23505": ConflictError,
    "42501": Forbidden,  # a privilege, or a row-level security policy (sql/085_tenants.sql)
    "57014": DeadlineExceeded,
    "3F000": NotMigrated,
    "42P01": NotMigrated,
    "42883": NotMigrated,
    "57P01": DatabaseUnavailable,
    "53300": DatabaseUnavailable,
    "08": DatabaseUnavailable,
    "53": DatabaseUnavailable,
}


# SQLSTATE classes in which the message is the server's account of itself: insufficient
# resources (53: "could not extend file base/16384/..."), system errors (58), internal (XX),
# connections (08) and the server going away (57P).
_SERVER_CLASSES = ("53", "58", "XX", "08", "57P")


def _servers_words(err: PoimenError) -> bool:
    if isinstance(err, DatabaseError):
        return True
    if isinstance(err, DatabaseUnavailable):
        return True  # its context is the connection's (host, port) or the server's words
    return err.sqlstate is not None and err.sqlstate.startswith(_SERVER_CLASSES)


def from_sqlstate(
    sqlstate: str | None, message: str, detail: str | None = None, hint: str | None = None
) -> PoimenError:
    """Translate a database error into our typed error (unknown codes: `DatabaseError`)."""
    cls: type[PoimenError] = DatabaseError
    if sqlstate:
        cls = SQLSTATE_TABLE.get(sqlstate) or SQLSTATE_TABLE.get(sqlstate[:2]) or DatabaseError
    if cls is NotMigrated and not hint:
        hint = "run `poimen-memory migrate` against this database"
    err = cls(message, detail=detail, hint=hint)
    err.sqlstate = sqlstate
    return err
