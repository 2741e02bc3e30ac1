"""What the evidence list costs the default path, side by side: the same questions through
the service's pipeline (``Retriever.query``, what GET /memory/query runs) with evidence off
(``evidence=0``, the seed's response) and at the policy's budget, alternating which goes
first, no embedding cache. Prints p50/p95 of each and the ratio of the p50s.

    python -m poimen_lab.eval.evidence_latency --url URL --data ../shared/data/locomo-dev

The database must hold the data set already (``poimen-memory eval`` loads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory.retrieval.models import QueryRequest
from poimen_memory.services import open_services
from poimen_memory.settings import Settings


async def measure(url: str, data: Path, n: int, limit: int) -> dict[str, dict[str, float]]:
    s = Settings.from_env()
    s = replace(s, embedding=replace(s.embedding, cache_size=0))
    lines = (data / "queries.jsonl").read_text().splitlines()[:n]
    queries = [json.loads(x) for x in lines]
    ms: dict[str, list[float]] = {"evidence off": [], "evidence (policy)": []}
    budgets = {"evidence off": 0, "evidence (policy)": None}
    async with open_services(s, url=url, rerank=False, wait=True) as svc:
        for i, qy in enumerate(queries):
            order = list(budgets) if i % 2 == 0 else list(reversed(budgets))
            for name in order:
                req = QueryRequest(
                    query=qy["text"],
                    project=qy.get("project"),
                    limit=limit,
                    timeout_s=s.max_timeout_s,
                    evidence=budgets[name],
                )
                t0 = time.perf_counter()
                await svc.retriever.query(req)
                if i >= 3:  # the first few warm connections, plans and caches
                    ms[name].append((time.perf_counter() - t0) * 1000)
    return {
        k: {"p50_ms": percentile(v, 50), "p95_ms": percentile(v, 95), "n": len(v)}
        for k, v in ms.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--limit", type=int, default=10)
    args = p.parse_args()
    out = asyncio.run(measure(args.url, args.data, args.queries, args.limit))
    rows = [[k, round(v["p50_ms"], 2), round(v["p95_ms"], 2), v["n"]] for k, v in out.items()]
    print(table(rows, ["response", "p50 ms", "p95 ms", "queries"]))
    off, on = out["evidence off"]["p50_ms"], out["evidence (policy)"]["p50_ms"]
    print(f"p50 ratio with evidence / without: {on / off:.2f}")


if __name__ == "__main__":
    main()
