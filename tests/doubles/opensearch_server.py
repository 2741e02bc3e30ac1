"""A test double of the OpenSearch REST API, run by uvicorn in a thread.

No OpenSearch server can be installed on the build machines, so the engine is tested
against this: it answers the requests opensearch-py sends for cluster info and health,
index create/exists/delete/refresh, ``_bulk`` (NDJSON, per-item results) and ``_search``
(``bool`` with ``multi_match`` scored by boosted word overlap, ``term``/``terms``
filters). State and knobs are plain attributes, changeable while it runs:

    with run_opensearch_server() as server:
        engine = OpenSearchEngine(server.url, "test")
        server.down = True            # every request gets a 503
        server.fail_next(2, 429)      # the next two requests get a 429
        server.fail_item(sha, 400)    # that document's bulk items fail
        server.delay_s = 1.0          # answer late, to trip client timeouts
        server.search_delay_s = 1.0   # answer searches late (a slow lexical leg), the rest on time
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from doubles.embedding_server import ThreadedApp, interruptible_sleep

__all__ = ["IndexState", "ItemFailure", "OSRequest", "OpenSearchServer", "run_opensearch_server"]

JSON_TYPES = ("application/json", "application/x-ndjson")


@dataclass
class OSRequest:
    method: str
    path: str
    body: Any
    """Parsed JSON; a list of parsed lines for NDJSON; raw text if neither; None if empty."""
    params: dict[str, str]
    headers: dict[str, str]


@dataclass
class ItemFailure:
    status: int
    error_type: str
    times: int | None
    """How many more bulk items for the document fail (None: all of them)."""


@dataclass
class IndexState:
    mappings: dict[str, Any]
    settings: dict[str, Any]
    docs: dict[str, dict[str, Any]] = field(default_factory=dict)


def tokens(text: Any) -> list[str]:
    return re.findall(r"\w+", str(text).lower()) if text is not None else []


def error(status: int, kind: str, reason: str) -> JSONResponse:
    cause = {"type": kind, "reason": reason}
    return JSONResponse({"error": {"root_cause": [cause], **cause}, "status": status}, status)


class OpenSearchServer:
    def __init__(self, version: str = "2.11.0") -> None:
        self.url = ""
        self.version = version
        self.requests: list[OSRequest] = []
        self.indices: dict[str, IndexState] = {}
        self.down = False
        self.delay_s = 0.0
        self.search_delay_s = 0.0
        self.health_status = "green"
        self.item_failures: dict[str, ItemFailure] = {}
        self.closing = threading.Event()
        self._fail_next: list[int] = []

    def fail_next(self, n: int, status: int = 503) -> None:
        self._fail_next.extend([status] * n)

    def fail_item(
        self,
        doc_id: str,
        status: int = 400,
        error_type: str = "mapper_parsing_exception",
        times: int | None = None,
    ) -> None:
        self.item_failures[doc_id] = ItemFailure(status, error_type, times)

    def docs(self, index: str) -> dict[str, dict[str, Any]]:
        return self.indices[index].docs if index in self.indices else {}

    def requests_to(self, suffix: str) -> list[OSRequest]:
        return [r for r in self.requests if r.path.endswith(suffix)]

    # --- request handling -----------------------------------------------------------

    async def _gate(self, request: Request) -> tuple[Any, Response | None]:
        """Log the request, then apply the knobs; a response here short-circuits."""
        raw = (await request.body()).decode("utf-8", "replace")
        body: Any = None
        ndjson = request.url.path.endswith("/_bulk")
        try:
            if ndjson:
                body = [json.loads(line) for line in raw.splitlines() if line.strip()]
            elif raw.strip():
                body = json.loads(raw)
        except ValueError:
            body = raw
        self.requests.append(
            OSRequest(
                request.method,
                request.url.path,
                body,
                dict(request.query_params),
                {k.lower(): v for k, v in request.headers.items()},
            )
        )
        if self.delay_s > 0:
            await interruptible_sleep(self.delay_s, self.closing)
        if self.down:
            return body, error(503, "cluster_block_exception", "injected outage")
        if self._fail_next:
            return body, error(self._fail_next.pop(0), "injected_failure", "fail_next")
        ctype = request.headers.get("content-type", "").split(";")[0].strip()
        if raw and ctype not in JSON_TYPES:
            return body, JSONResponse(
                {"error": f"Content-Type header [{ctype}] is not supported", "status": 406}, 406
            )
        return body, None

    def _index_op(self, index: str, op: str, doc_id: str, source: Any) -> dict[str, Any]:
        item: dict[str, Any] = {"_index": index, "_id": doc_id, "_version": 1}
        failure = self.item_failures.get(doc_id)
        if failure is not None and (failure.times is None or failure.times > 0):
            if failure.times is not None:
                failure.times -= 1
            kind = failure.error_type
            item.update(status=failure.status, error={"type": kind, "reason": "injected"})
            return item
        state = self.indices.setdefault(index, IndexState({}, {}))  # auto-create, like OpenSearch
        if op == "delete":
            found = state.docs.pop(doc_id, None) is not None
            item.update(status=200 if found else 404, result="deleted" if found else "not_found")
            return item
        known = state.mappings.get("properties", {})
        extra = sorted(set(source) - set(known)) if isinstance(source, dict) else []
        if state.mappings.get("dynamic") == "strict" and extra:
            reason = f"mapping set to strict, dynamic introduction of [{extra[0]}] not allowed"
            item.update(
                status=400, error={"type": "strict_dynamic_mapping_exception", "reason": reason}
            )
            return item
        if op == "create" and doc_id in state.docs:
            item.update(
                status=409,
                error={
                    "type": "version_conflict_engine_exception",
                    "reason": "document already exists",
                },
            )
            return item
        created = doc_id not in state.docs
        state.docs[doc_id] = source
        item.update(status=201 if created else 200, result="created" if created else "updated")
        return item

    def bulk(self, lines: list[Any], default_index: str | None) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        it = iter(lines)
        for action in it:
            ((op, meta),) = action.items()
            source = next(it) if op in ("index", "create") else None
            index = meta.get("_index") or default_index
            doc_id = meta.get("_id") or uuid.uuid4().hex
            if index is None:
                item = {
                    "status": 400,
                    "error": {
                        "type": "action_request_validation_exception",
                        "reason": "index is missing",
                    },
                }
            else:
                item = self._index_op(index, op, doc_id, source)
            items.append({op: item})
        return {
            "took": 1,
            "errors": any("error" in next(iter(i.values())) for i in items),
            "items": items,
        }

    def search(self, index: str, body: dict[str, Any], source: bool) -> dict[str, Any]:
        query = body.get("query", {"match_all": {}})
        scored = []
        for doc_id, doc in self.indices[index].docs.items():
            score = _score(query, doc)
            if score is not None:
                scored.append((score, doc_id, doc))
        scored.sort(key=lambda s: (-s[0], s[1]))
        size = int(body.get("size", 10))
        hits = [
            {"_index": index, "_id": i, "_score": s, **({"_source": d} if source else {})}
            for s, i, d in scored[:size]
        ]
        return {
            "took": 1,
            "timed_out": False,
            "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
            "hits": {
                "total": {"value": len(scored), "relation": "eq"},
                "max_score": scored[0][0] if scored else None,
                "hits": hits,
            },
        }


def _matches_filter(clause: dict[str, Any], doc: dict[str, Any]) -> bool:
    ((kind, spec),) = clause.items()
    if kind in ("bool", "multi_match"):
        return _score(clause, doc) is not None
    ((name, wanted),) = spec.items()
    if kind == "term":
        wanted = [wanted["value"] if isinstance(wanted, dict) else wanted]
    elif kind != "terms":
        raise ValueError(f"filter {kind!r} is not supported by the double")
    value = doc.get(name)
    values = value if isinstance(value, list) else [value]
    return any(v in wanted for v in values)


def _field(doc: dict[str, Any], name: str) -> Any:
    # a subfield ("content.exact") reads its field's text: the double does not stem
    return doc.get(name.split(".")[0])


def _phrase(spec: dict[str, Any], doc: dict[str, Any]) -> float:
    """type phrase: the query's tokens in order and adjacent in one of the fields."""
    want = tokens(spec["query"])
    for f in spec.get("fields", ["*"]):
        name = f.partition("^")[0]
        for n in list(doc) if name == "*" else [name]:
            have = tokens(_field(doc, n))
            if want and any(
                have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1)
            ):
                return 1.0
    return 0.0


