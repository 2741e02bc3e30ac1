"""GET /metrics: the Prometheus text format, from one registry per app instance.

What is counted where:

- ``MetricsMiddleware`` (pure ASGI) counts every HTTP request by method, route template
  and status, and times it (``poimen_http_*``);
- ``observe_query`` is called by the query route with the response body it is about to
  send: stage histograms (``poimen_query_stage_duration_seconds``), the strategy actually
  run and the degraded stages. It also hands a summary of the query to the request log
  (``request_log.annotate``), so the log line and the metrics come from the same numbers;
- a collector reads live values at scrape time: the embedding cache's counters, the
  connection pool, and the OpenSearch outbox backlog (one ``count(*)`` per scrape).

The registry is per app (``metrics_for(app)``), never the process-wide default one, so
several apps in one process (tests) keep separate counts. docs/observability.md lists
every metric with an example scrape and PromQL queries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from poimen_memory.api.asgi import HttpMiddleware, StatusRecorder
from poimen_memory.api.request_log import annotate
from poimen_memory.db import tenant
from poimen_memory.db.queries import q

__all__ = ["STAGES", "Metrics", "MetricsMiddleware", "metrics_for", "observe_query", "routes"]

log = logging.getLogger("poimen_memory.metrics")

# The response's metrics keys, by stage label. `total` is the whole pipeline.
STAGES = {
    "embed": "embed_time_ms",
    "lexical": "lexical_time_ms",
    "semantic": "semantic_time_ms",
    "fusion": "fusion_time_ms",
    "rerank": "rerank_time_ms",
    "provenance": "provenance_time_ms",
    "evidence": "evidence_time_ms",
    "total": "total_time_ms",
}

# Seconds. Stages on this corpus take 0.1-30 ms; the deadline caps a request at 30 s.
STAGE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

OUTBOX_TIMEOUT_S = 1.0
OUTBOX_MS = int(OUTBOX_TIMEOUT_S * 1000)


class Metrics:
    """The registry of one app and the metrics in it."""

    def __init__(self, app: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "poimen_http_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "poimen_http_request_duration_seconds",
            "Time from request to the end of the response body, by route template.",
            ["route"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "poimen_query_stage_duration_seconds",
            "GET /memory/query stage durations (stages that did not run are not observed).",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.strategies = Counter(
            "poimen_query_strategy",
            "Answered queries by the strategy actually run (after fallbacks).",
            ["strategy"],
            registry=r,
        )
        self.degraded = Counter(
            "poimen_query_degraded",
            "Degraded stages in answered queries, by stage and reason.",
            ["stage", "reason"],
            registry=r,
        )
        self.live = _LiveCollector(app)
        r.register(self.live)

    def observe_query(self, body: Mapping[str, Any]) -> None:
        metrics = body.get("metrics") or {}
        for stage, key in STAGES.items():
            ms = metrics.get(key)
            # A stage the query skipped (no rerank, LexicalOnly...) is null.
            if isinstance(ms, int | float):
                self.stage_seconds.labels(stage).observe(ms / 1000.0)
        strategy = body.get("search_strategy")
        if strategy:
            self.strategies.labels(str(strategy)).inc()
        for d in body.get("degraded") or ():
            self.degraded.labels(str(d.get("stage")), str(d.get("reason"))).inc()

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        # Any token is a valid HTTP method: an unknown one must not add a label value.
        method = method if method in _METHODS else "other"
        self.requests.labels(method, route, str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _LiveCollector(Collector):
    """Values read at scrape time from the app's services (absent before start-up)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.outbox: int | None = None
        self.database_up: bool | None = None

    def collect(self) -> Iterable[Metric]:
        services = getattr(self.app.state, "poimen", None)
        if services is None:
            return
        cache = services.cache.stats()
        for family, name, key, doc in (
            (CounterMetricFamily, "hits", "hits", "lookups that hit"),
            (CounterMetricFamily, "misses", "misses", "lookups that missed"),
            (CounterMetricFamily, "evictions", "evictions", "entries evicted"),
            (GaugeMetricFamily, "entries", "size", "entries held"),
        ):
            metric = family(f"poimen_embedding_cache_{name}", f"Query-embedding cache {doc}.")
            metric.add_metric([], cache[key])
            yield metric

        stats = services.pool.get_stats()
        pool_size = stats.get("pool_size", 0)
        available = stats.get("pool_available", 0)
        conns = GaugeMetricFamily(
            "poimen_db_pool_connections",
            "Connections held by the pool, by state (in_use: lent to a request).",
            labels=["state"],
        )
        conns.add_metric(["in_use"], max(pool_size - available, 0))
        conns.add_metric(["idle"], available)
        yield conns
        pool_max = GaugeMetricFamily("poimen_db_pool_max", "The pool's maximum size.")
        pool_max.add_metric([], stats.get("pool_max", 0))
        yield pool_max
        waiting = GaugeMetricFamily(
            "poimen_db_pool_requests_waiting", "Requests waiting for a pooled connection."
        )
        waiting.add_metric([], stats.get("requests_waiting", 0))
        yield waiting

        if services.replicas is not None:
            yield from _replica_metrics(services.replicas.report())

        if self.database_up is not None:
            up = GaugeMetricFamily(
                "poimen_database_up", "1 when the scrape's outbox count reached the database."
            )
            up.add_metric([], 1 if self.database_up else 0)
            yield up
        if self.outbox is not None:
            backlog = GaugeMetricFamily(
                "poimen_opensearch_outbox_backlog",
                "Rows in memory.opensearch_outbox not yet synced to OpenSearch.",
            )
            backlog.add_metric([], self.outbox)
            yield backlog

    async def refresh(self) -> None:
        """The values that need the database, read once per scrape with a short timeout."""
        services = getattr(self.app.state, "poimen", None)
        if services is None:
            return
        try:
            async with (
                services.pool.connection(timeout=OUTBOX_TIMEOUT_S) as conn,
                conn.transaction(),
            ):
                await conn.execute(
                    q("begin_request"), {"ms": str(OUTBOX_MS), **tenant.ALL_PROJECTS.params()}
                )
                cur = await conn.execute(q("is_proxy"))
                probe = await cur.fetchone()
                # A proxy database: its partitions' outboxes summed (the reachable ones;
                # docs/opensearch.md#over-a-pl-proxy-proxy).
                proxy = bool(probe and probe[0])
                cur = await conn.execute(q("outbox_depth_proxy" if proxy else "outbox_depth"))
                row = await cur.fetchone()
            self.outbox = int(row[0]) if row else 0
            self.database_up = True
        except Exception as exc:  # a scrape reports the database as down, never fails
            log.warning("metrics: outbox backlog unavailable: %s", type(exc).__name__)
            self.outbox = None
            self.database_up = False


