"""End-to-end GET /memory/query load: the service (create_app under uvicorn) in a child
process on 127.0.0.1, with the local embedder and no reranker; httpx clients in this one."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from poimen_lab.live_server import live_server
from poimen_lab.measures import percentile


async def _load(
    base: str,
    texts: Sequence[str],
    clients: int,
    params: dict[str, str],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    ms: list[float] = []
    errors = 0
    strategies: dict[str, int] = {}
    todo = list(texts)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(
        base_url=base, timeout=60, limits=limits, headers=headers
    ) as client:

        async def worker() -> None:
            nonlocal errors
            while todo:
                text = todo.pop()
                t0 = time.perf_counter()
                resp = await client.get("/memory/query", params={"query": text, **params})
                ms.append((time.perf_counter() - t0) * 1000)
                if resp.status_code != 200:
                    errors += 1
                    continue
                s = resp.json()["search_strategy"]
                strategies[s] = strategies.get(s, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "requests": len(texts),
        "errors": errors,
        "p50_ms": round(percentile(ms, 50), 2),
        "p95_ms": round(percentile(ms, 95), 2),
        "req_per_s": round(len(texts) / wall, 2),
        "strategies": strategies,
    }


def run(
    database_url: str,
    texts: Sequence[str],
    *,
    concurrency: Sequence[int] = (1, 8),
    requests: int = 200,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each concurrency level gets its own unseen query texts (no embedding-cache hits); a
    server of its own per call, so another call may send the same texts."""
    # No evidence list: the in-process reference (bench/inprocess.py) runs no L0 legs, and
    # the ratio compares the same pipeline. What the list costs: eval/evidence_latency.py.
    params = params or {"limit": "10", "evidence": "0"}
    need = 5 + requests * len(concurrency)
    if len(texts) < need:
        raise ValueError(f"need {need} distinct query texts, got {len(texts)}")
    drop = ("POIMEN_RERANK_URL", "POIMEN_OPENSEARCH_URL")
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server(
            {"POIMEN_DATABASE_URL": database_url}, Path(tmp) / "server.log", drop=drop
        ) as base,
    ):
        asyncio.run(_load(base, texts[:5], 1, params, headers))  # warm-up
        out, start = [], 5
        for c in concurrency:
            out.append(
                asyncio.run(_load(base, texts[start : start + requests], c, params, headers))
            )
            start += requests
    return out
