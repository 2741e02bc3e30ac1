"""Two versions of the service side by side over real HTTP: each a live server in its own
process (``poimen-memory serve``) on its own database, the same questions sent to both.

One client alternates the two request by request (which goes first alternates too), so a
shared, noisy machine slows both alike; then eight clients load each in turn, in the order
A, B, B, A, each server seeing texts it has not embedded yet. Prints p50/p95 and the ratios
B/A. Made to answer "is the default path within 1.3x of what it was" (issue 13):

    git worktree add --detach ../before <commit>
    psql -c "CREATE DATABASE before TEMPLATE poimen"        # the same data ...
    psql .../before -c "DROP FUNCTION memory.policy() CASCADE"  # newer shape than its SQL
    (cd ../before && PYTHONPATH=service POIMEN_DATABASE_URL=.../before \\
        python -m poimen_memory.cli.main migrate)            # ... with its own SQL
    python -m poimen_lab.bench.versions --a-src ../before/service --a-url .../before \\
        --b-url .../poimen --data ../shared/data/locomo-dev

``--a-src`` puts that checkout's ``service`` first on PYTHONPATH of server A; server B runs
this checkout. Each request sends only query, project and limit, so each version answers
with its own defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from poimen_lab.live_server import live_server
from poimen_lab.measures import percentile
from poimen_lab.report import table

DROP = ("POIMEN_RERANK_URL", "POIMEN_OPENSEARCH_URL")
Question = dict[str, Any]


def _params(q: Question, limit: int) -> dict[str, Any]:
    return {"query": q["text"], "project": q.get("project"), "limit": limit}


def one_client(
    urls: dict[str, str], questions: Sequence[Question], limit: int
) -> dict[str, list[float]]:
    ms: dict[str, list[float]] = {name: [] for name in urls}
    names = list(urls)
    with httpx.Client(timeout=60) as client:
        for i, q in enumerate(questions):
            for name in names if i % 2 == 0 else reversed(names):
                t0 = time.perf_counter()
                resp = client.get(f"{urls[name]}/memory/query", params=_params(q, limit))
                ms[name].append((time.perf_counter() - t0) * 1000)
                resp.raise_for_status()
    return ms


async def clients(base: str, questions: Sequence[Question], n: int, limit: int) -> float:
    """Requests per second of ``n`` concurrent clients over ``questions``."""
    todo = list(questions)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def worker() -> None:
            while todo:
                resp = await client.get("/memory/query", params=_params(todo.pop(), limit))
                resp.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(n)))
        return len(questions) / (time.perf_counter() - t0)


def run(
    a: dict[str, str],
    b: dict[str, str],
    questions: Sequence[Question],
    *,
    single: int = 300,
    block: int = 200,
    concurrency: int = 8,
    limit: int = 10,
) -> dict[str, Any]:
    need = 5 + single + 2 * block
    if len(questions) < need:
        raise ValueError(f"need {need} questions, got {len(questions)}")
    warm, one = questions[:5], questions[5 : 5 + single]
    loaded = questions[5 + single : need]
    first, second = loaded[:block], loaded[block:]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        urls = {
            name: stack.enter_context(live_server(env, Path(tmp) / f"{name}.log", drop=DROP))
            for name, env in (("A", a), ("B", b))
        }
        one_client(urls, warm, limit)
        ms = one_client(urls, one, limit)
        rps: dict[str, list[float]] = {"A": [], "B": []}
        for name, qs in (("A", first), ("B", first), ("B", second), ("A", second)):
            rps[name].append(asyncio.run(clients(urls[name], qs, concurrency, limit)))
    out: dict[str, Any] = {
        name: {
            "p50_ms": round(percentile(ms[name], 50), 2),
            "p95_ms": round(percentile(ms[name], 95), 2),
            f"req_per_s_{concurrency}": [round(r, 1) for r in rps[name]],
        }
        for name in ("A", "B")
    }
    out["ratios"] = {
        "p50_b_over_a": round(out["B"]["p50_ms"] / out["A"]["p50_ms"], 3),
        f"req_per_s_{concurrency}_b_over_a": round(sum(rps["B"]) / sum(rps["A"]), 3),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--a-src", type=Path, required=True, help="version A's service/ directory")
    p.add_argument("--a-url", required=True, help="version A's database")
    p.add_argument("--b-url", required=True, help="version B's (this checkout's) database")
    p.add_argument("--data", type=Path, required=True, help="a data set with queries.jsonl")
    p.add_argument("--single", type=int, default=300, help="questions for one client")
    p.add_argument("--block", type=int, default=200, help="questions per loaded block")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    lines = (args.data / "queries.jsonl").read_text().splitlines()
    out = run(
        {"POIMEN_DATABASE_URL": args.a_url, "PYTHONPATH": str(args.a_src.resolve())},
        {"POIMEN_DATABASE_URL": args.b_url},
        [json.loads(x) for x in lines],
        single=args.single,
        block=args.block,
        concurrency=args.concurrency,
    )
    c = args.concurrency
    rows = [
        [name, out[name]["p50_ms"], out[name]["p95_ms"], *out[name][f"req_per_s_{c}"]]
        for name in ("A", "B")
    ]
    print(table(rows, ["version", "1 client p50 ms", "p95 ms", f"{c} clients req/s", "again"]))
    print(json.dumps(out["ratios"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