def _replica_metrics(servers: list[dict[str, Any]]) -> Iterable[Metric]:
    """Each read replica's state from the monitor's last check (no extra round trip)."""
    usable = GaugeMetricFamily(
        "poimen_replica_usable",
        "1 when the read replica passed its last check and serves queries.",
        labels=["server"],
    )
    lag = GaugeMetricFamily(
        "poimen_replica_lag_seconds",
        "Read replica lag at its last check (0: replayed all the primary's WAL).",
        labels=["server"],
    )
    for srv in servers:
        usable.add_metric([srv["server"]], 1 if srv["ok"] else 0)
        if srv["lag_s"] is not None:
            lag.add_metric([srv["server"]], srv["lag_s"])
    yield usable
    yield lag


def metrics_for(app: Any) -> Metrics:
    """The app's registry, created on first use."""
    m: Metrics | None = getattr(app.state, "prometheus", None)
    if m is None:
        m = Metrics(app)
        app.state.prometheus = m
    return m


def observe_query(request: Request, body: Mapping[str, Any]) -> None:
    """Called by GET /memory/query with the body it answers: metrics and the log line."""
    metrics_for(request.app).observe_query(body)
    metrics = body.get("metrics") or {}
    annotate(
        request,
        project=body.get("project"),
        strategy=body.get("search_strategy"),
        question_type=(body.get("plan") or {}).get("question_type"),
        results=len(body.get("results") or ()),
        timings_ms={stage: metrics.get(key) for stage, key in STAGES.items() if key in metrics},
        embedding_cache_hit=metrics.get("embedding_cache_hit"),
        served_by=metrics.get("served_by"),
        degraded=[f"{d.get('stage')}:{d.get('reason')}" for d in body.get("degraded") or ()],
    )


async def metrics_endpoint(request: Request) -> Response:
    m = metrics_for(request.app)
    await m.live.refresh()
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware(HttpMiddleware):
    """Counts and times every HTTP request by its route template (never the raw path, so
    unknown URLs cannot blow up the label set: they count as ``unmatched``)."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        recorder = StatusRecorder(send)
        try:
            await self.app(scope, receive, recorder)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            metrics_for(scope["app"]).observe_request(
                scope["method"], route, recorder.status, time.perf_counter() - started
            )


routes = [Route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)]
