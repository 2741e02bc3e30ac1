"""Typed errors, and the one table mapping SQLSTATE to HTTP status and error code."""

from __future__ import annotations


class PoimenError(Exception):
    """Base class: every error carries a stable code, a detail and a hint."""

    code = "internal_error"
    http_status = 500

    def __init__(self, message: str, *, detail: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.hint = hint
        self.sqlstate: str | None = None

    def to_json(self) -> dict[str, str]:
        body = {"error": self.code, "detail": self.message}
        if self.detail:
            body["context"] = self.detail
        if self.hint:
            body["hint"] = self.hint
        return body


class ClusterError(PoimenError):
    code = "cluster_error"


class MigrationError(PoimenError):
    code = "migration_error"


class ValidationError(PoimenError):
    code = "invalid_parameter"
    http_status = 400


class UnknownProject(PoimenError):
    code = "unknown_project"
    http_status = 404


class DatabaseUnavailable(PoimenError):
    code = "database_unavailable"
    http_status = 503


class DeadlineExceeded(PoimenError):
    code = "timeout"
    http_status = 503


class IngestError(PoimenError):
    code = "invalid_node"
    http_status = 400


class ConfigError(PoimenError, ValueError):
    """A setting (environment variable) has an unusable value; the message names it."""

    code = "config_error"


class EmbeddingModelMismatch(PoimenError):
    code = "embedding_model_mismatch"
    http_status = 409


class EmbeddingNotConfigured(PoimenError):
    code = "embedding_not_configured"
    http_status = 412


class ComponentUnavailable(PoimenError):
    """A part of the database install is missing on this host (PM503: the PL/Python module)."""

    code = "component_unavailable"
    http_status = 503


class UpstreamUnavailable(PoimenError):
    """An upstream server (embedder, reranker, OpenSearch) gave no usable answer.

    ``reason`` is one short stable tag, the same vocabulary for every upstream, used in
    ``degraded`` entries, logs and metrics: ``timeout``, ``transport`` (refused, reset, DNS),
    ``http_status`` (with ``status``), ``bad_response``, ``model`` (local model files),
    ``deadline`` (no time left to try). The message is for humans and names the URL.
    """

    code = "upstream_unavailable"
    http_status = 503
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


class EmbeddingUnavailable(UpstreamUnavailable):
    code = "embedding_service_unavailable"
    upstream = "embedder"


class EmbeddingModelError(EmbeddingUnavailable):
    """The local model or tokenizer file is missing or fails its sha256 check: permanent, so
    the service loads the embedder at start-up and refuses to start instead."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="model")


class RerankUnavailable(UpstreamUnavailable):
    code = "rerank_unavailable"
    upstream = "reranker"


class OpenSearchUnavailable(UpstreamUnavailable):
    code = "opensearch_unavailable"
    upstream = "opensearch"


class DatabaseError(PoimenError):
    """A database error the table below does not name."""

    code = "database_error"


# The single SQLSTATE -> error class table; each class carries its API code and HTTP status.
# Codes in class PM are raised by our own SQL functions (see sql/); the rest are
# PostgreSQL's own. A full code wins over its two-letter class.
SQLSTATE_TABLE: dict[str, type[PoimenError]] = {
    "PM404": UnknownProject,
    "PM409": EmbeddingModelMismatch,
    "PM412": EmbeddingNotConfigured,
    "PM503": ComponentUnavailable,
    "22023": ValidationError,
    "22P02": ValidationError,
    "22000": ValidationError,
    "57014": DeadlineExceeded,
    "57P01": DatabaseUnavailable,
    "53300": DatabaseUnavailable,
    "08": DatabaseUnavailable,
    "53": DatabaseUnavailable,
}


def from_sqlstate(
    sqlstate: str | None, message: str, detail: str | None = None, hint: str | None = None
) -> PoimenError:
    """Translate a database error into our typed error (unknown codes: `DatabaseError`)."""
    cls: type[PoimenError] = DatabaseError
    if sqlstate:
        cls = SQLSTATE_TABLE.get(sqlstate) or SQLSTATE_TABLE.get(sqlstate[:2]) or DatabaseError
    err = cls(message, detail=detail, hint=hint)
    err.sqlstate = sqlstate
    return err
