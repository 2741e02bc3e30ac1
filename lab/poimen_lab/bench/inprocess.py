"""The reference points the HTTP service is held against, measured in this process on the
same corpus: the query pipeline without a service (embed the query, hnswlib top 50, bm25s
top 50, convex fusion to the top 10) and the local embedder alone under concurrency."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from poimen_lab.measures import percentile

CANDIDATES = 50
DENSE_WEIGHT = 0.4  # the policy default (memory.policy())


def _minmax(ids: Sequence[int], scores: Sequence[float]) -> dict[int, float]:
    if not ids:
        return {}
    lo, hi = min(scores), max(scores)
    return {
        i: (1.0 if hi == lo else (s - lo) / (hi - lo)) for i, s in zip(ids, scores, strict=True)
    }


def convex(
    dense: tuple[Sequence[int], Sequence[float]],
    sparse: tuple[Sequence[int], Sequence[float]],
    k: int,
    weight: float = DENSE_WEIGHT,
) -> list[int]:
    """memory.fuse(convex): w*minmax(dense) + (1-w)*minmax(sparse), ties by id."""
    a, b = _minmax(*dense), _minmax(*sparse)
    fused = {i: weight * a.get(i, 0.0) + (1 - weight) * b.get(i, 0.0) for i in a.keys() | b.keys()}
    return [i for i, _ in sorted(fused.items(), key=lambda x: (-x[1], x[0]))[:k]]


def pipeline(
    embed: Callable[[str], Any],
    index: Any,
    bm25: Callable[[Sequence[str], int], tuple[list[int], list[float]]],
    texts: Sequence[str],
    lexemes: Sequence[Sequence[str]],
    *,
    limit: int = 10,
    ef: int = 100,
) -> dict[str, Any]:
    """One client, sequential: the same stages the service runs, with no database, no HTTP,
    no provenance and no JSON (the query lexemes come precomputed, outside the timing)."""
    index.set_ef(max(ef, CANDIDATES))
    ms: list[float] = []
    for text, lx in zip(texts, lexemes, strict=True):
        t0 = time.perf_counter()
        vec = np.asarray(embed(text), dtype=np.float32)
        labels, dist = index.knn_query(vec, k=CANDIDATES, num_threads=1)
        dense = ([int(x) for x in labels[0]], [1.0 - float(d) for d in dist[0]])
        sparse = bm25(lx, CANDIDATES)
        convex(dense, sparse, limit)
        ms.append((time.perf_counter() - t0) * 1000)
    return {
        "queries": len(texts),
        "p50_ms": round(percentile(ms, 50), 3),
        "p95_ms": round(percentile(ms, 95), 3),
    }


def embed_throughput(
    embed: Callable[[str], Any], texts: Sequence[str], clients: int
) -> dict[str, Any]:
    """Queries per second of the embedder alone, `clients` threads each embedding one query
    at a time (as `clients` concurrent requests would), over distinct texts."""
    todo = list(texts)
    with ThreadPoolExecutor(clients) as pool:
        t0, c0 = time.perf_counter(), time.process_time()
        list(pool.map(embed, todo))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "clients": clients,
        "queries": len(todo),
        "queries_per_s": round(len(todo) / wall, 2),
        # this process's CPU (every thread, the runtime's own included) per query
        "cpu_ms": round(cpu * 1000 / len(todo), 2),
    }


def service(
    url: str,
    embedder: Any,
    texts: Sequence[str],
    params: dict[str, str],
    *,
    concurrency: Sequence[int] = (1, 8),
    requests: int = 200,
) -> list[dict[str, Any]]:
    """The service's own query path (``Retriever.query``, what ``GET /memory/query`` awaits
    after parsing and the key check) in this process, with no HTTP, no ASGI and no JSON
    response: the same statements, the same pool, as the role in ``url``, in anonymous
    mode. Beside the HTTP runs it splits the end-to-end latency into what the HTTP layer
    adds and what the database's statements and the embedding take. The texts are those
    ``bench.http.run`` sends (the first 5 warm up, then ``requests`` per concurrency level);
    a fresh embedding cache, as each of its servers has."""
    import asyncio
    import os

    from poimen_lab.bench.http import CPU, summary
    from poimen_memory.contract.query import parse_query
    from poimen_memory.db import tenant
    from poimen_memory.errors import PoimenError
    from poimen_memory.services import open_services
    from poimen_memory.settings import Settings

    settings = Settings.from_env()
    cpu = CPU(os.getpid(), url)  # this process: the service's Python and the embedder

    async def main() -> list[dict[str, Any]]:
        async with open_services(
            settings, url=url, embedder=embedder, rerank=False, wait=True
        ) as svc:
            tenant.assert_for_request(tenant.ALL_PROJECTS)

            async def load(batch: Sequence[str], clients: int) -> dict[str, Any]:
                todo = list(batch)
                ms: list[float] = []
                errors = 0

                async def worker() -> None:
                    nonlocal errors
                    while todo:
                        req = parse_query({"query": todo.pop(), **params}, settings)
                        t0 = time.perf_counter()
                        try:
                            await svc.retriever.query(req)
                        except PoimenError:  # counted, as the HTTP load counts non-200s
                            errors += 1
                        ms.append((time.perf_counter() - t0) * 1000)

                before = cpu.snapshot()
                t0 = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(clients)))
                wall = time.perf_counter() - t0
                return summary(clients, ms, errors, wall, cpu.spent(before, cpu.snapshot()))

            await load(texts[:5], 1)
            out, start = [], 5
            for c in concurrency:
                out.append(await load(texts[start : start + requests], c))
                start += requests
            return out

    return asyncio.run(main())
