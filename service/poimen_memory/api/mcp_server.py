"""The MCP server for agents: tools over the same code path as the HTTP API (docs/mcp.md).

- ``memory_query`` answers exactly what ``GET /memory/query`` answers for the same
  parameters (the same names, schemas and bounds: api/openapi.py's query_parameters, then
  api/params.py), with provenance and the evidence list;
- ``memory_add`` writes nodes as ``POST /memory/nodes`` does: one transaction, every node or
  none unless ``skip_invalid``;
- ``memory_get`` answers what ``GET /memory/nodes/{id}`` answers (a node of a project the key
  does not cover is not found, as a missing one); ``memory_history`` what
  ``GET /memory/nodes/{id}/history`` answers;
- ``memory_forget`` retires (or erases) nodes by id as ``DELETE /memory/nodes/{id}`` (one id)
  and ``DELETE /memory/nodes?id=...`` (several) do: a write, so a read-only key is refused;
- the projects the caller may read are resources, ``poimen://projects/{name}`` (a template
  too): each one's summary, its current nodes per level and its latest write. Listed and
  read under row-level security with the key's projects, as the tools search; a project the
  key does not cover is a typed error (JSON-RPC invalid params whose data is the HTTP error
  body), never its data.

All run api/operations.py (and api/nodes.py), the functions the HTTP routes run, with the
caller's API key from the transport's headers: the key's projects, read-only keys, the
deadline and the typed errors are the HTTP API's. A typed error comes back as a tool error
(``isError: true``) whose structured content is the HTTP error body plus ``status`` and,
when the database raised it, ``sqlstate``. The reads' answers are held to the HTTP routes'
byte budget by the routes' own check (operations.bounded_json).

Two transports, built on the official SDK's low-level ``Server`` (``MCPServer`` would
reconfigure the process's root logger):

- streamable HTTP at ``POST /mcp`` inside the service (`McpEndpoint`): stateless, JSON
  responses, behind the same API keys (a request without a valid key is refused 401 before
  the MCP layer reads it), bodies capped at POIMEN_MAX_BODY_BYTES;
- stdio, ``poimen-memory mcp`` (`serve_stdio`): the key, when keys exist, comes from
  POIMEN_API_KEY.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ListResourcesResult,
    ListResourceTemplatesResult,
    ListToolsResult,
    PaginatedRequestParams,
    ReadResourceRequestParams,
    ReadResourceResult,
    Resource,
    ResourceTemplate,
    TextContent,
    TextResourceContents,
    Tool,
    ToolAnnotations,
)
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from poimen_core.vocabulary import FILTER_MAX_BYTES, LEVELS, PROJECT_NAME_RE
from poimen_memory.api import metrics
from poimen_memory.api.auth import KeyRing
from poimen_memory.api.body import media_type, read_body, replay
from poimen_memory.api.nodes import get_node, list_nodes
from poimen_memory.api.openapi import openapi_spec, query_parameters
from poimen_memory.api.operations import (
    bounded_json,
    forget_nodes,
    list_projects,
    node_history,
    project_summary,
    query_memory,
    records_from_lines,
    write_nodes,
)
from poimen_memory.api.review import claim_items, confirm_item, list_items
from poimen_memory.contract.query import filter_text
from poimen_memory.db.wrap import translate
from poimen_memory.embedders.base import Embedder
from poimen_memory.errors import PoimenError, UnsupportedMediaType, ValidationError
from poimen_memory.ingest.nodes import LineError, NodeRecord, RepeatedKey, unique_object
from poimen_memory.services import Services, open_services
from poimen_memory.settings import Settings

__all__ = [
    "PROJECT_URI",
    "TOOLS",
    "Caller",
    "McpEndpoint",
    "build_server",
    "serve_stdio",
    "tools",
]

log = logging.getLogger(__name__)

QUERY, ADD, GET, FORGET, HISTORY, LIST = (
    "memory_query", "memory_add", "memory_get", "memory_forget", "memory_history",
    "memory_list",
)  # fmt: skip
# The review queue (issue 40, api/review.py).
REVIEW_LIST, REVIEW_CLAIM, REVIEW_CONFIRM = (
    "memory_review_list", "memory_review_claim", "memory_review_confirm",
)  # fmt: skip
TOOLS = (QUERY, ADD, GET, FORGET, HISTORY, LIST, REVIEW_LIST, REVIEW_CLAIM, REVIEW_CONFIRM)
# The tools that read, whose answers are held to the HTTP routes' byte budget (a claim
# hands out texts as a read does; what it changed is only the items' visibility).
READS = frozenset({QUERY, GET, HISTORY, LIST, REVIEW_LIST, REVIEW_CLAIM})
# A project as a resource: its summary (api/operations.py project_summary).
PROJECT_URI = "poimen://projects/{name}"
_PROJECT_PREFIX = PROJECT_URI.removesuffix("{name}")
JSON = "application/json"


@dataclass(frozen=True)
class Caller:
    """Who is calling, and what serves them: the services, the key ring, the headers the
    key is read from, and (over HTTP) the hook that counts an answered query."""

    services: Services
    keys: KeyRing
    headers: Mapping[str, str]
    observe: Callable[[Mapping[str, Any]], None] | None = None


def _schemas() -> dict[str, Any]:
    """The OpenAPI components, as JSON Schema ``$defs`` an MCP schema can refer to."""
    text = json.dumps(openapi_spec()["components"]["schemas"])
    defs: dict[str, Any] = json.loads(text.replace("#/components/schemas/", "#/$defs/"))
    return defs


# A metadata filter as a model's tool call sends it, an object, or (as the tools took it
# first, and as the query string carries it) its JSON text.
def _filter_argument(description: str) -> dict[str, Any]:
    return {
        "anyOf": [
            {"type": "object"},
            {"type": "string", "maxLength": FILTER_MAX_BYTES},
        ],
        "description": description
        + ' An object, e.g. {"user": "42"} (its JSON text is accepted too).',
    }


_LEVELS_ITEMS = {"type": "string", "enum": list(LEVELS)}


def _query_input(settings: Settings) -> dict[str, Any]:
    props: dict[str, Any] = {}
    # With the bounds this service applies (POIMEN_MAX_QUERY_CHARS, ...), as /openapi.json.
    params = query_parameters(settings)
    for name, _, schema, description in params:
        props[name] = {**copy.deepcopy(schema), "description": description}
    # What a model sends: levels a list, filter an object; the string forms stay accepted.
    comma = {k: v for k, v in props["level"].items() if k != "description"}
    props["level"] = {
        "anyOf": [
            comma,
            {"type": "array", "items": _LEVELS_ITEMS, "minItems": 1, "maxItems": 3},
        ],
        "description": 'The levels to search: a list, e.g. ["L1", "L2"] (the default), or '
        'the comma-separated string "L1,L2".',
    }
    props["levels"] = {
        "type": "array",
        "items": _LEVELS_ITEMS,
        "minItems": 1,
        "maxItems": 3,
        "description": "The same as level, by its plural name (name one of the two).",
    }
    props["filter"] = _filter_argument(props["filter"]["description"])
    props["compact"] = {
        "type": "boolean",
        "default": False,
        "description": "A small answer for a small context window: per result its id, "
        "level, text, support and the ids of the L0 turns it cites (`cites`); the evidence "
        "as id and text; nothing else (docs/mcp.md says how much smaller).",
    }
    required = [name for name, req, _, _ in params if req]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def _add_input() -> dict[str, Any]:
    node = copy.deepcopy(_schemas()["Node"])
    # `project` below names the project of nodes that name none.
    node["required"] = [r for r in node["required"] if r != "project"]
    return {
        "type": "object",
        "properties": {
            "nodes": {
                "type": "array",
                "minItems": 1,
                "items": node,
                "description": "The nodes, as in POST /memory/nodes (docs/ingest.md). One call "
                "is one transaction: every node is written, or none.",
            },
            "project": {
                **_schemas()["Node"]["properties"]["project"],
                "description": "The project of nodes that name none.",
            },
            "skip_invalid": {
                "type": "boolean",
                "default": False,
                "description": "Write the valid nodes and list the invalid ones in the report "
                "(an error when none is valid).",
            },
        },
        "required": ["nodes"],
        "additionalProperties": False,
    }


# What the server checks before a call (the node fields are checked by the ingest code, as
# for POST /memory/nodes, so that skip_invalid can skip them).
def _add_checked() -> dict[str, Any]:
    schema = _add_input()
    schema["properties"]["nodes"]["items"] = {"type": "object"}
    return schema


def _parameters(spec: Mapping[str, Any], path: str, method: str) -> dict[str, Any]:
    """An HTTP operation's parameters (/openapi.json's), by name: their schemas and words."""
    return {p["name"]: p for p in spec[path][method]["parameters"]}


def _argument(parameter: Mapping[str, Any], description: str | None = None) -> dict[str, Any]:
    return {
        **copy.deepcopy(parameter["schema"]),
        "description": description or parameter["description"],
    }


def _get_input(spec: Mapping[str, Any]) -> dict[str, Any]:
    """memory_get's and memory_history's arguments: GET /memory/nodes/{id}'s parameters."""
    params = _parameters(spec, "/memory/nodes/{id}", "get")
    return {
        "type": "object",
        "properties": {
            "id": _argument(params["id"], "The node's id: the id given at ingest (external_id)."),
            "project": _argument(params["project"]),
        },
        "required": ["id"],
        "additionalProperties": False,
    }


