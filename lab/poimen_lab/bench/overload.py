"""`poimen-memory bench-overload`: the service past its capacity (docs/configuration.md,
"Admission"). A synthetic corpus in a fresh database with Zipf-sized tenants, served by
`poimen-memory serve` as the service's own role under row-level security; for each
connection count, that many clients (threads, one keep-alive connection each) send
queries back to back for a fixed time. Prints, per count, what came back: 200s and their
latency, refusals (503 ``busy``, fast, with Retry-After), timeouts, anything else, and any
200 that arrived after its request's deadline (the goal: none).

Bounded: 127.0.0.1 only, ``--seconds`` per count (default 20), at most 512 connections."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from psycopg.conninfo import make_conninfo

from poimen_lab.bench import synthetic
from poimen_lab.bench.command import _http_texts
from poimen_lab.bench.http import serving
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory.db.connect import connect, database_url, ensure_service_login
from poimen_memory.db.migrate import migrate
from poimen_memory.settings import Settings

MAX_CONNECTIONS = 512


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench-overload", help="the service past its capacity: 503s, deadlines")
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--tenants", type=int, default=100)
    p.add_argument("--connections", default="16,64,256", help="comma-separated counts")
    p.add_argument("--seconds", type=float, default=20.0, help="per connection count")
    p.add_argument("--timeout", type=float, default=2.0, help="each request's timeout_seconds")
    p.add_argument("--evidence", type=int, help="the evidence budget (default: the policy's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=cmd_bench_overload)


def _clients(
    base: str,
    n: int,
    seconds: float,
    timeout_s: float,
    texts: list[str],
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    where = urlsplit(base)
    host = where.hostname or "127.0.0.1"
    lock = threading.Lock()
    ok_ms: list[float] = []
    refused_ms: list[float] = []
    counts: dict[str, int] = {}
    late = no_retry_after = 0
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        nonlocal late, no_retry_after
        conn = http.client.HTTPConnection(host, where.port, timeout=timeout_s + 30)
        j = 0
        try:
            while time.monotonic() < stop:
                text = texts[(i * 7919 + j) % len(texts)] + f" {i}.{j}"  # no cache hits
                j += 1
                path = "/memory/query?" + urlencode(
                    {"query": text, "limit": "10", "project": synthetic.MAIN,
                     "timeout_seconds": f"{timeout_s:g}", **(extra or {})}
                )  # fmt: skip
                t0 = time.perf_counter()
                try:
                    conn.request("GET", path)
                    resp = conn.getresponse()
                    body = resp.read()
                except (OSError, http.client.HTTPException):
                    with lock:
                        counts["connection error"] = counts.get("connection error", 0) + 1
                    conn.close()
                    conn = http.client.HTTPConnection(host, where.port, timeout=60)
                    continue
                took = (time.perf_counter() - t0) * 1000
                kind = str(resp.status)
                if resp.status == 503:
                    kind = "503 " + str(json.loads(body).get("error"))
                with lock:
                    counts[kind] = counts.get(kind, 0) + 1
                    if resp.status == 200:
                        ok_ms.append(took)
                        late += took > timeout_s * 1000
                    elif resp.status == 503:
                        refused_ms.append(took)
                        no_retry_after += resp.getheader("retry-after") is None
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(counts.values())
    return {
        "connections": n,
        "requests": total,
        "req_per_s": round(total / seconds, 1),
        "counts": dict(sorted(counts.items())),
        "ok_p50_ms": round(percentile(ok_ms, 50), 1) if ok_ms else None,
        "ok_p95_ms": round(percentile(ok_ms, 95), 1) if ok_ms else None,
        "ok_max_ms": round(max(ok_ms), 1) if ok_ms else None,
        "refused_p50_ms": round(percentile(refused_ms, 50), 1) if refused_ms else None,
        "refused_p95_ms": round(percentile(refused_ms, 95), 1) if refused_ms else None,
        "late_200s": late,
        "503_without_retry_after": no_retry_after,
    }


def cmd_bench_overload(args: argparse.Namespace) -> int:
    counts = [int(c) for c in args.connections.split(",") if c.strip()]
    if not counts or not all(1 <= c <= MAX_CONNECTIONS for c in counts) or args.seconds > 120:
        print(f"error: connections 1..{MAX_CONNECTIONS}, --seconds <= 120", file=sys.stderr)
        return 2
    s = Settings.from_env()
    server_url = database_url(s, start=True)
    from poimen_memory.embedders.factory import build_embedder

    embedder = build_embedder(s.embedding)
    name, url = fresh_database(server_url)
    results: list[dict[str, Any]] = []
    try:
        with connect(url, autocommit=True) as conn:
            migrate(conn, s.plpython_root)
            corpus = synthetic.generate(args.nodes, embedder.dim, 10, seed=args.seed)
            synthetic.load(conn, corpus, embedder.model_name)
            synthetic.add_tenants(conn, args.tenants, max(10, args.nodes // 10), args.seed)
            ensure_service_login(conn, s.service_role)
        texts = _http_texts(500, args.seed)
        service = make_conninfo(url, user=s.service_role)
        with serving(service) as (base, _):
            extra = {} if args.evidence is None else {"evidence": str(args.evidence)}
            _clients(base, 2, 2.0, args.timeout, texts, extra)  # warm-up, discarded
            for c in counts:
                print(f"bench-overload: {c} connections for {args.seconds:g} s", file=sys.stderr)
                results.append(_clients(base, c, args.seconds, args.timeout, texts, extra))
    finally:
        drop_database(server_url, name)
    rows = [
        [r["connections"], r["requests"], r["req_per_s"],
         ", ".join(f"{k}: {v}" for k, v in r["counts"].items()),
         r["ok_p50_ms"], r["ok_p95_ms"], r["ok_max_ms"], r["refused_p50_ms"],
         r["late_200s"], r["503_without_retry_after"]]
        for r in results
    ]  # fmt: skip
    print(
        table(
            rows,
            ["connections", "requests", "req/s", "answers", "200 p50 ms", "200 p95 ms",
             "200 max ms", "503 p50 ms", "200s past deadline", "503s without Retry-After"],
        )
    )  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"timeout_s": args.timeout, "runs": results}, indent=2))
    return 0
