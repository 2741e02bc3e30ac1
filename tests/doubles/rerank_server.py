"""A real rerank server for tests, speaking both dialects, run by uvicorn in a thread.

Accepts TEI requests (``{query, texts}``) and Cohere-style ones (``{model,
query, documents, top_n}``) on ``/v1/rerank`` and ``/rerank``. Relevance is
the fraction of the query's words found in the document, in [0, 1], then put
on the configured scale (``unit`` as is, ``percent`` x100, ``logit`` as
``10 * (r - 0.5)``), or taken verbatim from ``scores``. The response shape
(bare array / ``results`` / ``data``), score field name, ``document`` form,
order, delay and failures are knobs, changeable while it runs.

    with run_rerank_server(score_scale="percent") as server:
        client = RerankClient(server.url)
        ...
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from doubles.embedding_server import (
    LoggedRequest,
    ThreadedApp,
    interruptible_sleep,
    log_request,
)

__all__ = [
    "RerankServer",
    "RerankServerKnobs",
    "run_rerank_server",
    "word_overlap",
]


def word_overlap(query: str, document: str) -> float:
    """Share of the query's distinct words that occur in the document."""
    query_words = set(re.findall(r"\w+", query.lower()))
    if not query_words:
        return 0.0
    return len(query_words & set(re.findall(r"\w+", document.lower()))) / len(query_words)


@dataclass
class RerankServerKnobs:
    score_scale: Literal["unit", "percent", "logit"] = "unit"
    scores: list[float] | None = None
    """Raw scores by document index, sent verbatim instead of computed ones."""
    response_shape: Literal["results", "data", "array"] = "results"
    score_field: Literal["relevance_score", "score"] = "relevance_score"
    document_mode: Literal["absent", "string", "object"] = "absent"
    order: Literal["desc", "input", "shuffled"] = "desc"
    honour_top_n: bool = True
    delay_s: float = 0.0
    fail_status: int | None = None
    fail_count: int | None = None
    """How many requests fail with ``fail_status`` before recovering (None: all)."""
    malformed: bool = False
    index_offset: int = 0
    """Added to every returned ``index``, to fake a server that miscounts."""
    api_key: str | None = None
    seed: int = 0


@dataclass
class RerankServer:
    knobs: RerankServerKnobs
    url: str = ""
    requests: list[LoggedRequest] = field(default_factory=list)
    failures_served: int = 0
    closing: threading.Event = field(default_factory=threading.Event)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng.seed(self.knobs.seed)

    def reset(self, **knobs: Any) -> None:
        """Replace all knobs (unnamed ones back to defaults) and forget the request log.

        Lets a module-scoped server serve many tests; requests in flight keep
        the knobs they started with.
        """
        self.knobs = RerankServerKnobs(**knobs)
        self.requests.clear()
        self.failures_served = 0
        self.rng.seed(self.knobs.seed)

    @property
    def endpoint(self) -> str:
        return self.url + "/v1/rerank"

    def dialect_of(self, request: LoggedRequest) -> str:
        body = request.body if isinstance(request.body, dict) else {}
        return "tei" if "texts" in body else "cohere" if "documents" in body else "unknown"

    def raw_score(self, query: str, document: str) -> float:
        relevance = word_overlap(query, document)
        if self.knobs.score_scale == "percent":
            return 100.0 * relevance
        if self.knobs.score_scale == "logit":
            return 10.0 * (relevance - 0.5)
        return relevance


class _LaxJSONResponse(JSONResponse):
    """Lets a test send NaN/Infinity scores, as some Python servers do."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=True, separators=(",", ":")).encode("utf-8")


def _build_app(state: RerankServer) -> Starlette:
    async def rerank(request: Request) -> Response:
        body = await log_request(request, state.requests)
        knobs = state.knobs
        if knobs.delay_s > 0:
            await interruptible_sleep(knobs.delay_s, state.closing)
        if knobs.api_key is not None and (
            request.headers.get("authorization") != f"Bearer {knobs.api_key}"
        ):
            return JSONResponse({"error": "invalid api key"}, status_code=401)
        if knobs.fail_status is not None and (
            knobs.fail_count is None or state.failures_served < knobs.fail_count
        ):
            state.failures_served += 1
            return JSONResponse({"error": "injected failure"}, status_code=knobs.fail_status)
        if knobs.malformed:
            return PlainTextResponse("<html>not json</html>")
        if not isinstance(body, dict) or "query" not in body:
            return JSONResponse({"error": "missing query"}, status_code=422)
        documents = body.get("texts", body.get("documents"))
        if not isinstance(documents, list):
            return JSONResponse({"error": "missing texts/documents"}, status_code=422)
        texts = [d if isinstance(d, str) else str(d.get("text", "")) for d in documents]
        if knobs.scores is not None:
            raw = list(knobs.scores)[: len(texts)]
        else:
            raw = [state.raw_score(str(body["query"]), t) for t in texts]
        items: list[dict[str, Any]] = []
        for index, score in enumerate(raw):
            item: dict[str, Any] = {"index": index + knobs.index_offset, knobs.score_field: score}
            if knobs.document_mode == "string":
                item["document"] = texts[index]
            elif knobs.document_mode == "object":
                item["document"] = {"text": texts[index]}
            items.append(item)
        if knobs.order == "desc":
            items.sort(key=lambda i: -float(i[knobs.score_field]))
        elif knobs.order == "shuffled":
            state.rng.shuffle(items)
        top_n = body.get("top_n")
        if knobs.honour_top_n and isinstance(top_n, int):
            items = sorted(items, key=lambda i: -float(i[knobs.score_field]))[:top_n]
        if knobs.response_shape == "array":
            return _LaxJSONResponse(items)
        extra = {"model": body.get("model"), "usage": {"total_tokens": 0}}
        return _LaxJSONResponse({knobs.response_shape: items, **extra})

    async def not_found(request: Request) -> Response:
        await log_request(request, state.requests)
        return JSONResponse({"error": "not found"}, status_code=404)

    return Starlette(
        routes=[
            Route("/v1/rerank", rerank, methods=["POST"]),
            Route("/rerank", rerank, methods=["POST"]),
            Route("/{path:path}", not_found, methods=["GET", "POST"]),
        ]
    )


@contextmanager
def run_rerank_server(**knobs: Any) -> Iterator[RerankServer]:
    """Start the double with `RerankServerKnobs` fields as keyword arguments."""
    state = RerankServer(knobs=RerankServerKnobs(**knobs))
    server = ThreadedApp(_build_app(state), state.closing)
    server.start()
    state.url = server.url
    try:
        yield state
    finally:
        server.stop()