def _history_input(spec: Mapping[str, Any]) -> dict[str, Any]:
    params = _parameters(spec, "/memory/nodes/{id}/history", "get")
    schema = _get_input(spec)
    schema["properties"]["project"] = _argument(
        params["project"],
        "The node's project; may be left out when the API key covers one project "
        "(invalid_parameter otherwise: ids are per project).",
    )
    return schema


def _forget_input(spec: Mapping[str, Any]) -> dict[str, Any]:
    """memory_forget's arguments: DELETE /memory/nodes/{id}'s, with several ids as a list
    (DELETE /memory/nodes?id=...), erase a boolean, and DELETE /memory/nodes' filters with
    the metadata filter an object and dry_run a boolean."""
    one = _parameters(spec, "/memory/nodes/{id}", "delete")
    many = _parameters(spec, "/memory/nodes", "delete")
    ids = _parameters(spec, "/memory/nodes/{id}", "get")["id"]["schema"]
    return {
        "type": "object",
        "properties": {
            "ids": {
                "type": "array",
                "minItems": 1,
                "items": copy.deepcopy(ids),
                "description": "The nodes' ids (external_id). One id: unknown_node (404) "
                "when it has no current version; several: those without one are not in the "
                "report's `nodes`.",
            },
            "project": _argument(
                one["project"],
                "The nodes' project; may be left out when the API key covers one project "
                "(invalid_parameter otherwise: ids are per project).",
            ),
            "erase": {
                "type": "boolean",
                "default": False,
                "description": one["erase"]["description"],
            },
            "reason": _argument(one["reason"]),
            "filter": _filter_argument(
                "Forget the nodes whose metadata contains this (JSON containment)."
            ),
            "source": _argument(many["source"]),
            "level": _argument(many["level"]),
            "since": _argument(many["since"]),
            "until": _argument(many["until"]),
            "dry_run": {
                "type": "boolean",
                "default": False,
                "description": "Answer what would be forgotten (`matched`, `nodes`) and "
                "write nothing; the same call without it then forgets exactly those, if "
                "nothing changed in between.",
            },
            "max_nodes": _argument(many["max_nodes"]),
        },
        # ids, or a filter (filter, source, level, since, until): invalid_parameter
        # names what is missing.
        "additionalProperties": False,
    }


