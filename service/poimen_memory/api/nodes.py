"""GET /memory/nodes/{id} and GET /memory/nodes: a node by id, and a page of nodes. The
database does the work (memory.get_node, memory.list_nodes, sql/090_nodes.sql); this
parses the parameters, checks the key and runs the one statement under the key's projects
(row-level security), within the request's deadline."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg.types.json import Jsonb

from poimen_core import vocabulary
from poimen_core.nodes import MAX_ID_CHARS
from poimen_core.vocabulary import LEVELS
from poimen_memory.api.auth import KeyRing
from poimen_memory.api.operations import flag, whole_number
from poimen_memory.contract.query import parse_filter
from poimen_memory.db import tenant
from poimen_memory.db.queries import q
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.errors import ValidationError
from poimen_memory.retrieval.deadline import Deadline
from poimen_memory.services import Services

__all__ = ["LIST_DEFAULT", "LIST_MAX", "get_node", "list_nodes", "project_param"]

LIST_DEFAULT, LIST_MAX = 50, 100  # memory.list_nodes' default and bound


def project_param(params: Mapping[str, str]) -> str | None:
    """The project a read names, checked against the project-name pattern (None: none)."""
    project = params.get("project")
    if project is not None and not vocabulary.PROJECT_NAME_RE.fullmatch(project):
        raise ValidationError(
            f"project {project!r} is not a project name",
            hint="letters, digits, _ . : -; at most 128; starts alphanumeric",
        )
    return project


def _no_nul(params: Mapping[str, str]) -> None:
    for name, value in params.items():
        if "\x00" in value:  # PostgreSQL text cannot hold NUL
            raise ValidationError(f"{name} contains a NUL character")


async def _one(state: Services, name: str, args: dict[str, Any]) -> Any:
    deadline = Deadline(state.settings.default_timeout_s)
    ms = str(int(state.settings.default_timeout_s * 1000))
    with deadline.stage(name), wrap_exceptions(name):
        async with state.lender.connection(deadline, name) as conn, conn.transaction():
            await conn.execute(q("begin_request"), {"ms": ms, **tenant.current().params()})
            cur = await conn.execute(q(name), args)
            row = await cur.fetchone()
    assert row is not None
    return row[0]


async def get_node(
    state: Services, keys: KeyRing, headers: Mapping[str, str], node_id: str,
    params: Mapping[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The GET /memory/nodes/{id} body: memory.get_node's row."""
    _no_nul({**params, "id": node_id})
    if not node_id or len(node_id) > MAX_ID_CHARS:
        raise ValidationError(f"id must be 1 to {MAX_ID_CHARS} characters")
    project, projects = await keys.read_scope(headers, project_param(params))
    doc: dict[str, Any] = await _one(
        state, "get_node", {"id": node_id, "project": project, "projects": projects}
    )
    return doc


async def list_nodes(
    state: Services, keys: KeyRing, headers: Mapping[str, str], params: Mapping[str, str]
) -> dict[str, Any]:
    """The GET /memory/nodes body: a page of memory.list_nodes, and the cursor of the next
    page (null on the last), oldest first or with newest_first=true the latest writes
    first; with count=true also ``count``, how many nodes every page
    together holds (memory.count_nodes: the same filters)."""
    _no_nul(params)
    level = params.get("level")
    if level is not None and level not in LEVELS:
        raise ValidationError(f"level must be one of L0, L1, L2, got {level!r}")
    # refused beyond memory.list_nodes' bound, as SQL refuses it (and as GET /memory/query
    # refuses a limit past its own), where it was clamped
    limit = whole_number(params, "limit", LIST_DEFAULT, 1, LIST_MAX)
    counted, newest = (flag(params, "count"), flag(params, "newest_first"))
    flt = parse_filter(params.get("filter"))
    project, projects = await keys.read_scope(headers, project_param(params))
    args: dict[str, Any] = {
        "project": project,
        "level": level,
        "source": params.get("source"),
        "since": params.get("since"),
        "until": params.get("until"),
        "after": params.get("after"),
        "limit": limit,
        "projects": projects,
        "filter": None if flt is None else Jsonb(flt),
        "newest_first": newest,
    }
    rows: list[dict[str, Any]] = await _one(state, "list_nodes", args)
    # A full page may have a next one (keyset: it starts after this page's last row); a
    # short page is the last.
    nxt = rows[-1]["cursor"] if len(rows) == limit else None
    for r in rows:
        del r["cursor"]
    body: dict[str, Any] = {"nodes": rows, "next_cursor": nxt}
    if counted:
        # A second statement, so a count is paid for only when asked: counting reads every
        # match, a page only its first rows.
        body["count"] = await _one(state, "count_listed", args)
    return body
