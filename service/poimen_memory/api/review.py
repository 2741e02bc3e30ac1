"""The review queue over HTTP and MCP (issue 40): ``GET /memory/review``,
``POST /memory/review/claim``, ``POST /memory/review/{item}/confirm`` and the MCP tools
``memory_review`` and ``memory_review_confirm``. The database does the work
(memory.review_list, memory.review_claim, memory.review_confirm: sql/074_review.sql); this
checks the key and the parameters and runs one statement under the key's projects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from poimen_core.vocabulary import NOTE_MAX_CHARS
from poimen_memory.api.auth import KeyRing
from poimen_memory.api.nodes import project_param
from poimen_memory.api.numbers import digits_value
from poimen_memory.api.operations import in_thread, text_params, whole_number
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.errors import ValidationError
from poimen_memory.services import Services

__all__ = ["CLAIM_DEFAULTS", "claim_items", "confirm_item", "list_items"]

_COLUMNS = (
    "item_id", "project", "node_id", "external_id", "level", "reason", "changes",
    "enqueued_at", "vt", "claims", "claimed_by", "text", "parents",
)  # fmt: skip
# A claim's defaults, as memory.review_claim's: one item, hidden from other workers for 300 s.
CLAIM_DEFAULTS = {"limit": 1, "visibility_timeout": 300}


def _items(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        item = dict(zip(_COLUMNS, r, strict=True))
        for k in ("enqueued_at", "vt"):
            item[k] = item[k].isoformat()
        out.append(item)
    return out


async def list_items(
    state: Services, keys: KeyRing, headers: Mapping[str, str], params: Mapping[str, str]
) -> dict[str, Any]:
    """``GET /memory/review``: the open items, oldest first, a page at a time (``after``:
    the last item_id of the previous page; ``next_after``: null on the last page)."""
    text_params(params, {"project", "limit", "after"})
    project, _ = await keys.read_scope(headers, project_param(params))
    limit = whole_number(params, "limit", 50, 1, 100)
    after = whole_number(params, "after", 0, 0, 2**62)
    with wrap_exceptions("review"):
        rows = await in_thread(
            state,
            "SELECT * FROM memory.review_list(%(p)s, %(n)s, %(after)s)",
            {"p": project, "n": limit, "after": after or None},
        )
    items = _items(rows)
    return {
        "project": project,
        "items": items,
        "next_after": items[-1]["item_id"] if len(items) == limit else None,
    }


async def claim_items(
    state: Services, keys: KeyRing, headers: Mapping[str, str], params: Mapping[str, str]
) -> dict[str, Any]:
    """``POST /memory/review/claim``: up to ``limit`` ready items, hidden from other workers
    for ``visibility_timeout`` seconds (an unfinished item comes back then)."""
    text_params(params, {"project", "limit", "visibility_timeout"})
    project = await keys.read_project(headers, project_param(params))
    await keys.write_projects(headers, {project} if project else set())
    limit = whole_number(params, "limit", CLAIM_DEFAULTS["limit"], 1, 100)
    timeout = whole_number(
        params, "visibility_timeout", CLAIM_DEFAULTS["visibility_timeout"], 1, 86400
    )
    with wrap_exceptions("review"):
        rows = await in_thread(
            state,
            "SELECT * FROM memory.review_claim(%(p)s, %(n)s, %(vt)s)",
            {"p": project, "n": limit, "vt": timeout},
        )
    return {"project": project, "items": _items(rows)}


async def confirm_item(
    state: Services,
    keys: KeyRing,
    headers: Mapping[str, str],
    params: Mapping[str, str],
    item_id: str,
) -> dict[str, Any]:
    """``POST /memory/review/{item}/confirm``: the node's claim still holds against its
    current parents (memory.review_confirm); ``note`` says why (at most 2000 characters)."""
    text_params(params, {"note"})
    item = digits_value(item_id, 2**62)
    if item is None or not 0 < item < 2**62:
        raise ValidationError(f"a review item id is a positive whole number, got {item_id[:40]!r}")
    note = params.get("note")
    if note is not None and len(note) > NOTE_MAX_CHARS:
        raise ValidationError(f"note is longer than {NOTE_MAX_CHARS} characters")
    # Read-only keys are refused here; row-level security keeps a writer to its projects
    # (another project's item is as unknown as one that never existed).
    await keys.write_projects(headers, set())
    with wrap_exceptions("review"):
        rows = await in_thread(
            state,
            "SELECT memory.review_confirm(%(id)s, %(note)s)",
            {"id": item, "note": note},
        )
    out: dict[str, Any] = rows[0][0]
    return out
