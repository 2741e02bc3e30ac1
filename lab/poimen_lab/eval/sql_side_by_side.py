"""The default path's SQL statements on two databases, interleaved per query: a change's
SQL against the code before it, on the same cluster, data and query vectors, so load from
other work on the machine falls on both sides alike (whole eval runs one after the other
differ by up to 2x on a shared machine; see docs/benchmarks.md).

Each side runs what GET /memory/query runs in SQL for a Hybrid query at the default levels:
the policy/project read, the lexical leg and the semantic leg (depth 50). A database whose
stage functions have the time filter (since/before) is called with it unset, as the
service calls it when the request has no since/until.

    python -m poimen_lab.eval.sql_side_by_side --a URL_BEFORE --b URL_AFTER \\
        --queries ../shared/data/locomo-dev/queries.jsonl --n 600
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg

from poimen_memory.db.connect import connect
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.settings import Settings

_HAS_TIME_FILTER = (
    "SELECT 'since' = ANY (p.proargnames) FROM pg_catalog.pg_proc p "
    "WHERE p.oid = 'memory.lexical_search'::regproc"
)
_CTX = (
    "SELECT p.fusion, (SELECT model FROM memory.embedding_model), "
    "EXISTS (SELECT 1 FROM memory.projects WHERE name = %(p)s) FROM memory.policy() p"
)


def statements(conn: psycopg.Connection[Any]) -> dict[str, str]:
    row = conn.execute(_HAS_TIME_FILTER).fetchone()
    if not (row and row[0]):
        return {
            "context": _CTX,
            "lexical": "SELECT node_id FROM memory.lexical_search(%(q)s, %(p)s, %(lv)s, 50)",
            "semantic": "SELECT node_id FROM memory.semantic_search("
            "%(e)s, %(p)s, %(lv)s, 50, NULL)",
        }
    window = "since => %(n)s, before => %(n)s"
    return {
        # the two memory.time_range calls query_context makes
        "context": _CTX + ", memory.time_range(%(n)s, %(n)s) t, memory.time_range(%(n)s, %(n)s) x",
        "lexical": f"SELECT node_id FROM memory.lexical_search(%(q)s, %(p)s, %(lv)s, 50, {window})",
        "semantic": "SELECT node_id FROM memory.semantic_search(%(e)s, %(p)s, %(lv)s, 50, NULL, "
        f"{window})",
    }


def run(a_url: str, b_url: str, queries: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    embedder = build_embedder(Settings.from_env().embedding)
    vectors = [embedder.embed_query(q["text"]) for q in queries]
    times: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    with connect(a_url, autocommit=True) as a, connect(b_url, autocommit=True) as b:
        sides = {"a": (a, statements(a)), "b": (b, statements(b))}
        for i, (qy, vec) in enumerate(zip(queries, vectors, strict=True)):
            params = {
                "q": qy["text"],
                "p": qy.get("project"),
                "e": vec,
                "lv": ["L1", "L2"],
                "n": None,
            }
            for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
                conn, sql = sides[side]
                total = 0.0
                for name, stmt in sql.items():
                    t0 = time.perf_counter()
                    conn.execute(stmt, params).fetchall()
                    ms = (time.perf_counter() - t0) * 1000
                    total += ms
                    times[side].setdefault(name, []).append(ms)
                times[side].setdefault("total", []).append(total)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="database with the SQL before the change")
    p.add_argument("--b", required=True, help="database with the SQL after the change")
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--n", type=int, default=600, help="first N queries")
    args = p.parse_args(argv)
    lines = args.queries.read_text().splitlines()[: args.n]
    times = run(args.a, args.b, [json.loads(x) for x in lines])
    print("| statement | A p50 ms | B p50 ms | B / A | A p95 ms | B p95 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, a in times["a"].items():
        b = times["b"][name]
        pa, pb = statistics.median(a), statistics.median(b)
        qa, qb = statistics.quantiles(a, n=20)[18], statistics.quantiles(b, n=20)[18]
        print(f"| {name} | {pa:.2f} | {pb:.2f} | {pb / pa:.2f} | {qa:.2f} | {qb:.2f} |")


if __name__ == "__main__":
    main()
