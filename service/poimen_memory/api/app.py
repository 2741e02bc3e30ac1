"""The HTTP layer: validation, JSON errors, and the shared clients built in the lifespan.
Everything retrieval-related happens in retrieval.py and in SQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from poimen_memory.api import metrics, nodes, review, ui
from poimen_memory.api.admission import Admission, arrived
from poimen_memory.api.asgi import HeadLimit, HostCheck, LastResort, SecurityHeaders
from poimen_memory.api.auth import KeyRing
from poimen_memory.api.body import media_type, read_body
from poimen_memory.api.health import HealthCache
from poimen_memory.api.mcp_route import McpRoute
from poimen_memory.api.openapi import openapi_spec
from poimen_memory.api.operations import (
    bounded_json,
    forget_nodes,
    node_history,
    query_memory,
    records_from_lines,
    write_nodes,
)
from poimen_memory.api.request_log import RequestLogMiddleware
from poimen_memory.db.wrap import translate
from poimen_memory.embedders.base import Embedder
from poimen_memory.errors import PoimenError, UnsupportedMediaType, ValidationError
from poimen_memory.ingest.nodes import MAX_JSON_DEPTH, LineError, NodeRecord, loads
from poimen_memory.services import Services, open_services
from poimen_memory.settings import Settings

log = logging.getLogger("poimen_memory")


def _error(err: PoimenError, retry_after_s: int) -> JSONResponse:
    # Every 503 (busy, a timeout, the database or an upstream down) says when to try again.
    headers = err.response_headers()
    if err.http_status == 503:
        headers["Retry-After"] = str(retry_after_s)
    body = err.public_json("http")
    return JSONResponse(body, status_code=err.http_status, headers=headers)


# Routes raise; these turn typed and database errors into the one JSON error shape. Starlette
# picks the handler by the exception's MRO, so OperationalError wins over psycopg.Error.
async def _poimen_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PoimenError)
    return _error(exc, request.app.state.retry_after_s)


async def _db_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, psycopg.Error)
    return _error(translate(exc), request.app.state.retry_after_s)


def _bounded(request: Request, body: Any, *, history: bool = False) -> Response:
    """A read's answer, within the response byte budget (POIMEN_HTTP_MAX_RESPONSE_BYTES):
    operations.bounded_json, as the MCP tools check theirs."""
    encoded = bounded_json(request.app.state.poimen.settings, body, history=history)
    return Response(encoded, media_type="application/json")


def _once(request: Request) -> dict[str, str]:
    """The query string's parameters, each given once, for every route that reads them: a
    second value would be dropped in silence (Starlette's ``get`` keeps the last), so it is
    refused by name. ``dry_run=true&dry_run=false`` forgot for real before."""
    items = request.query_params.multi_items()
    params = dict(items)
    if len(params) < len(items):
        twice = sorted({k for k, _ in items if request.query_params.getlist(k)[1:]})
        raise ValidationError(f"{', '.join(twice)} given more than once", hint="give each once")
    return params


async def memory_query(request: Request) -> Response:
    state: Services = request.app.state.poimen
    body = await query_memory(
        state, request.app.state.keys, request.headers, _once(request),
        arrived=arrived(request.scope),
    )  # fmt: skip
    metrics.observe_query(request, body)
    return _bounded(request, body)


def _parse_body(raw: bytes, project: str | None) -> tuple[list[NodeRecord], list[LineError]]:
    try:
        body = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"body is not UTF-8 (byte {exc.start})") from exc
    stripped = body.lstrip()
    if stripped.startswith("["):
        try:
            items = loads(stripped, MAX_JSON_DEPTH + 1)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"body is not valid JSON: {exc.msg}") from exc
        except ValueError as exc:
            raise ValidationError(f"body is not valid JSON: {exc}") from exc
        lines = [json.dumps(i) for i in items] if isinstance(items, list) else []
    else:
        # Only newlines end an NDJSON line: JSON strings may hold U+2028, U+0085, ...
        lines = [line.removesuffix("\r") for line in body.split("\n")]
    return records_from_lines(lines, project)


# The bodies an HTML form (or a fetch without a preflight) can send across origins: a
# write in one of them is refused, so a write always comes with a type that a browser
# preflights (application/json, application/x-ndjson), or from a client that is no browser.
_SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def _typed_body(request: Request) -> None:
    kind = media_type(request)
    if kind in _SIMPLE_TYPES:
        raise UnsupportedMediaType(
            f"a write's body must be application/json or application/x-ndjson, got {kind!r}",
            hint="send the nodes with Content-Type: application/json (an array) or "
            "application/x-ndjson (a node a line)",
        )


async def post_nodes(request: Request) -> JSONResponse:
    """Ingest JSON nodes (an array, or NDJSON) through the same code as the CLI, as one
    transaction: every node is written, or none is."""
    state: Services = request.app.state.poimen
    keys = request.app.state.keys
    # The key first: an unauthenticated body is never read, let alone parsed.
    await keys.write_projects(request.headers, ())
    _typed_body(request)
    params = _once(request)
    raw = await read_body(
        request, state.settings.max_body_bytes, state.settings.http_body_timeout_s
    )
    skip = params.get("skip_invalid", "false")
    if skip not in ("true", "false"):
        raise ValidationError(f"skip_invalid must be true or false, got {skip!r}")
    skip_invalid = skip == "true"
    # Parsing 10 MB takes most of a second: not on the event loop.
    records, invalid = await asyncio.to_thread(_parse_body, raw, params.get("project"))
    report = await write_nodes(
        state, keys, request.headers, records, invalid, skip_invalid=skip_invalid
    )
    return JSONResponse(report, status_code=201)


async def nodes_route(request: Request) -> Response:
    handler = {"GET": list_nodes, "DELETE": delete_nodes}.get(request.method, post_nodes)
    return await handler(request)


def _whole_path(route: Route) -> Route:
    """The route matched against the whole path, newlines included. Starlette compiles
    {id:path} to `.*` before `$`: `.` stops at a newline and `$` also matches before a final
    one, so /memory/nodes/a%0A answered for node "a" and /memory/nodes/%0A read an empty id,
    while an external id may hold any character but NUL (found by schemathesis)."""
    pattern = route.path_regex.pattern
    assert pattern.endswith("$"), pattern
    route.path_regex = re.compile(pattern.removesuffix("$") + r"\Z", re.DOTALL)
    return route


async def node_route(request: Request) -> Response:
    return await (delete_node if request.method == "DELETE" else get_node)(request)


async def get_node(request: Request) -> Response:
    """One node by its id (memory.get_node), with its parents, children and support."""
    body = await nodes.get_node(
        request.app.state.poimen,
        request.app.state.keys,
        request.headers,
        request.path_params["id"],
        _once(request),
    )
    return _bounded(request, body)


async def list_nodes(request: Request) -> Response:
    """A page of nodes (memory.list_nodes), keyset paged by an opaque cursor."""
    body = await nodes.list_nodes(
        request.app.state.poimen, request.app.state.keys, request.headers, _once(request)
    )
    return _bounded(request, body)


# The id a node operation takes: a node's (str), or none where it may act on several.
_Id = TypeVar("_Id", bound=str | None)


async def _node_operation(
    request: Request,
    operation: Callable[
        [Services, KeyRing, Mapping[str, str], Mapping[str, str], _Id],
        Awaitable[dict[str, Any]],
    ],
    external_id: _Id,
) -> JSONResponse:
    """One of the node operations (api/operations.py) on this request's key and parameters."""
    body = await operation(
        request.app.state.poimen, request.app.state.keys, request.headers,
        _once(request), external_id,
    )  # fmt: skip
    return JSONResponse(body)


async def delete_node(request: Request) -> JSONResponse:
    """Retire (or, with erase=true, erase) one node: memory.forget."""
    external_id = request.path_params["id"]
    if external_id.endswith("/history"):
        # This path names the history of another id (GET): a history is not deleted, and
        # a node whose id ends in /history is named by DELETE /memory/nodes?id= instead.
        raise HTTPException(
            405,
            "DELETE /memory/nodes/{id}/history: a history cannot be deleted; "
            "DELETE /memory/nodes?id=<id>&project=<project> names any id",
            headers={"Allow": "GET"},
        )
    return await _node_operation(request, forget_nodes, external_id)


async def delete_nodes(request: Request) -> JSONResponse:
    """Retire (or erase) a project's nodes by ids or by filter: memory.forget."""
    return await _node_operation(request, forget_nodes, None)


async def get_history(request: Request) -> Response:
    """Every version of one node, oldest first: memory.history, within the byte budget."""
    body = await node_history(
        request.app.state.poimen, request.app.state.keys, request.headers,
        _once(request), request.path_params["id"],
    )  # fmt: skip
    return _bounded(request, body, history=True)


# A review request's JSON body: a few parameters and a note of at most 2000 characters,
# each up to 12 bytes as JSON escapes (a surrogate pair), so an over-long note is a 400
# naming it rather than a 413.
MAX_PARAMS_BODY = 32768


async def _json_params(request: Request, types: Mapping[str, type]) -> dict[str, str]:
    """The parameters of a POST that changes state and writes no nodes, as a JSON object of
    scalars. application/json only: a browser sends it from another origin only after a
    CORS preflight, which this service never grants, so no web page can post one.

    A query string is refused by name, before the body is read: these routes read none, so
    ``POST /memory/review/claim?project=a`` claimed the items of every project the key may
    write, the project taken by no one."""
    given = sorted({k for k, _ in request.query_params.multi_items()})
    if given:
        raise ValidationError(
            f"{', '.join(given)[:200]} given in the query string; this route reads its "
            "parameters from the JSON body only",
            hint='send them as a JSON object, e.g. {"project": "p"}, with '
            "Content-Type: application/json",
        )
    kind = media_type(request)
    state: Services = request.app.state.poimen
    raw = await read_body(request, MAX_PARAMS_BODY, state.settings.http_body_timeout_s)
    if not raw:
        return {}  # no body: every parameter takes its default
    if kind != "application/json":
        raise ValidationError(
            f"the body must be application/json, got {kind or 'no content type'!r}",
            hint='send a JSON object, e.g. {"project": "p"}, with Content-Type: application/json',
        )
    try:
        body = loads(raw.decode("utf-8"), 2)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValidationError(f"body is not a JSON object: {exc}") from exc
    if not isinstance(body, dict):
        raise ValidationError("body must be a JSON object of parameters")
    out: dict[str, str] = {}
    for name, value in body.items():
        want = types.get(name, str)  # an unknown name is refused by the operation, by name
        if want is int and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # JSON Schema's integer: 333.0 is one
        if isinstance(value, bool) or not isinstance(value, want):
            kind = "a whole number" if want is int else "a string"
            raise ValidationError(f"{name} must be {kind}, got {json.dumps(value)[:40]}")
        out[name] = str(value)
    return out


async def review_list(request: Request) -> Response:
    """The open review items, oldest first (memory.review_list)."""
    body = await review.list_items(
        request.app.state.poimen, request.app.state.keys, request.headers, _once(request)
    )
    return _bounded(request, body)


async def review_claim(request: Request) -> Response:
    """Claim ready review items for a visibility timeout (memory.review_claim)."""
    await request.app.state.keys.write_projects(request.headers, ())  # before the body
    params = await _json_params(request, {"project": str, "limit": int, "visibility_timeout": int})
    body = await review.claim_items(
        request.app.state.poimen, request.app.state.keys, request.headers, params
    )
    return _bounded(request, body)


async def review_confirm(request: Request) -> JSONResponse:
    """Complete a review item: the claim holds against the current parents."""
    await request.app.state.keys.write_projects(request.headers, ())  # before the body
    params = await _json_params(request, {"note": str})
    body = await review.confirm_item(
        request.app.state.poimen, request.app.state.keys, request.headers, params,
        request.path_params["item"],
    )  # fmt: skip
    return JSONResponse(body)


async def healthz(request: Request) -> JSONResponse:
    body, status = await request.app.state.health.get(request.app.state.poimen)
    return JSONResponse(body, status_code=status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Unknown routes and wrong methods answer in the same JSON shape as every other error."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse({"error": code, "detail": str(exc.detail)}, status_code=exc.status_code,
                        headers=exc.headers)  # fmt: skip


async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(openapi_spec(request.app.state.settings))


def create_app(settings: Settings | None = None, *, embedder: Embedder | None = None) -> Starlette:
    cfg = settings or Settings.from_env()
    mcp = McpRoute(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The server checks its pools' roles; the CLI and the lab connect as the owner.
        async with open_services(cfg, embedder=embedder, check_rls=True) as services:
            app.state.poimen = services
            app.state.health = HealthCache(cfg.health_cache_s)
            app.state.keys = KeyRing(services.lender, cfg.auth_cache_s, cfg.default_timeout_s)
            async with mcp.run():
                yield

    app = Starlette(
        exception_handlers={
            PoimenError: _poimen_error,
            psycopg.Error: _db_error,
            HTTPException: _http_error,
        },
        routes=[
            Route("/memory/query", memory_query, methods=["GET"]),
            # One route per path, so that a 405 lists every method the path has.
            Route("/memory/nodes", nodes_route, methods=["GET", "POST", "DELETE"]),
            # Before /memory/nodes/{id}: an id may hold a slash (ingest accepts any string).
            _whole_path(Route("/memory/nodes/{id:path}/history", get_history, methods=["GET"])),
            _whole_path(Route("/memory/nodes/{id:path}", node_route, methods=["GET", "DELETE"])),
            # The review queue (api/review.py, docs/lifecycle.md).
            Route("/memory/review", review_list, methods=["GET"]),
            Route("/memory/review/claim", review_claim, methods=["POST"]),
            Route("/memory/review/{item}/confirm", review_confirm, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            # The MCP endpoint for agents (api/mcp_server.py, loaded at its first request by
            # api/mcp_route.py; docs/mcp.md).
            Route("/mcp", mcp, methods=["POST"]),
            *metrics.routes,
            *ui.routes,
        ],
        middleware=[
            Middleware(RequestLogMiddleware, log_query_text=cfg.log_query_text),
            Middleware(metrics.MetricsMiddleware),
            Middleware(SecurityHeaders),
            # Inside the log and the metrics, so they record the status it answers.
            Middleware(LastResort),
            # A head over the limit, then a request for another Host (DNS rebinding),
            # are refused before they queue.
            Middleware(HeadLimit, max_bytes=cfg.http_max_header_bytes),
            Middleware(
                HostCheck,
                lists=(cfg.http_allowed_hosts, cfg.http_allowed_origins + cfg.http_cors_origins),
                by_path={"/mcp": (cfg.mcp_allowed_hosts, cfg.mcp_allowed_origins)},
            ),
            # CORS only for the origins listed (none by default: a page of another origin
            # can neither read an answer nor send a preflighted request).
            *(
                [
                    Middleware(
                        CORSMiddleware,
                        allow_origins=list(cfg.http_cors_origins),
                        allow_methods=["GET", "POST", "DELETE"],
                        allow_headers=["authorization", "content-type"],
                    )
                ]
                if cfg.http_cors_origins
                else []
            ),
            Middleware(
                Admission,
                max_inflight=cfg.http_max_inflight,
                queue=cfg.http_queue,
                wait_s=cfg.http_queue_wait_s,
                retry_after_s=cfg.http_retry_after_s,
                client_inflight=cfg.http_client_inflight,
                client_rate=cfg.http_client_rate,
                client_burst=cfg.http_client_burst,
                cost=cfg.http_cost,
                fair_share=cfg.http_fair_share,
                fair_floor=cfg.http_fair_floor,
                fair_window_s=cfg.http_fair_window_s,
            ),
        ],
        lifespan=lifespan,
    )
    # Read by the error handlers, which may run before the lifespan (a 503 at start-up).
    app.state.retry_after_s = cfg.http_retry_after_s
    app.state.settings = cfg
    return app