def _review_inputs(spec: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The review tools' arguments: the HTTP routes' parameters and JSON bodies."""
    listed = _parameters(spec, "/memory/review", "get")
    claim = spec["/memory/review/claim"]["post"]["requestBody"]["content"][JSON]["schema"]
    confirm = spec["/memory/review/{item}/confirm"]["post"]
    item = {p["name"]: p for p in confirm["parameters"]}["item"]
    return {
        REVIEW_LIST: {
            "type": "object",
            "properties": {n: copy.deepcopy(p["schema"]) for n, p in listed.items()},
            "additionalProperties": False,
        },
        REVIEW_CLAIM: copy.deepcopy(claim),
        REVIEW_CONFIRM: {
            "type": "object",
            "properties": {
                "item": {
                    **copy.deepcopy(item["schema"]),
                    "description": "The item_id memory_review_claim (or _list) gave.",
                },
                **copy.deepcopy(confirm["requestBody"]["content"][JSON]["schema"]["properties"]),
            },
            "required": ["item"],
            "additionalProperties": False,
        },
    }


def _list_input(spec: Mapping[str, Any]) -> dict[str, Any]:
    """memory_list's arguments: GET /memory/nodes' parameters, the filter an object, the
    flags booleans and the cursor named as MCP names its own."""
    params = _parameters(spec, "/memory/nodes", "get")
    props = {
        name: _argument(params[name])
        for name in ("project", "level", "source", "since", "until", "limit")
    }
    props["filter"] = _filter_argument(params["filter"]["description"])
    props["newest_first"] = {
        "type": "boolean",
        "default": False,
        "description": "true: the latest writes first (what was remembered recently).",
    }
    props["count"] = {
        "type": "boolean",
        "default": False,
        "description": "true: the answer also has count, the nodes of every page together.",
    }
    props["cursor"] = {
        "type": "string",
        "description": "The next_cursor of the previous page (pass the same filters and "
        "order); none for the first page.",
    }
    return {"type": "object", "properties": props, "additionalProperties": False}


def _output(name: str) -> dict[str, Any]:
    defs = _schemas()
    return {**defs[name], "$defs": defs}


# memory_query's answer with compact: true (compact_answer).
_COMPACT: dict[str, Any] = {
    "type": "object",
    "required": ["compact", "results", "evidence"],
    "properties": {
        "compact": {"const": True},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": ["string", "null"]},
                    "level": {"type": ["string", "null"]},
                    "text": {"type": ["string", "null"]},
                    "support": {"type": ["string", "null"]},
                    "cites": {"type": "array", "items": {"type": ["string", "null"]}},
                },
            },
        },
        "evidence": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": ["string", "null"]},
                    "text": {"type": ["string", "null"]},
                },
            },
        },
    },
}


def _query_output() -> dict[str, Any]:
    """The full answer (QueryResponse) or, with compact: true, the compact one."""
    defs = {**_schemas(), "CompactQueryResponse": _COMPACT}
    return {
        "type": "object",
        "anyOf": [
            {"$ref": "#/$defs/QueryResponse"},
            {"$ref": "#/$defs/CompactQueryResponse"},
        ],
        "$defs": defs,
    }


def compact_answer(body: Mapping[str, Any]) -> dict[str, Any]:
    """A query's answer cut to what a small context window needs: per result its id,
    level, text, support and the external ids of the evidence turns that cite it (an
    evidence turn's cited_by lists the ranks of the results whose provenance reaches it);
    the evidence as id and text."""
    evidence = list(body.get("evidence") or [])
    results = [
        {
            "id": r.get("external_id"),
            "level": r.get("level"),
            "text": r.get("text"),
            "support": r.get("support"),
            # cited_by counts results from 1, in the answer's order
            "cites": [e.get("external_id") for e in evidence if rank in (e.get("cited_by") or ())],
        }
        for rank, r in enumerate(body.get("results") or [], start=1)
    ]
    return {
        "compact": True,
        "results": results,
        "evidence": [{"id": e.get("external_id"), "text": e.get("text")} for e in evidence],
    }


def tools(settings: Settings) -> list[Tool]:
    spec = openapi_spec(settings)["paths"]
    review = _review_inputs(spec)
    return [
        Tool(
            name=QUERY,
            title="Search memory",
            description=(
                "Search memory: the best L1/L2 memories for a question, each with its "
                "provenance down to the L0 turns it derives from, and `evidence`, the L0 turns "
                "the answer cites. The same answer as GET /memory/query with these parameters. "
                + spec["/memory/query"]["get"]["summary"]
                + "."
            ),
            input_schema=_query_input(settings),
            output_schema=_query_output(),
            annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
        Tool(
            name=ADD,
            title="Remember",
            description=(
                "Write memory nodes (L0 turns, L1 memories, L2 syntheses) with their "
                "provenance (`parents`: ids one level down), as POST /memory/nodes does. "
                "Idempotent: a node whose content is stored already counts as a duplicate."
            ),
            input_schema=_add_input(),
            output_schema=_output("IngestReport"),
            annotations=ToolAnnotations(
                read_only_hint=False,
                destructive_hint=False,
                idempotent_hint=True,
                open_world_hint=False,
            ),
        ),
        Tool(
            name=GET,
            title="Fetch a memory by id",
            description=(
                "One node by its id, as GET /memory/nodes/{id}: its text, metadata, "
                "support, parents (provenance, one level down) and children. A node of a "
                "project the API key does not cover is unknown_node, as a missing one; an id "
                "in several projects is ambiguous_node: name the project."
            ),
            input_schema=_get_input(spec),
            output_schema=_output("NodeDetail"),
            annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
        Tool(
            name=FORGET,
            title="Forget",
            description=(
                "Forget nodes by id, as DELETE /memory/nodes/{id} (one id) and DELETE "
                "/memory/nodes?id=... (several) do, or by filter (metadata `filter`, "
                "source, level, since/until), as DELETE /memory/nodes?filter=... does: "
                "retire by default (gone from answers, kept in their history), or with "
                "erase every version's content is destroyed (privacy requests; a tombstone "
                "stays). dry_run answers what would be forgotten and writes nothing; more "
                "than max_nodes (default 1000) is too_many_nodes, nothing forgotten. Derived "
                "nodes left without support are flagged, or ended too under the "
                "forget_derived = cascade policy. Needs a key made with --write."
            ),
            input_schema=_forget_input(spec),
            output_schema=_output("ForgetReport"),
            annotations=ToolAnnotations(
                read_only_hint=False,
                destructive_hint=True,
                idempotent_hint=False,
                open_world_hint=False,
            ),
        ),
        Tool(
            name=LIST,
            title="Browse memory",
            description=(
                "List nodes without a question, as GET /memory/nodes: the latest writes "
                "first (newest_first) or in write order, by project, level, source, "
                'since/until and metadata (`filter`, an object: "everything about user '
                "42\"), a page at a time (limit, then the answer's next_cursor as cursor); "
                "count: true also counts every page. Expired and forgotten nodes are not "
                "listed."
            ),
            input_schema=_list_input(spec),
            output_schema=_output("NodePage"),
            annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
        Tool(
            name=HISTORY,
            title="A memory's history",
            description=(
                "Every version of a node, oldest first, as GET /memory/nodes/{id}/history: "
                "its revisions, which one is current, and how each ended (superseded, "
                "retired, erased), by whom and why."
            ),
            input_schema=_history_input(spec),
            output_schema=_output("History"),
            annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
        Tool(
            name=REVIEW_LIST,
            title="Memories in doubt",
            description=(
                "The open review items, oldest first, as GET /memory/review: derived "
                "memories whose evidence was rewritten, retired or erased since they were "
                "written (reason, changes), each with its text and its parents' texts then "
                "and now. Paged: after = the last item_id."
            ),
            input_schema=review[REVIEW_LIST],
            output_schema=_output("ReviewPage"),
            annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
        Tool(
            name=REVIEW_CLAIM,
            title="Take review work",
            description=(
                "Claim up to `limit` review items (L1 before L2, oldest first), hidden from "
                "other workers for `visibility_timeout` seconds, as POST /memory/review/claim. "
                "For each: read the memory and its parents then and now, and either write a "
                "new version of the memory with memory_add (same id, its parents named: "
                "that completes the item) or, if the claim still holds, "
                "memory_review_confirm. An item not finished in time comes back."
            ),
            input_schema=review[REVIEW_CLAIM],
            output_schema=_output("ReviewPage"),
            annotations=ToolAnnotations(
                read_only_hint=False,
                destructive_hint=False,
                idempotent_hint=False,
                open_world_hint=False,
            ),
        ),
        Tool(
            name=REVIEW_CONFIRM,
            title="Confirm a memory",
            description=(
                "Complete a review item: the memory's claim still holds against its parents' "
                "current versions, as POST /memory/review/{item}/confirm. It rests on them "
                "from now on; `note` says why. review_conflict while a parent is itself in "
                "doubt (review that one first)."
            ),
            input_schema=review[REVIEW_CONFIRM],
            output_schema=_output("ReviewDone"),
            annotations=ToolAnnotations(
                read_only_hint=False,
                destructive_hint=False,
                idempotent_hint=False,
                open_world_hint=False,
            ),
        ),
    ]


_MAX_ECHO = 300  # characters of an invalid argument's message


def _check(validator: Draft202012Validator, args: Mapping[str, Any]) -> None:
    error = best_match(validator.iter_errors(dict(args)))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "arguments"
        # jsonschema's message quotes the value whole: a 1 MB list was a 2 MB answer
        said = error.message
        if len(said) > _MAX_ECHO:
            said = said[:_MAX_ECHO] + f"... ({len(said)} characters)"
        raise ValidationError(f"{where}: {said}")


def _as_param(value: Any) -> str:
    """A tool argument as the query string would carry it."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _records(nodes: list[Any], project: str | None) -> tuple[list[NodeRecord], list[LineError]]:
    """The nodes as the HTTP route reads a JSON array: one line each, then the same parser
    (10 MB of them takes most of a second: the caller runs this off the event loop)."""
    return records_from_lines([json.dumps(n) for n in nodes], project)


def _tool_error(err: PoimenError) -> CallToolResult:
    body: dict[str, Any] = {**err.public_json("mcp"), "status": err.http_status}
    if err.sqlstate:
        body["sqlstate"] = err.sqlstate
    hint = body.get("hint")
    text = f"{body['error']}: {body['detail']}" + (f" (hint: {hint})" if hint else "")
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=body, is_error=True
    )


def _resource_error(err: PoimenError) -> MCPError:
    """A typed error of resources/read or resources/list: JSON-RPC invalid params (what the
    MCP specification names for a resource that cannot be read), its data the HTTP API's
    error body plus ``status`` and ``sqlstate``, as a tool error's structured content."""
    data: dict[str, Any] = {**err.public_json("mcp"), "status": err.http_status}
    if err.sqlstate:
        data["sqlstate"] = err.sqlstate
    return MCPError(code=INVALID_PARAMS, message=f"{data['error']}: {data['detail']}", data=data)


def _cursor(name: str) -> str:
    """resources/list's opaque cursor: the last name of the page, URL-safe base64."""
    return base64.urlsafe_b64encode(name.encode("utf-8")).decode("ascii")


def _after(cursor: str | None) -> str | None:
    """The name a cursor of _cursor's continues after; a malformed one is a typed
    invalid_parameter (a well-formed one is a position in the sorted names, whoever made it:
    it grants nothing, list_projects decides what the caller sees)."""
    if cursor is None:
        return None
    try:
        return base64.urlsafe_b64decode(cursor.encode("ascii")).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeError):
        raise ValidationError(
            f"cursor {cursor[:40]!r} is not one resources/list returned",
            hint="pass the nextCursor of the previous page, or none for the first",
        ) from None


