"""What a search, a write and a forget do once a transport has read the request: the one
code path behind ``GET /memory/query``, ``POST /memory/nodes``, ``DELETE /memory/nodes`` and
``GET /memory/nodes/{id}/history`` and the MCP tools ``memory_query``, ``memory_add``,
``memory_forget`` and ``memory_history`` (api/mcp_server.py). Each takes the caller's headers
for the API key, so the key's projects, the parameter bounds, the deadline and the typed
errors are the same whichever way the request came."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from psycopg import sql as pgsql
from psycopg.types.json import Jsonb

from poimen_core.vocabulary import LEVELS, NOTE_MAX_CHARS
from poimen_memory.api.auth import KeyRing
from poimen_memory.api.numbers import digits_value
from poimen_memory.contract.query import parse_filter, parse_query
from poimen_memory.db import tenant
from poimen_memory.db.connect import connect
from poimen_memory.db.queries import q
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.embedders.base import WRITE_DEADLINE
from poimen_memory.errors import Busy, IngestError, ResponseTooLarge, ValidationError
from poimen_memory.ingest.nodes import LineError, NodeRecord, parse_lines
from poimen_memory.ingest.writer import ingest
from poimen_memory.services import Services
from poimen_memory.settings import Settings

__all__ = [
    "bounded_json",
    "forget_nodes",
    "in_thread",
    "list_projects",
    "node_history",
    "project_summary",
    "query_memory",
    "records_from_lines",
    "text_params",
    "write_nodes",
]


def bounded_json(settings: Settings, body: Any, *, history: bool = False) -> bytes:
    """A read's answer as the JSON sent (compact UTF-8, as Starlette's JSONResponse writes
    it), refused whole with ResponseTooLarge (413) when it weighs more than
    POIMEN_HTTP_MAX_RESPONSE_BYTES: the one check of the HTTP routes and the MCP tools, so
    an answer one front refuses the other refuses too, in the same words. ``history``: the
    answer is a node's history (memory.history), which has no page or limit to ask for."""
    encoded = json.dumps(
        body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")
    limit = settings.max_response_bytes
    if len(encoded) <= limit:
        return encoded
    weight = f"the answer is {len(encoded)} bytes, over the {limit}-byte budget"
    if history:
        raise ResponseTooLarge(
            weight,
            detail="a node's history is answered whole, every version with its text",
            hint="raise POIMEN_HTTP_MAX_RESPONSE_BYTES, or read it in SQL (memory.history)",
        )
    raise ResponseTooLarge(
        weight,
        detail="provenance texts are already cut at the policy's provenance_text_chars",
        hint="ask for fewer results (limit), fewer cited turns (evidence), lower levels, "
        "or raise POIMEN_HTTP_MAX_RESPONSE_BYTES",
    )


async def query_memory(
    state: Services,
    keys: KeyRing,
    headers: Mapping[str, str],
    params: Mapping[str, Any],
    *,
    arrived: float | None = None,
) -> dict[str, Any]:
    """The GET /memory/query answer for these parameters (a URL's strings, or an MCP call's
    JSON arguments: the contract takes both).
    The deadline counts from ``arrived`` (time.monotonic()) when given: time queued counts."""
    req = parse_query(params, state.settings)
    req = req.model_copy(update={"project": await keys.read_project(headers, req.project)})
    return await state.retriever.query(req, started=arrived)


def records_from_lines(
    lines: Iterable[str], project: str | None
) -> tuple[list[NodeRecord], list[LineError]]:
    """The nodes of a write, one JSON object a line; refused when there is none, or when
    none is valid (that is a bad request, not a write of nothing)."""
    records, invalid = parse_lines(list(lines), project)
    if not records and not invalid:
        raise ValidationError("no nodes in the request body")
    if not records:
        shown = "\n".join(str(e) for e in invalid[:20])
        raise IngestError(
            f"{len(invalid)} invalid line(s) and no valid one; nothing was written",
            detail=shown,
        )
    return records, invalid


async def write_nodes(
    state: Services,
    keys: KeyRing,
    headers: Mapping[str, str],
    records: list[NodeRecord],
    invalid: list[LineError],
    *,
    skip_invalid: bool,
) -> dict[str, Any]:
    """Ingest parsed nodes through the same code as the CLI, as one transaction: every node
    is written, or none is. The answer names each node (id, node_id, revision, status). The
    caller checked the key once before reading the body; this checks it covers, for
    writing, every project the nodes name."""
    await keys.write_projects(headers, {r.project for r in records})
    if state.embedder is None:
        raise ValidationError("no embedder configured; cannot ingest")
    embedder = state.embedder
    caller = tenant.current()  # run_in_executor does not carry context variables

    def run() -> dict[str, Any]:
        bound = WRITE_DEADLINE.set(time.monotonic() + state.settings.ingest_timeout_s)
        try:
            return write()
        finally:
            WRITE_DEADLINE.reset(bound)

    def write() -> dict[str, Any]:
        with connect(state.url, autocommit=True) as conn:
            tenant.assert_for_session(conn, caller)
            report = ingest(
                conn,
                records,
                embedder,
                invalid=invalid,
                skip_invalid=skip_invalid,
                progress=False,
                atomic=True,
                # Each node's id, revision and status: bounded as the request is, by
                # POIMEN_MAX_BODY_BYTES (an id is at most 512 characters, like the node's).
                report_nodes=True,
            )
            return report.to_json()

    if state.ingest_slots.locked():
        raise Busy(
            "every ingest slot is taken",
            hint="retry later; POIMEN_INGEST_WORKERS and POIMEN_INGEST_QUEUE set the capacity",
        )
    async with state.ingest_slots:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.ingest_pool, run)


