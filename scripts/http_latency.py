"""p50/p95 of GET /memory/query, per stage, over real queries against a running database.

    .venv/bin/python scripts/http_latency.py ../shared/data/locomo-dev/queries.jsonl --n 200

Starts the real app under uvicorn on a free loopback port (embedded cluster unless
POIMEN_DATABASE_URL is set), sends each query once with its own project as the filter after
a short warm-up, and prints client-side and server-reported timings.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from poimen_memory.app import create_app  # noqa: E402
from poimen_memory.cli import _url  # noqa: E402
from poimen_memory.settings import Settings  # noqa: E402

STAGES = ["embed_time_ms", "semantic_time_ms", "lexical_time_ms", "fusion_time_ms",
          "rerank_time_ms", "provenance_time_ms", "total_time_ms"]  # fmt: skip


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("queries")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--level", default="L1,L2")
    ap.add_argument("--limit", type=int, default=5)
    args = ap.parse_args()
    rows = [json.loads(x) for x in open(args.queries, encoding="utf-8") if x.strip()][: args.n]
    os.environ["POIMEN_DATABASE_URL"] = _url(Settings.from_env())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=30) as client:
        for _ in range(200):
            try:
                if client.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        for r in rows[: args.warmup]:
            client.get(f"{base}/memory/query", params={"query": r["text"] + " warmup"})
        wall: list[float] = []
        stages: dict[str, list[float]] = {k: [] for k in STAGES}
        strategies: dict[str, int] = {}
        for r in rows:
            params = {"query": r["text"], "level": args.level, "limit": str(args.limit)}
            if r.get("project"):
                params["project"] = r["project"]
            t0 = time.perf_counter()
            resp = client.get(f"{base}/memory/query", params=params)
            wall.append((time.perf_counter() - t0) * 1000)
            if resp.status_code != 200:
                print(f"HTTP {resp.status_code}: {resp.text[:200]}", file=sys.stderr)
                continue
            body = resp.json()
            strategies[body["search_strategy"]] = strategies.get(body["search_strategy"], 0) + 1
            for k in STAGES:
                stages[k].append(float(body["metrics"][k]))
    server.should_exit = True
    print(f"{len(rows)} queries, level={args.level}, limit={args.limit}; strategies {strategies}")
    print(f"{'stage':<22}{'p50 ms':>10}{'p95 ms':>10}{'mean ms':>10}")
    print(f"{'client wall (HTTP)':<22}{pct(wall, .5):>10.1f}{pct(wall, .95):>10.1f}"
          f"{statistics.mean(wall):>10.1f}")  # fmt: skip
    for k, xs in stages.items():
        if xs:
            print(f"{k:<22}{pct(xs, .5):>10.1f}{pct(xs, .95):>10.1f}{statistics.mean(xs):>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
