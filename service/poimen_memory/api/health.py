"""GET /healthz: each dependency probed for real (a tiny embed, a tiny rerank, OpenSearch's
health, one SQL statement), concurrently and with short timeouts, and the result cached for
POIMEN_HEALTH_CACHE_S so a busy prober cannot load the upstreams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import psycopg
from psycopg.rows import dict_row

from poimen_core.openai_embed import shown_url
from poimen_memory.db import tenant
from poimen_memory.db.queries import q
from poimen_memory.errors import UpstreamUnavailable, from_sqlstate
from poimen_memory.services import Services

PROBE_TIMEOUT_S = 1.0


async def _database(svc: Services) -> dict[str, Any]:
    try:
        async with asyncio.timeout(2 * PROBE_TIMEOUT_S):
            async with (
                svc.pool.connection() as conn,
                conn.transaction(),
                conn.cursor(row_factory=dict_row) as cur,
            ):
                # The totals of every project, as before row-level security.
                await cur.execute(
                    q("begin_request"),
                    {"ms": str(int(PROBE_TIMEOUT_S * 1000)), **tenant.ALL_PROJECTS.params()},
                )
                await cur.execute(q("is_proxy"))
                probe = await cur.fetchone()
                proxy = bool(probe and probe["proxy"])
                await cur.execute(q("health_proxy" if proxy else "health"))
                row = await cur.fetchone()
    except psycopg.Error as exc:
        # The API's own code and hint (errors.SQLSTATE_TABLE), as a query would answer:
        # not_migrated says which command fixes it.
        err = from_sqlstate(exc.sqlstate, str(exc))
        return {"ok": False, "error": err.code, "sqlstate": exc.sqlstate, "hint": err.hint}
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__}
    assert row is not None
    lag = row["outbox_lag_s"]
    out: dict[str, Any] = {
        "ok": True,
        "nodes": row["nodes"],
        "embedding_model": row["embedding_model"],
        "outbox": {"depth": row["outbox_depth"], "lag_s": float(lag) if lag else 0.0},
        # memory.scale_warnings(): counted only; `poimen-memory migrate --check` lists them
        "scale_warnings": row["scale_warnings"],
    }
    if proxy:
        # A proxy database (docs/scaling.md#the-http-service-over-the-proxy): its totals are
        # the reachable partitions', and those out of reach are named. Still ok: the other
        # partitions' projects are served (a balancer must not take the service out).
        out["partitions"] = {"count": row["partitions"], "missing": list(row["missing"])}
    return out


async def _call(out: dict[str, Any], call: Awaitable[object]) -> dict[str, Any]:
    """One real request to an upstream: ok, or the error's tag and message."""
    try:
        await call
    except UpstreamUnavailable as exc:
        return {**out, "ok": False, "error": exc.tag, "detail": str(exc)}
    return {**out, "ok": True}


async def _embedder(svc: Services) -> dict[str, Any]:
    if svc.embedder is None:
        return {"ok": False, "error": "not_configured"}
    out = {"model": svc.embedder.model_name, "dim": svc.embedder.dim}
    return await _call(out, svc.embedder.aembed_query("health check", PROBE_TIMEOUT_S))


async def _reranker(svc: Services) -> dict[str, Any]:
    if svc.reranker is None:
        return {"ok": None, "status": "not_configured"}
    probe = svc.reranker.arerank("health check", ["health check"], timeout=PROBE_TIMEOUT_S)
    return await _call({"endpoint": shown_url(svc.reranker.endpoint)}, probe)


async def _opensearch(svc: Services) -> dict[str, Any]:
    if svc.opensearch is None:
        return {"ok": None, "status": "not_configured"}
    healthy = await asyncio.to_thread(svc.opensearch.healthy, PROBE_TIMEOUT_S)
    return {"ok": healthy}


def _replicas(svc: Services) -> dict[str, Any]:
    """Each read replica's lag and state from the monitor's last check (it runs every
    POIMEN_REPLICA_CHECK_S, so this costs no extra round trip)."""
    if svc.replicas is None:
        return {"ok": None, "status": "not_configured"}
    servers = svc.replicas.report()
    return {
        "ok": all(s["ok"] for s in servers),
        "max_lag_s": svc.replicas.max_lag_s,
        "servers": servers,
    }


async def probe(svc: Services) -> tuple[dict[str, Any], int]:
    database, embedder, reranker, opensearch = await asyncio.gather(
        _database(svc), _embedder(svc), _reranker(svc), _opensearch(svc)
    )
    stored = database.get("embedding_model")
    if svc.embedder and stored and stored != svc.embedder.model_name:
        # Same dimension but another model would give meaningless cosine scores.
        embedder.update(ok=False, error="model_mismatch", database_model=stored)
    checks = {
        "database": database,
        "embedder": embedder,
        "reranker": reranker,
        "opensearch": opensearch,
        "replicas": _replicas(svc),
        "embedding_cache": svc.cache.stats(),
    }
    engines = {
        "lexical": "opensearch"
        if opensearch.get("ok")
        else ("postgres-bm25" if svc.settings.pg_lexical else None),
        "semantic": "hnsw" if embedder.get("ok") else None,
        "rerank": "remote" if reranker.get("ok") else None,
    }
    down = sorted(k for k, v in checks.items() if isinstance(v, dict) and v.get("ok") is False)
    status = "ok" if not down else ("down" if not database["ok"] else "degraded")
    body = {
        "status": status,
        "down": down,
        "checks": checks,
        "engines": engines,
        # Not a failed check (status stays ok): e.g. a pool whose role skips row-level security.
        "warnings": list(svc.warnings),
    }
    return body, 200 if database["ok"] else 503


class HealthCache:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._at = -1e9
        self._value: tuple[dict[str, Any], int] | None = None
        self._lock = asyncio.Lock()

    async def get(self, svc: Services) -> tuple[dict[str, Any], int]:
        async with self._lock:
            if self._value is None or time.monotonic() - self._at >= self.ttl_s:
                self._value = await probe(svc)
                self._at = time.monotonic()
            body, status = self._value
        return {**body, "age_s": round(time.monotonic() - self._at, 3)}, status
