"""End-to-end GET /memory/query load: the service (create_app under uvicorn) in a child
process on 127.0.0.1, with the local embedder and no reranker; the clients are threads in
this process, each with one keep-alive connection (the standard library's http.client).

Not httpx.AsyncClient: on this machine it spends about 5 ms of its own per request (6.6 ms
p50 for the static /openapi.json where http.client and curl take 1.6-2 ms), which a latency
quoted for the service should not include, and it burns the CPU the service shares with it
on two cores. docs/benchmarks.md has the two side by side."""

from __future__ import annotations

import http.client
import json
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from poimen_lab.live_server import live_server
from poimen_lab.measures import percentile


def _load(
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
    lock = threading.Lock()
    where = urlsplit(base)

    def worker() -> None:
        nonlocal errors
        conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=60)
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    text = todo.pop()
                path = "/memory/query?" + urlencode({"query": text, **params})
                t0 = time.perf_counter()
                conn.request("GET", path, headers=headers or {})
                resp = conn.getresponse()
                body = resp.read()
                took = (time.perf_counter() - t0) * 1000
                with lock:
                    ms.append(took)
                    if resp.status != 200:
                        errors += 1
                        continue
                    s = json.loads(body)["search_strategy"]
                    strategies[s] = strategies.get(s, 0) + 1
        finally:
            conn.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
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
        _load(base, texts[:5], 1, params, headers)  # warm-up
        out, start = [], 5
        for c in concurrency:
            out.append(_load(base, texts[start : start + requests], c, params, headers))
            start += requests
    return out
