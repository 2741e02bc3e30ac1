"""The semantic leg at the default levels (L1,L2; one project) with and without the partial
HNSW index of migration 0007, side by side in one run on the lab's synthetic corpus:

    python -m poimen_lab.bench.levels_index --url postgresql://... --nodes 100000

It creates (and drops, unless --keep-db) a database next to the one --url names, loads the
corpus with the full HNSW index only, times memory.semantic_search and records the plan it
ran (auto_explain) and recall@k against memory.exact_search; then builds the partial index
and measures again. The table it prints goes to docs/benchmarks.md."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
import psycopg

from poimen_lab.bench.scratch import drop_database, fresh_database, module_parser
from poimen_lab.bench.synthetic import MAIN, generate, load
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate

SEMANTIC = "SELECT node_id FROM memory.semantic_search(%s, %s, '{L1,L2}', %s)"
EXACT = "SELECT node_id FROM memory.exact_search(%s, %s, '{L1,L2}', %s)"
PARTIAL = "nodes_embedding_hnsw_l1_l2"


def _indexes_in_plan(conn: psycopg.Connection[Any], vec: Any, k: int) -> list[str]:
    """The indexes the statement inside memory.semantic_search used (auto_explain JSON)."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    with conn.transaction():
        conn.execute("LOAD 'auto_explain'")
        for key, value in [
            ("log_min_duration", "0"),
            ("log_nested_statements", "on"),
            ("log_level", "notice"),
            ("log_format", "json"),
        ]:
            conn.execute(f"SET LOCAL auto_explain.{key} = '{value}'")
        conn.execute(SEMANTIC, (vec, MAIN, k)).fetchall()
    found: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        if "Index Name" in node:
            found.append(str(node["Index Name"]))
        elif node.get("Node Type") == "Seq Scan":
            found.append("Seq Scan")
        for child in node.get("Plans", []):
            walk(child)

    for text in notices:
        if "memory.nodes" in text and "{" in text:
            walk(json.loads(text[text.index("{") :])["Plan"])
    return sorted(set(found))


def measure(conn: psycopg.Connection[Any], queries: Any, k: int) -> dict[str, Any]:
    times: list[float] = []
    recalls: list[float] = []
    for vec in queries:
        t0 = time.perf_counter()
        got = [r[0] for r in conn.execute(SEMANTIC, (vec, MAIN, k)).fetchall()]
        times.append((time.perf_counter() - t0) * 1000)
        want = {r[0] for r in conn.execute(EXACT, (vec, MAIN, k)).fetchall()}
        recalls.append(len(set(got) & want) / max(len(want), 1))
    return {
        "p50_ms": statistics.median(times),
        "p95_ms": float(np.percentile(times, 95)),
        "recall": statistics.fmean(recalls),
        "plan": _indexes_in_plan(conn, queries[0], k),
    }


def main(argv: list[str] | None = None) -> int:
    ap = module_parser(__doc__)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--k", type=int, default=50)
    args = ap.parse_args(argv)
    name, url = fresh_database(args.url, "bench_levels")
    try:
        corpus = generate(args.nodes, args.dim, args.queries, seed=0)
        with connect(url, autocommit=True) as conn:
            migrate(conn, None)
            loaded = load(conn, corpus, "synthetic")
            conn.execute(f"DROP INDEX IF EXISTS memory.{PARTIAL}")
            upper = conn.execute(
                "SELECT count(*) FILTER (WHERE level IN ('L1','L2')), count(*) FROM memory.nodes"
            ).fetchone()
            assert upper is not None
            print(
                f"{args.nodes} nodes ({upper[0]} at L1/L2), dim {args.dim}, k {args.k}, "
                f"{args.queries} queries, project {MAIN}; full HNSW built in "
                f"{loaded['hnsw_build_seconds']:.1f} s ({loaded['hnsw_index_mb']:.0f} MB)"
            )
            before = measure(conn, corpus.query_vectors, args.k)
            t0 = time.perf_counter()
            conn.execute(
                f"CREATE INDEX {PARTIAL} ON memory.nodes USING hnsw (embedding vector_cosine_ops)"
                " WITH (m = 16, ef_construction = 64) WHERE level IN ('L1', 'L2')"
            )
            build_s = time.perf_counter() - t0
            conn.execute("ANALYZE memory.nodes")
            size = conn.execute(f"SELECT pg_relation_size('memory.{PARTIAL}')").fetchone()
            assert size is not None
            after = measure(conn, corpus.query_vectors, args.k)
        print(f"partial HNSW (L1,L2) built in {build_s:.1f} s ({size[0] / 2**20:.0f} MB)\n")
        print("| semantic leg, levels L1,L2 | plan | p50 ms | p95 ms | recall@k vs exact |")
        print("|---|---|---|---|---|")
        for label, m in (("full HNSW only", before), ("+ partial HNSW (L1,L2)", after)):
            print(
                f"| {label} | {', '.join(m['plan'])} | {m['p50_ms']:.1f} | {m['p95_ms']:.1f} "
                f"| {m['recall']:.3f} |"
            )
    finally:
        if not args.keep_db:
            drop_database(args.url, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
