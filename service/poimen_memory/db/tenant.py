"""The projects the service asserts to PostgreSQL for the request it serves.

Row-level security (sql/085_tenants.sql) honours ``poimen.read_projects`` and
``poimen.write_projects`` only for members of the database's service role. The
API layer decides them from the caller's key (every project in anonymous mode) and they
travel with the request in a context variable; each pooled transaction sets them with
``set_config(..., true)``, so they end with the transaction and never leak to the next
borrower of the connection. The default asserts no project: a path that forgets to set
them sees nothing rather than everything."""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import psycopg

from poimen_core import vocabulary
from poimen_memory.db.queries import q
from poimen_memory.errors import Forbidden

EVERY = "*"


def _refuse(name: str) -> Forbidden:
    err = Forbidden(
        f"API key names an invalid project {name!r}",
        detail=f"a project name matches {vocabulary.PROJECT_NAME}",
        hint="revoke the key (poimen-memory keys revoke) and create one with valid names",
    )
    err.sqlstate = "42501"
    return err


@dataclass(frozen=True)
class Tenant:
    read: frozenset[str]
    write: frozenset[str]
    # The API key's id (memory.api_keys.id): recorded as who wrote or ended a version.
    key_id: int | None = None

    def __post_init__(self) -> None:
        # The names are joined with ',' into one setting that Postgres splits again, and '*'
        # there means every project: a name holding either would assert more projects than
        # the key has. Only ALL_PROJECTS carries EVERY, and only alone.
        for names in (self.read, self.write):
            for name in names:
                if "," in name or ("*" in name and names != {EVERY}):
                    raise _refuse(name)

    @classmethod
    def of(cls, projects: Iterable[str], *, can_write: bool, key_id: int | None = None) -> Tenant:
        """A key's projects: real project names only (never EVERY, whatever is stored)."""
        p = frozenset(projects)
        for name in p:
            if not vocabulary.PROJECT_NAME_RE.fullmatch(name):
                raise _refuse(name)
        return cls(p, p if can_write else frozenset(), key_id)

    def narrowed(self, projects: Iterable[str]) -> Tenant:
        """The same key asserting only the projects a request names (which the caller has
        checked it covers): what row-level security costs grows with the projects asserted
        (each is resolved to its id in every statement), so a request naming one project
        of a key covering 1,000 costs what a one-project key's does (issue 42)."""
        p = frozenset(projects)
        if EVERY in self.read or not p:
            return self
        return Tenant(self.read & p, self.write & p, self.key_id)

    def params(self) -> dict[str, str]:
        return {
            "read": ",".join(sorted(self.read)),
            "write": ",".join(sorted(self.write)),
            "key": "" if self.key_id is None else str(self.key_id),
        }


ALL_PROJECTS = Tenant(frozenset({EVERY}), frozenset({EVERY}))
NO_PROJECT = Tenant(frozenset(), frozenset())

_current: ContextVar[Tenant] = ContextVar("poimen_tenant", default=NO_PROJECT)


def current() -> Tenant:
    return _current.get()


def assert_for_request(tenant: Tenant) -> None:
    """Called by the API layer once it knows the caller (tasks the request starts inherit it)."""
    _current.set(tenant)


def assert_for_session(conn: psycopg.Connection[Any], tenant: Tenant) -> None:
    """For a connection that serves one request or one background job and is then closed
    (ingest, the outbox drain): the setting lasts for the session."""
    conn.execute(q("assert_projects_session"), tenant.params())