def _multi_match(spec: dict[str, Any], doc: dict[str, Any]) -> float:
    if spec.get("type") == "phrase":
        return _phrase(spec, doc)
    wanted = set(tokens(spec["query"]))
    score = 0.0
    for f in spec.get("fields", ["*"]):
        name, _, boost = f.partition("^")
        names = list(doc) if name == "*" else [name]
        for n in names:
            score += float(boost or 1) * len(wanted & set(tokens(_field(doc, n))))
    return score


def _score(query: dict[str, Any], doc: dict[str, Any]) -> float | None:
    """The document's score, or None when it does not match."""
    ((kind, spec),) = query.items()
    if kind == "match_all":
        return 1.0
    if kind == "multi_match":
        score = _multi_match(spec, doc)
        return score if score > 0 else None
    if kind != "bool":
        raise ValueError(f"query {kind!r} is not supported by the double")
    if not all(_matches_filter(c, doc) for c in spec.get("filter", [])):
        return None
    if any(_score(c, doc) is not None for c in spec.get("must_not", [])):
        return None
    should = [s for s in (_score(c, doc) for c in spec.get("should", [])) if s is not None]
    if len(should) < int(spec.get("minimum_should_match", 0)):
        return None
    total = sum(should)
    for clause in spec.get("must", []):
        s = _score(clause, doc)
        if s is None:
            return None
        total += s
    return total if spec.get("must") or should else 0.0


