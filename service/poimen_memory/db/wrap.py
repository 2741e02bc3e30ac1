"""The one wrapper that turns database exceptions into the product's typed errors.

Every statement the product sends runs inside `wrap_exceptions` (the idea of
procrastinate's ``wrap_exceptions``): callers above the db package only ever see
`PoimenError` subclasses, mapped by the single table in `poimen_memory.errors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from poimen_memory.errors import (
    DatabaseUnavailable,
    DeadlineExceeded,
    PoimenError,
    from_sqlstate,
)


def translate(exc: psycopg.Error) -> PoimenError:
    """The typed error for one psycopg exception (SQLSTATE, message, detail and hint kept)."""
    if isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None:
        # No server answer at all: refused, lost, or no connection from the pool in time.
        return DatabaseUnavailable("database unavailable", detail=str(exc))
    diag = exc.diag
    return from_sqlstate(
        exc.sqlstate, diag.message_primary or str(exc), diag.message_detail, diag.message_hint
    )


@contextmanager
def wrap_exceptions(stage: str | None = None) -> Iterator[None]:
    """Re-raise psycopg errors as typed errors; ``stage`` names what a timeout cancelled."""
    try:
        yield
    except psycopg.errors.QueryCanceled as exc:
        what = f"during {stage}" if stage else "while a statement ran"
        raise DeadlineExceeded(f"deadline passed {what}; the query was cancelled") from exc
    except psycopg.Error as exc:
        raise translate(exc) from exc
