"""What a search and a write do once a transport has read the request: the one code path
behind ``GET /memory/query`` and ``POST /memory/nodes`` and the MCP tools ``memory_query``
and ``memory_add`` (api/mcp_server.py). Each takes the caller's headers for the API key, so
the key's projects, the parameter bounds, the deadline and the typed errors are the same
whichever way the request came."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from poimen_memory.api.auth import KeyRing
from poimen_memory.api.params import parse_query
from poimen_memory.db import tenant
from poimen_memory.db.connect import connect
from poimen_memory.errors import Busy, IngestError, ValidationError
from poimen_memory.ingest.nodes import LineError, NodeRecord, parse_lines
from poimen_memory.ingest.writer import ingest
from poimen_memory.services import Services

__all__ = ["query_memory", "records_from_lines", "write_nodes"]


async def query_memory(
    state: Services,
    keys: KeyRing,
    headers: Mapping[str, str],
    params: Mapping[str, str],
    *,
    arrived: float | None = None,
) -> dict[str, Any]:
    """The GET /memory/query answer for these query parameters (as strings, as in a URL).
    The deadline counts from ``arrived`` (time.monotonic()) when given: time queued counts."""
    req = parse_query(params, state.settings)
    req = replace(req, project=await keys.read_project(headers, req.project))
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
    is written, or none is. The caller checked the key once before reading the body; this
    checks it covers, for writing, every project the nodes name."""
    await keys.write_projects(headers, {r.project for r in records})
    if state.embedder is None:
        raise ValidationError("no embedder configured; cannot ingest")
    embedder = state.embedder
    caller = tenant.current()  # run_in_executor does not carry context variables

    def run() -> dict[str, Any]:
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
