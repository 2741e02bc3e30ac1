"""Python side of the PL/Python shim around the query optimizer.

The SQL functions stay one-liners that call into here, so the logic is unit-testable
without a database: ``plpy`` is passed in rather than imported, because the real
module only exists inside the PostgreSQL backend.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import NoReturn, Protocol

from poimen_core.optimizer import (
    OPTIMIZER_VERSION,
    QueryOptimizerError,
    optimize_query,
    reference_time_error,
)

__all__ = ["INVALID_PARAMETER_VALUE", "PlpyLike", "optimize_query_json", "plan_for_sql"]

# SQLSTATE invalid_parameter_value: the caller passed a bad argument, not a server fault.
INVALID_PARAMETER_VALUE = "22023"


class PlpyLike(Protocol):
    """The slice of PL/Python's ``plpy`` module used here (keywords need PG >= 9.6)."""

    def error(
        self,
        msg: str,
        /,
        *,
        detail: str | None = ...,
        hint: str | None = ...,
        sqlstate: str | None = ...,
    ) -> NoReturn: ...


def optimize_query_json(raw: str | None, reference_time: str | None = None) -> str:
    """Optimize ``raw`` and return the context as JSON; SQL NULL raises QueryOptimizerError.
    ``reference_time`` is an ISO timestamp (the SQL function pins DateStyle ISO)."""
    if raw is None:
        raise QueryOptimizerError("query is NULL")
    ref = None
    if reference_time:
        try:
            ref = datetime.fromisoformat(reference_time)
        except ValueError:  # 'infinity' or a BC date: PostgreSQL holds them, Python cannot
            raise reference_time_error(reference_time) from None
    # ensure_ascii keeps the text valid in any server encoding, SQL_ASCII included.
    return json.dumps(optimize_query(raw, ref).to_dict())


def plan_for_sql(plpy: PlpyLike, raw: str | None, reference_time: str | None = None) -> str:
    """Like optimize_query_json, but reports bad input as a PostgreSQL error.

    Only QueryOptimizerError is translated; anything else is a bug and should surface
    with its Python traceback.
    """
    try:
        return optimize_query_json(raw, reference_time)
    except QueryOptimizerError as exc:
        received = "NULL" if raw is None else f"a {len(raw)}-character string"
        plpy.error(
            f"poimen query optimizer: {exc}",
            detail=f"received {received}; optimizer version {OPTIMIZER_VERSION}",
            hint=exc.hint,
            sqlstate=INVALID_PARAMETER_VALUE,
        )
