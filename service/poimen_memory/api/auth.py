"""API keys: once any unrevoked key exists (`poimen-memory keys create`), every data
request needs ``Authorization: Bearer <key>``. A key names the projects it may read, and
whether it may write. Keys are checked against their SHA-256, loaded from the database and
cached for a few seconds, so a revoke takes effect within POIMEN_AUTH_CACHE_S."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from poimen_memory.api.credentials import bearer_token
from poimen_memory.db import tenant
from poimen_memory.db.connect import Lender
from poimen_memory.db.queries import q
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.errors import Forbidden, PoimenError, Unauthorized
from poimen_memory.retrieval.deadline import Deadline

KEY_PREFIX = "pmk_"
STALE_GRACE_S = 60.0
log = logging.getLogger(__name__)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Grant:
    projects: frozenset[str]
    can_write: bool
    key_id: int | None = None


class KeyRing:
    def __init__(self, lender: Lender, ttl_s: float, timeout_s: float) -> None:
        # The service's pooled connections: a stopped database fails fast, a busy pool waits.
        self.lender, self.ttl_s, self.timeout_s = lender, ttl_s, timeout_s
        self._keys: dict[bytes, Grant | None] = {}  # None: a revoked key
        self._at = -1e9
        self._lock = asyncio.Lock()

    async def _load(self) -> dict[bytes, Grant | None]:
        async with self._lock:
            age = time.monotonic() - self._at
            if age >= self.ttl_s:
                # A refresh gets a short budget of its own; while the database is slow or
                # down, the keys read last go on serving for STALE_GRACE_S, then it fails.
                budget = (
                    min(self.timeout_s, 1.0) if age < self.ttl_s + STALE_GRACE_S else self.timeout_s
                )
                try:
                    with wrap_exceptions("auth"):
                        deadline = Deadline(budget)
                        async with self.lender.connection(deadline, "auth") as conn:
                            cur = await conn.execute(q("keys_active"))
                            rows = await cur.fetchall()
                except PoimenError:
                    if age >= self.ttl_s + STALE_GRACE_S:
                        raise
                    log.warning(
                        "API keys not refreshed (database slow or down); using the last read"
                    )
                    return self._keys
                self._keys = {
                    bytes(h): Grant(frozenset(p), w, i) if live else None
                    for h, p, w, live, i in rows
                }
                self._at = time.monotonic()
            return self._keys

    @property
    def anonymous(self) -> bool | None:
        """Whether no key exists, as last read (None: not read yet)."""
        return None if self._at < 0 else not self._keys

    async def grant(self, headers: Mapping[str, str]) -> Grant | None:
        """None when no key was ever made (anonymous mode); otherwise the caller's grant,
        from the request's headers (an HTTP request's, or the MCP transport's). Revoking
        every key does not reopen the API: it then refuses every request."""
        keys = await self._load()
        if not keys:
            tenant.assert_for_request(tenant.ALL_PROJECTS)
            return None
        token = bearer_token(headers.get("authorization", ""))
        if token is None:
            raise Unauthorized("an API key is required", hint="send Authorization: Bearer <key>")
        # One lookup by the key's SHA-256, whatever the number of keys (a loop comparing the
        # digest with every stored one cost a request 43 us at 1,000 keys, 0.4 ms at 10,000).
        # What a lookup's timing could tell is how a caller's digest compares with stored
        # digests, and a digest leads to no key: finding one is a SHA-256 preimage.
        grant = keys.get(key_hash(token))
        if grant is None:
            raise Unauthorized("unknown or revoked API key")
        # Postgres enforces the key's projects too (RLS, sql/085_tenants.sql).
        tenant.assert_for_request(
            tenant.Tenant.of(grant.projects, can_write=grant.can_write, key_id=grant.key_id)
        )
        return grant

    async def read_project(self, headers: Mapping[str, str], project: str | None) -> str | None:
        """The project a query may search: the one it names, if the key covers it; without
        one, the key's project (a key for several projects must name one)."""
        grant = await self.grant(headers)
        if grant is None:
            return project
        if project is None:
            if len(grant.projects) == 1:
                return next(iter(grant.projects))
            raise Forbidden(
                "this key covers several projects: name one",
                front_hint="name it with {project}: one of "
                + ", ".join(sorted(grant.projects)).replace("{", "{{").replace("}", "}}"),
            )
        if project not in grant.projects:
            raise Forbidden(f"this key does not cover project {project!r}")
        tenant.assert_for_request(tenant.current().narrowed({project}))
        return project

    async def read_scope(
        self, headers: Mapping[str, str], project: str | None
    ) -> tuple[str | None, list[str] | None]:
        """What a read of nodes may see: the project it names, if the key covers it (403
        otherwise), and the key's projects (None: anonymous, every project). The database
        keeps to both, beside row-level security, so a node of another project is not
        found and its existence does not leak."""
        grant = await self.grant(headers)
        if grant is None:
            return project, None
        if project is not None and project not in grant.projects:
            raise Forbidden(f"this key does not cover project {project!r}")
        if project is not None:
            tenant.assert_for_request(tenant.current().narrowed({project}))
        return project, sorted(grant.projects)

    async def write_projects(self, headers: Mapping[str, str], projects: Iterable[str]) -> None:
        grant = await self.grant(headers)
        if grant is None:
            return
        if not grant.can_write:
            raise Forbidden("this key is read-only", hint="create one with --write")
        named = set(projects)
        outside = sorted(named - grant.projects)
        if outside:
            raise Forbidden(f"this key does not cover project(s) {', '.join(outside)}")
        tenant.assert_for_request(tenant.current().narrowed(named))