def _project_resource(name: str) -> Resource:
    return Resource(
        uri=_PROJECT_PREFIX + name,
        name=name,
        title=f"Project {name}",
        description=f"Project {name}: its current nodes per level and its latest write.",
        mime_type=JSON,
    )


def _project_of(uri: str) -> str:
    name = uri.removeprefix(_PROJECT_PREFIX)
    if not uri.startswith(_PROJECT_PREFIX) or not PROJECT_NAME_RE.fullmatch(name):
        raise ValidationError(
            f"unknown resource {uri!r}",
            hint=f"a project's resource is {PROJECT_URI} (resources/list names them)",
        )
    return name


def _answer(body: dict[str, Any], text: str | None = None) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text or json.dumps(body, default=str))],
        structured_content=body,
    )


def _strings(args: Mapping[str, Any], *names: str) -> dict[str, str]:
    """These arguments as an HTTP request's query parameters (the absent ones left out)."""
    return {n: _as_param(args[n]) for n in names if args.get(n) is not None}


async def _query(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    # The contract takes the arguments as they came (objects, lists, numbers), as it takes
    # the query string's text; levels is level's plural name.
    if args.get("level") is not None and args.get("levels") is not None:
        raise ValidationError("name the levels once: level or levels")
    if not isinstance(args.get("compact", False), bool):  # the tool's own argument
        raise ValidationError(f"compact must be true or false, got {json.dumps(args['compact'])}")
    query = {
        ("level" if k == "levels" else k): v
        for k, v in args.items()
        if v is not None and k != "compact"
    }
    body = await query_memory(who.services, who.keys, who.headers, query)
    if who.observe is not None:
        who.observe(body)
    return compact_answer(body) if args.get("compact") else body


async def _list(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    params = _strings(args, "project", "level", "source", "since", "until", "limit")
    if args.get("filter") is not None:
        params["filter"] = filter_text(args["filter"])
    if args.get("cursor") is not None:
        params["after"] = args["cursor"]
    for flag in ("newest_first", "count"):
        params[flag] = "true" if args.get(flag) else "false"
    return await list_nodes(who.services, who.keys, who.headers, params)


async def _add(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    # As POST /memory/nodes: the key before the body is looked at.
    await who.keys.write_projects(who.headers, ())
    records, invalid = await asyncio.to_thread(_records, args["nodes"], args.get("project"))
    return await write_nodes(
        who.services, who.keys, who.headers, records, invalid,
        skip_invalid=bool(args.get("skip_invalid", False)),
    )  # fmt: skip


async def _get(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    return await get_node(
        who.services, who.keys, who.headers, args["id"], _strings(args, "project")
    )


async def _forget(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    params = _strings(args, "project", "reason")
    params["erase"] = "true" if args.get("erase") else "false"
    scoped = _strings(args, "source", "level", "since", "until", "max_nodes")
    if args.get("filter") is not None:
        scoped["filter"] = filter_text(args["filter"])
    if args.get("dry_run"):
        scoped["dry_run"] = "true"
    ids: list[str] | None = args.get("ids")
    if ids is None and not scoped.keys() - {"dry_run", "max_nodes"}:
        raise ValidationError(
            "name nodes (ids) or a filter (filter, source, level, since, until)",
            hint='e.g. {"filter": {"user": "42"}, "dry_run": true} to see what it matches',
        )
    if ids is not None and len(ids) == 1 and not scoped:
        # DELETE /memory/nodes/{id}: unknown_node when it has no current version
        return await forget_nodes(who.services, who.keys, who.headers, params, ids[0])
    return await forget_nodes(who.services, who.keys, who.headers, params | scoped, None, ids=ids)


async def _history(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    return await node_history(
        who.services, who.keys, who.headers, _strings(args, "project"), args["id"]
    )


async def _review_list(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    return await list_items(who.services, who.keys, who.headers, _strings(args, *args))


async def _review_claim(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    return await claim_items(who.services, who.keys, who.headers, _strings(args, *args))


async def _review_confirm(who: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    params = _strings(args, "note")
    return await confirm_item(who.services, who.keys, who.headers, params, str(args["item"]))


def build_server(settings: Settings, caller: Callable[[Any], Caller]) -> Server[Any]:
    """The MCP server; ``caller`` finds, from the SDK's request context, who calls."""
    listed = tools(settings)
    # What the server checks before a call, and what the call runs.
    checks = {
        t.name: Draft202012Validator(_add_checked() if t.name == ADD else t.input_schema)
        for t in listed
    }
    runs: dict[str, Callable[[Caller, Mapping[str, Any]], Awaitable[dict[str, Any]]]] = {
        QUERY: _query, ADD: _add, GET: _get, FORGET: _forget, HISTORY: _history,
        LIST: _list,
        REVIEW_LIST: _review_list, REVIEW_CLAIM: _review_claim, REVIEW_CONFIRM: _review_confirm,
    }  # fmt: skip

    async def list_tools(ctx: Any, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: CallToolRequestParams) -> CallToolResult:
        if params.name not in checks:
            raise MCPError(code=INVALID_PARAMS, message=f"unknown tool {params.name!r}")
        args = params.arguments or {}
        who = caller(ctx)
        try:
            if params.name != QUERY:
                # memory_query's arguments are the contract's to check (parse_query), so an
                # out-of-range one reads as over HTTP, and in SQL's words.
                _check(checks[params.name], args)
            body = await runs[params.name](who, args)
            # A read's answer within POIMEN_HTTP_MAX_RESPONSE_BYTES, counted as the HTTP
            # route counts it (a write's report is not refused: the write is done).
            text = (
                bounded_json(who.services.settings, body, history=params.name == HISTORY)
                if params.name in READS
                else None
            )
        except PoimenError as err:
            return _tool_error(err)
        except psycopg.Error as exc:
            return _tool_error(translate(exc))
        return _answer(body, text.decode("utf-8") if text is not None else None)

    async def list_resources(
        ctx: Any, params: PaginatedRequestParams | None
    ) -> ListResourcesResult:
        who = caller(ctx)
        try:
            after = _after(params.cursor if params else None)
            names = await list_projects(who.services, who.keys, who.headers)
        except PoimenError as err:
            raise _resource_error(err) from None
        except psycopg.Error as exc:
            raise _resource_error(translate(exc)) from None
        # Keyset pages over the sorted names: a project made or dropped between two pages
        # moves no other one to another page.
        rest = sorted(n for n in names if after is None or n > after)
        page = rest[: who.services.settings.mcp_page_size]
        more = len(rest) > len(page)
        return ListResourcesResult(
            resources=[_project_resource(n) for n in page],
            next_cursor=_cursor(page[-1]) if more else None,
        )

    async def list_resource_templates(
        ctx: Any, params: PaginatedRequestParams | None
    ) -> ListResourceTemplatesResult:
        return ListResourceTemplatesResult(
            resource_templates=[
                ResourceTemplate(
                    uri_template=PROJECT_URI,
                    name="project",
                    title="A project",
                    description="A project's summary: its current nodes per level and its "
                    "latest write (a project the API key covers).",
                    mime_type=JSON,
                )
            ]
        )

    async def read_resource(ctx: Any, params: ReadResourceRequestParams) -> ReadResourceResult:
        who = caller(ctx)
        try:
            body = await project_summary(
                who.services, who.keys, who.headers, _project_of(params.uri)
            )
        except PoimenError as err:
            raise _resource_error(err) from None
        except psycopg.Error as exc:
            raise _resource_error(translate(exc)) from None
        return ReadResourceResult(
            contents=[TextResourceContents(uri=params.uri, mime_type=JSON, text=json.dumps(body))]
        )

    return Server(
        "poimen-memory",
        version=openapi_spec()["info"]["version"],
        title="poimen-memory",
        instructions=(
            "Long-term memory. memory_query searches it (results with provenance and the L0 "
            "evidence they cite); memory_add writes nodes; memory_get fetches one by id, "
            "memory_history lists its versions; memory_forget retires or erases nodes. The "
            "projects are resources, poimen://projects/{name}: each one's nodes per level "
            "and latest write."
        ),
        get_tool_input_schema=lambda name: next(
            (t.input_schema for t in listed if t.name == name), None
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_resource_templates,
        on_read_resource=read_resource,
    )


def _http_caller(ctx: Any) -> Caller:
    request = ctx.request
    if not isinstance(request, Request):  # only the HTTP endpoint serves this server
        raise MCPError(code=INVALID_PARAMS, message="no HTTP request for this call")
    app = request.app
    return Caller(
        app.state.poimen,
        app.state.keys,
        request.headers,
        lambda body: metrics.observe_query(request, body),
    )


async def _invalid_request(body: bytes) -> str | None:
    """Why the body is no request JSON-RPC may take, for the two cases the SDK gets wrong: a
    key repeated in one of its objects, or a request (a method and an id) whose id is not a
    string or an integer. None otherwise, a body that is not JSON included (the SDK answers
    that). A large body is read off the event loop."""

    def scan() -> str | None:
        try:
            doc = json.loads(body, object_pairs_hook=unique_object)
        except RepeatedKey as exc:
            return str(exc)
        except (ValueError, RecursionError):
            return None  # not JSON, or nested past the parser: the SDK's to answer
        if isinstance(doc, dict) and "method" in doc and "id" in doc:
            ident = doc["id"]
            # MCP's ids are strings or integers, never null. The SDK took a request with any
            # other id for a notification: 202 and no answer (nor its tool run), so the
            # client waited out its own timeout.
            if isinstance(ident, bool) or not isinstance(ident, str | int):
                return f"a request's id is a string or an integer, not {json.dumps(ident)[:40]}"
        return None

    # A Python hook per object: about 0.4 s a MB of small objects, so not on the loop
    return await asyncio.to_thread(scan) if len(body) > 16384 else scan()


class McpEndpoint:
    """``POST /mcp``: the SDK's streamable HTTP transport, stateless with JSON responses,
    behind the service's API keys. `run` is entered in the app's lifespan."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.server = build_server(settings, _http_caller)
        hosts, origins = settings.mcp_allowed_hosts, settings.mcp_allowed_origins
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            json_response=True,
            stateless=True,
            max_request_body_size=settings.max_body_bytes,
            # Host and Origin checked against DNS rebinding (hosts "*": not checked).
            security_settings=TransportSecuritySettings(
                enable_dns_rebinding_protection=hosts != ("*",),
                allowed_hosts=list(hosts),
                allowed_origins=list(origins),
            ),
        )

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            # Refused here, before the SDK reads the body; each tool checks the key's
            # projects again for what it does.
            await request.app.state.keys.grant(request.headers)
            if scope["method"] == "POST":
                # JSON only, as MCP's HTTP transport sends it: the SDK answered any other type
                # with a 400 in bare text, and a form or text/plain is what a page of another
                # origin posts without a preflight (415 and the error body, as a node write).
                kind = media_type(request)
                if kind != "application/json":
                    raise UnsupportedMediaType(
                        "an MCP request's body must be application/json, got "
                        f"{kind[:100] or 'no content type'!r}",
                        hint="send the JSON-RPC message with Content-Type: application/json",
                    )
                # A media type's case means nothing (RFC 9110), but the SDK compares it with
                # "application/json" as written: it gets the type so (JSON is UTF-8 anyway).
                scope["headers"] = [
                    (name, b"application/json" if name == b"content-type" else value)
                    for name, value in scope["headers"]
                ]
                # The body within the service's size and time budget, as every route reads
                # one: the SDK waits for a body as long as it takes, so a client trickling
                # one held a work slot (and, a few of them, every tenant's) for minutes.
                body = await read_body(
                    request, self.settings.max_body_bytes, self.settings.http_body_timeout_s,
                    hint="POIMEN_MAX_BODY_BYTES sets the limit",
                )  # fmt: skip
                receive = replay(body, receive)
                invalid = await _invalid_request(body)
                if invalid is not None:
                    # The SDK, like json, keeps a repeated key's last value: a body naming
                    # "name" twice ran the second tool while a gateway or a log that reads
                    # the first saw another. Refused as JSON-RPC's invalid request, as is an
                    # id of another type (_invalid_request).
                    error = {"code": -32600, "message": f"Invalid request: {invalid}"}
                    await JSONResponse(
                        {"jsonrpc": "2.0", "id": None, "error": error}, status_code=400
                    )(scope, receive, send)
                    return
        except (PoimenError, psycopg.Error) as exc:
            err = exc if isinstance(exc, PoimenError) else translate(exc)
            await JSONResponse(
                err.public_json(), status_code=err.http_status, headers=err.response_headers()
            )(scope, receive, send)
            return
        await self.manager.handle_request(scope, receive, send)


async def serve_stdio(
    settings: Settings, *, api_key: str | None = None, embedder: Embedder | None = None
) -> None:
    """``poimen-memory mcp``: the MCP server on this process's stdin and stdout."""
    async with open_services(settings, embedder=embedder, check_rls=True) as services:
        keys = KeyRing(services.lender, settings.auth_cache_s, settings.default_timeout_s)
        who = Caller(services, keys, {"authorization": f"Bearer {api_key}"} if api_key else {})
        server = build_server(settings, lambda ctx: who)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