MAX_FORGET_BOUND = 2**31 - 1  # memory.forget's max_nodes (integer)
_FORGET_PARAMS = {
    "project", "source", "since", "until", "erase", "reason", "id",
    "filter", "level", "dry_run", "max_nodes",
}  # fmt: skip
# What names nodes by filter rather than by id (DELETE /memory/nodes).
_FORGET_FILTERS = {"source", "since", "until", "filter", "level"}
_HISTORY_COLUMNS = (
    "revision", "node_id", "current", "level", "sha256", "title", "text", "source",
    "timestamp", "metadata", "created_at", "expired_at", "end_reason", "written_by",
    "ended_by", "end_note", "erased_at", "valid_from", "valid_to",
)  # fmt: skip


def flag(params: Mapping[str, str], name: str) -> bool:
    """A query parameter that is true or false (false when absent)."""
    raw = params.get(name, "false")
    if raw not in ("true", "false"):
        raise ValidationError(f"{name} must be true or false, got {raw!r}")
    return raw == "true"


def whole_number(params: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """A query parameter that is a whole number within lo..hi (default when absent), in the
    words GET /memory/query's contract uses; refused by name, never clamped. ASCII digits
    only: int() also reads Arabic-Indic digits, " 5" and "1_0" (issue 43); and no int() of
    a number longer than any bound (past 4,300 digits int() raises, which was a 500)."""
    raw = params.get(name)
    if raw is None:
        return default
    negative = raw.startswith("-")
    size = digits_value(raw[1:] if negative else raw, max(abs(lo), abs(hi)))
    if size is None:
        raise ValidationError(f"{name} must be a whole number, got {raw[:40]!r}")
    value = -size if negative else size
    if not lo <= value <= hi:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise ValidationError(f"{name} must be within {lo}..{hi}, got {shown}")
    return value


def text_params(params: Mapping[str, str], allowed: set[str]) -> None:
    for name, value in params.items():
        if name not in allowed:
            raise ValidationError(
                f"unknown parameter {name!r}", hint=f"one of {', '.join(sorted(allowed))}"
            )
        if "\x00" in value:
            raise ValidationError(f"{name} contains a NUL character")


async def _project(keys: KeyRing, headers: Mapping[str, str], named: str | None) -> str:
    project = await keys.read_project(headers, named)
    if project is None:
        raise ValidationError(
            "project is required", front_hint="name it with {project} (ids are per project)"
        )
    return project


async def in_thread(
    state: Services, sql: str | pgsql.SQL, args: dict[str, Any]
) -> list[tuple[Any, ...]]:
    caller = tenant.current()  # threads do not carry context variables
    # A forget by filter may end many versions: the longest budget a request may ask for.
    ms = str(int(state.settings.max_timeout_s * 1000))

    def run() -> list[tuple[Any, ...]]:
        with connect(state.url, autocommit=True) as conn:
            tenant.assert_for_session(conn, caller)
            conn.execute("SELECT set_config('statement_timeout', %s, false)", (ms,))
            return conn.execute(sql, args).fetchall()

    return await asyncio.to_thread(run)


async def forget_nodes(
    state: Services,
    keys: KeyRing,
    headers: Mapping[str, str],
    params: Mapping[str, str],
    external_id: str | None,
    *,
    ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``DELETE /memory/nodes/{id}`` (one node) and ``DELETE /memory/nodes`` (by ids or by
    filter): memory.forget, retire by default, ``erase=true`` for privacy requests. The ids
    of several nodes come comma-separated in ``id`` over HTTP, or as ``ids`` (the MCP tool's
    list, where an id may hold a comma)."""
    text_params(params, _FORGET_PARAMS)
    named = [external_id] if external_id is not None else list(ids or ())
    if any("\x00" in x for x in named):
        raise ValidationError("id contains a NUL character")
    if ids is not None and (external_id is not None or "id" in params):
        raise ValidationError("name the nodes once: one id, or ids")
    project = await _project(keys, headers, params.get("project"))
    await keys.write_projects(headers, {project})
    erase = flag(params, "erase")
    reason = params.get("reason")
    if reason is not None and len(reason) > NOTE_MAX_CHARS:
        # Kept in every version it ends: 9 MB of it made the node's history too large to
        # answer, for good.
        raise ValidationError(
            f"reason is longer than {NOTE_MAX_CHARS} characters",
            hint="say why in a sentence; the versions' end_note keeps it",
        )
    if external_id is not None:
        if set(params) & (_FORGET_FILTERS | {"id", "dry_run", "max_nodes"}):
            raise ValidationError("a node's DELETE takes project, erase and reason only")
        sql = "SELECT memory.forget(%(p)s, %(id)s, erase => %(erase)s, reason => %(reason)s)"
        args: dict[str, Any] = {"p": project, "id": external_id, "erase": erase, "reason": reason}
    else:
        ids_named = ids is not None or "id" in params
        if ids is None:
            ids = [x for x in params.get("id", "").split(",") if x]
        # Ids that name no node ("id=", "id=,", the MCP tool's []; the spec's minLength 1)
        # are refused, not dropped: beside a filter they would have widened the forget to
        # the filter's every node (schemathesis found it).
        if ids_named and not ids:
            raise ValidationError("id must name at least one node (id=a,b)")
        ids = list(ids) or None
        flt = parse_filter(params.get("filter"))
        level = params.get("level")
        if level is not None and level not in LEVELS:
            raise ValidationError(f"level must be one of L0, L1, L2, got {level!r}")
        # An empty value names nothing (the spec's minLength 1): refused, as the contract
        # refuses an empty instant, rather than read as a filter that matches no node.
        for name in ("source", "since", "until"):
            if params.get(name) == "":
                raise ValidationError(f"{name} must not be empty")
        if not ids and not ({k for k in params if k != "filter"} & _FORGET_FILTERS or flt):
            raise ValidationError(
                "name nodes (id=a,b) or a filter (filter, source, level, since, until)",
                # since= matches only the nodes that have a timestamp; every node has a
                # level (derived ones first: their sources' forget would flag them).
                hint="to forget a whole project, forget it a level at a time:"
                " level=L2, then L1, then L0",
            )
        # The bound: the service's (POIMEN_FORGET_MAX_NODES) unless the request names one.
        # memory.forget's max_nodes is an integer: a larger bound is no bound at all
        bound = whole_number(
            params, "max_nodes", state.settings.forget_max_nodes, 1, MAX_FORGET_BOUND
        )
        sql = (
            "SELECT memory.forget(%(p)s, %(ids)s, %(source)s, %(since)s, %(until)s,"
            " %(erase)s, %(reason)s, filter => %(filter)s, level => %(level)s,"
            " dry_run => %(dry_run)s, max_nodes => %(max_nodes)s)"
        )
        args = {
            "p": project, "ids": ids, "source": params.get("source"),
            "since": params.get("since"), "until": params.get("until"),
            "erase": erase, "reason": reason,
            "filter": None if flt is None else Jsonb(flt), "level": level,
            "dry_run": flag(params, "dry_run"), "max_nodes": bound,
        }  # fmt: skip
    with wrap_exceptions("forget"):
        rows = await in_thread(state, sql, args)
    out: dict[str, Any] = rows[0][0]
    return {"project": project, **out}


async def node_history(
    state: Services,
    keys: KeyRing,
    headers: Mapping[str, str],
    params: Mapping[str, str],
    external_id: str,
) -> dict[str, Any]:
    """``GET /memory/nodes/{id}/history``: memory.history, every version oldest first."""
    text_params(params, {"project"})
    if "\x00" in external_id:
        raise ValidationError("id contains a NUL character")
    project = await _project(keys, headers, params.get("project"))
    with wrap_exceptions("history"):
        rows = await in_thread(
            state, "SELECT * FROM memory.history(%(p)s, %(id)s)", {"p": project, "id": external_id}
        )
    versions = []
    for r in rows:
        v = dict(zip(_HISTORY_COLUMNS, r, strict=True))
        for k in ("timestamp", "created_at", "expired_at", "erased_at", "valid_from", "valid_to"):
            v[k] = v[k].isoformat() if v[k] is not None else None
        versions.append(v)
    return {"project": project, "id": external_id, "versions": versions}


async def list_projects(state: Services, keys: KeyRing, headers: Mapping[str, str]) -> list[str]:
    """The projects the caller may read: the key's (every project in anonymous mode), both
    as a filter and under row-level security, as a search's scope (KeyRing.read_scope)."""
    _, projects = await keys.read_scope(headers, None)
    with wrap_exceptions("projects"):
        rows = await in_thread(state, q("project_names"), {"projects": projects})
    return [str(r[0]) for r in rows]


async def project_summary(
    state: Services, keys: KeyRing, headers: Mapping[str, str], project: str
) -> dict[str, Any]:
    """One project's summary: its current nodes per level, the versions that ended and the
    latest write. A project the key does not cover is forbidden (403) before anything is
    read; one that does not exist, or that row-level security hides, is unknown (PM404)."""
    await keys.read_scope(headers, project)  # forbidden unless the key covers it
    with wrap_exceptions("projects"):
        rows = await in_thread(state, q("project_summary"), {"project": project})
    current, ended, latest = rows[0]
    nodes = {level: int(current.get(level, 0)) for level in LEVELS}
    return {
        "project": project,
        "nodes": nodes,
        "total": sum(nodes.values()),
        "ended_versions": int(ended),
        "latest_write": latest.isoformat() if latest is not None else None,
    }