def _build_app(state: OpenSearchServer) -> Starlette:
    Handler = Callable[[Request, Any], Awaitable[Response]]

    def gated(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            body, short = await state._gate(request)
            return short if short is not None else await handler(request, body)

        return endpoint

    def missing(index: str) -> JSONResponse:
        return error(404, "index_not_found_exception", f"no such index [{index}]")

    async def info(request: Request, body: Any) -> Response:
        return JSONResponse(
            {
                "name": "double",
                "cluster_name": "poimen-test",
                "cluster_uuid": "double-uuid",
                "version": {
                    "distribution": "opensearch",
                    "number": state.version,
                    "lucene_version": "9.7.0",
                },
                "tagline": "The OpenSearch Project: https://opensearch.org/",
            }
        )

    async def health(request: Request, body: Any) -> Response:
        return JSONResponse(
            {
                "cluster_name": "poimen-test",
                "status": state.health_status,
                "timed_out": False,
                "number_of_nodes": 1,
            }
        )

    async def index(request: Request, body: Any) -> Response:
        name = request.path_params["index"]
        exists = name in state.indices
        if request.method == "HEAD":
            return Response(status_code=200 if exists else 404)
        if request.method == "PUT":
            if exists:
                return error(400, "resource_already_exists_exception", f"[{name}] exists")
            if name != name.lower() or name.startswith(("_", "-")):
                return error(400, "invalid_index_name_exception", f"bad name [{name}]")
            body = body or {}
            state.indices[name] = IndexState(body.get("mappings", {}), body.get("settings", {}))
            return JSONResponse({"acknowledged": True, "shards_acknowledged": True, "index": name})
        if not exists:
            return missing(name)
        if request.method == "DELETE":
            del state.indices[name]
            return JSONResponse({"acknowledged": True})
        s = state.indices[name]
        return JSONResponse({name: {"aliases": {}, "mappings": s.mappings, "settings": s.settings}})

    async def bulk(request: Request, body: Any) -> Response:
        if not isinstance(body, list) or not body:
            return error(400, "parse_exception", "request body is required")
        return JSONResponse(state.bulk(body, request.path_params.get("index")))

    async def refresh(request: Request, body: Any) -> Response:
        name = request.path_params["index"]
        if name not in state.indices:
            return missing(name)
        return JSONResponse({"_shards": {"total": 1, "successful": 1, "failed": 0}})

    async def search(request: Request, body: Any) -> Response:
        name = request.path_params["index"]
        if name not in state.indices:
            return missing(name)
        source = request.query_params.get("_source", "true") != "false"
        if state.search_delay_s > 0:
            await interruptible_sleep(state.search_delay_s, state.closing)
        try:
            return JSONResponse(state.search(name, body or {}, source))
        except (ValueError, KeyError, AttributeError) as exc:
            return error(400, "parsing_exception", str(exc))

    async def get_doc(request: Request, body: Any) -> Response:
        name, doc_id = request.path_params["index"], request.path_params["doc_id"]
        doc = state.docs(name).get(doc_id)
        if doc is None:
            return JSONResponse({"_index": name, "_id": doc_id, "found": False}, 404)
        return JSONResponse({"_index": name, "_id": doc_id, "found": True, "_source": doc})

    async def unknown(request: Request, body: Any) -> Response:
        reason = f"no handler found for uri [{request.url.path}] and method [{request.method}]"
        return JSONResponse({"error": reason, "status": 400}, 400)

    return Starlette(
        routes=[
            Route("/", gated(info), methods=["GET", "HEAD"]),
            Route("/_cluster/health", gated(health), methods=["GET"]),
            Route("/_bulk", gated(bulk), methods=["POST", "PUT"]),
            Route("/{index}", gated(index), methods=["GET", "HEAD", "PUT", "DELETE"]),
            Route("/{index}/_bulk", gated(bulk), methods=["POST", "PUT"]),
            Route("/{index}/_refresh", gated(refresh), methods=["POST", "GET"]),
            Route("/{index}/_search", gated(search), methods=["POST", "GET"]),
            Route("/{index}/_doc/{doc_id}", gated(get_doc), methods=["GET"]),
            Route("/{path:path}", gated(unknown), methods=["GET", "HEAD", "POST", "PUT", "DELETE"]),
        ]
    )


@contextmanager
def run_opensearch_server(version: str = "2.11.0") -> Iterator[OpenSearchServer]:
    state = OpenSearchServer(version)
    server = ThreadedApp(_build_app(state), state.closing)
    server.start()
    state.url = server.url
    try:
        yield state
    finally:
        server.stop()
