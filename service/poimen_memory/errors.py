"""Typed errors, and the one table mapping SQLSTATE to HTTP status and error code."""

from __future__ import annotations

from dataclasses import dataclass


class PoimenError(Exception):
    """Base class: every error carries a stable code, a detail and a hint."""

    code = "internal_error"
    http_status = 500

    def __init__(self, message: str, *, detail: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.hint = hint

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


@dataclass(frozen=True)
class SqlStateRule:
    error: type[PoimenError]
    code: str
    http_status: int


# The single SQLSTATE -> (exception, API code, HTTP status) table. Codes in class PM are
# raised by our own SQL functions (see sql/); others come from PostgreSQL itself.
SQLSTATE_TABLE: dict[str, SqlStateRule] = {
    "PM404": SqlStateRule(UnknownProject, "unknown_project", 404),
    "PM409": SqlStateRule(PoimenError, "embedding_model_mismatch", 409),
    "PM412": SqlStateRule(PoimenError, "embedding_not_configured", 412),
    "22023": SqlStateRule(ValidationError, "invalid_parameter", 400),
    "22P02": SqlStateRule(ValidationError, "invalid_parameter", 400),
    "22000": SqlStateRule(ValidationError, "invalid_parameter", 400),
    "57014": SqlStateRule(DeadlineExceeded, "timeout", 503),
    "57P01": SqlStateRule(DatabaseUnavailable, "database_unavailable", 503),
    "53300": SqlStateRule(DatabaseUnavailable, "database_unavailable", 503),
}
SQLSTATE_CLASS_TABLE: dict[str, SqlStateRule] = {
    "08": SqlStateRule(DatabaseUnavailable, "database_unavailable", 503),
    "53": SqlStateRule(DatabaseUnavailable, "database_unavailable", 503),
}


def from_sqlstate(
    sqlstate: str | None, message: str, detail: str | None = None, hint: str | None = None
) -> PoimenError:
    """Translate a database error into our typed error with the mapped code and status."""
    rule = None
    if sqlstate:
        rule = SQLSTATE_TABLE.get(sqlstate) or SQLSTATE_CLASS_TABLE.get(sqlstate[:2])
    if rule is None:
        err = PoimenError(message, detail=detail, hint=hint)
        err.code = "database_error"
        return err
    err = rule.error(message, detail=detail, hint=hint)
    err.code = rule.code
    err.http_status = rule.http_status
    return err
