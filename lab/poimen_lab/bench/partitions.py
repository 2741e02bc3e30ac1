"""Partitioned by project against not, side by side in one run (issue #15, docs/scaling.md):

    python -m poimen_lab.bench.partitions --url postgresql://... --nodes 1000000 --projects 100

It creates a database next to the one --url names, loads the lab's synthetic corpus with
Zipf-sized projects (COPY, the statistics triggers on, then both HNSW indexes built), copies
it with CREATE DATABASE ... TEMPLATE, and moves the copy over with
memory.partition_by_project(), the same call a DBA makes (timed). Then, alternating between
the two databases query by query, it measures the semantic leg, the lexical leg and the
whole memory.query, filtered by the largest, the median and the smallest project and
unfiltered: p50/p95 latency and recall@k (against memory.exact_search and the exhaustive
BM25 of the unpartitioned copy), plus a small ingest into one project, and sizes. The
databases are dropped afterwards unless --keep-db."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np
import psycopg
from psycopg.conninfo import make_conninfo

from poimen_lab.bench.scratch import drop_database, fresh_database, module_parser
from poimen_lab.bench.synthetic import Corpus, generate, load
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate

LEVELS = ["L1", "L2"]
SEMANTIC = "SELECT node_id FROM memory.semantic_search(%s, %s, %s, %s)"
EXACT = "SELECT node_id FROM memory.exact_search(%s, %s, %s, %s)"
LEXICAL = "SELECT node_id FROM memory.lexical_search(%s, %s, %s, %s)"
LEXICAL_EXACT = "SELECT node_id FROM memory.lexical_search(%s, %s, %s, %s, exhaustive => true)"
QUERY = "SELECT node_id FROM memory.query(%s, %s, %s, %s, %s, 'Hybrid')"


def _queries(
    corpus: Corpus, project: str | None, n: int, rng: np.random.Generator
) -> list[tuple[Any, str]]:
    """n (vector, text) queries drawn from the project's L1/L2 nodes (any project when None):
    a node's vector plus noise, and four words of its text."""
    pool = [
        i
        for i, (p, lv) in enumerate(zip(corpus.projects, corpus.levels, strict=True))
        if lv in LEVELS and (project is None or p == project)
    ]
    out = []
    dim = corpus.vectors.shape[1]
    for i in rng.choice(pool, size=min(n, len(pool)), replace=False):
        v = corpus.vectors[int(i)] + rng.standard_normal(dim).astype(np.float32) / np.sqrt(dim)
        words = corpus.texts[int(i)].split()
        text = " ".join(rng.choice(words, size=min(4, len(words)), replace=False))
        out.append((v / np.linalg.norm(v), text))
    return out


def _timed(
    conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...]
) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    ids = [r[0] for r in conn.execute(sql, params).fetchall()]
    return (time.perf_counter() - t0) * 1000, ids


def _sizes(conn: psycopg.Connection[Any]) -> dict[str, float]:
    """MB of each table with its partitions and indexes, and of the HNSW indexes alone."""
    out: dict[str, float] = {}
    for t in ("nodes", "edges", "postings", "term_stats"):
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
            " WHERE c.oid = %s::regclass OR c.oid IN (SELECT inhrelid FROM pg_inherits"
            "  WHERE inhparent = %s::regclass)",
            (f"memory.{t}", f"memory.{t}"),
        ).fetchone()
        out[t] = float(row[0]) / 2**20 if row else 0.0
    row = conn.execute(
        "SELECT coalesce(sum(pg_relation_size(i.indexrelid)), 0) FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam"
        " WHERE a.amname = 'hnsw'"
    ).fetchone()
    out["hnsw_indexes"] = float(row[0]) / 2**20 if row else 0.0
    return out


def _ingest(conn: psycopg.Connection[Any], corpus: Corpus, project: str, n: int) -> float:
    """Nodes per second for one INSERT of n new nodes (statistics triggers and both HNSW
    indexes maintained), rolled back so both databases stay equal."""
    rng = np.random.default_rng(7)
    src = rng.choice(len(corpus.texts), size=n, replace=False)
    rows = [
        (f"ingest-{uuid.uuid4().hex}", corpus.texts[int(i)], corpus.vectors[int(i)]) for i in src
    ]
    with conn.transaction(force_rollback=True):
        t0 = time.perf_counter()
        conn.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, external_id, text, embedding)"
            " SELECT sha256(x.e::bytea), p.id, 'L1', x.e, x.t, x.v"
            " FROM unnest(%s::text[], %s::text[], %s::vector[]) AS x(e, t, v),"
            "      memory.projects p WHERE p.name = %s",
            ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], project),
        )
        return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = module_parser(__doc__)
    ap.add_argument("--projects", type=int, default=100)
    ap.add_argument("--queries", type=int, default=30, help="per project class")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--ingest", type=int, default=1000, help="nodes in the ingest probe")
    ap.add_argument(
        "--maintenance-work-mem", default="4GB", help="for the HNSW builds (one graph fits)"
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    plain_db, plain_url = fresh_database(args.url, "bench_plain")
    parted_db = plain_db.replace("bench_plain", "bench_parted", 1)
    parted_url = make_conninfo(args.url, dbname=parted_db)
    result: dict[str, Any] = {"nodes": args.nodes, "projects": args.projects, "k": args.k}
    try:
        t0 = time.perf_counter()
        corpus = generate(args.nodes, args.dim, 1, seed=0, projects=args.projects)
        result["generate_s"] = time.perf_counter() - t0
        sizes = Counter(corpus.projects)
        ranked = [p for p, _ in sizes.most_common()]
        classes: dict[str, str | None] = {
            f"largest ({sizes[ranked[0]]:,} nodes)": ranked[0],
            f"median ({sizes[ranked[len(ranked) // 2]]:,} nodes)": ranked[len(ranked) // 2],
            f"smallest ({sizes[ranked[-1]]:,} nodes)": ranked[-1],
            "unfiltered": None,
        }
        with connect(plain_url, autocommit=True) as conn:
            conn.execute(f"SET maintenance_work_mem = '{args.maintenance_work_mem}'")
            migrate(conn, None)
            loaded = load(conn, corpus, "synthetic")
            loaded.pop("db_ids")
            result["load"] = loaded
        print(
            f"{args.nodes:,} nodes in {args.projects} projects; "
            f"COPY {loaded['copy_seconds']:.0f} s, "
            f"HNSW (all levels) {loaded['hnsw_build_seconds']:.0f} s",
            flush=True,
        )
        with psycopg.connect(args.url, autocommit=True) as admin:
            t0 = time.perf_counter()
            # FILE_COPY: a copy of a large database without writing it all to the WAL too.
            admin.execute(f"CREATE DATABASE {parted_db} TEMPLATE {plain_db} STRATEGY = FILE_COPY")
            result["template_copy_s"] = time.perf_counter() - t0
        with connect(parted_url, autocommit=True) as conn:
            conn.execute(f"SET maintenance_work_mem = '{args.maintenance_work_mem}'")
            notices: list[str] = []

            def progress(d: psycopg.errors.Diagnostic) -> None:
                notices.append(d.message_primary or "")
                print(f"  {notices[-1]}", flush=True)

            conn.add_notice_handler(progress)
            t0 = time.perf_counter()
            moved = conn.execute("SELECT * FROM memory.partition_by_project()").fetchall()
            result["partition_s"] = time.perf_counter() - t0
            result["partition_notices"] = notices
            assert all(r[2] == r[3] for r in moved), moved
        print(f"partition_by_project: {result['partition_s']:.0f} s", flush=True)

        rng = np.random.default_rng(1)
        with (
            connect(plain_url, autocommit=True) as plain,
            connect(parted_url, autocommit=True) as parted,
        ):
            from pgvector.psycopg import register_vector

            for c in (plain, parted):
                register_vector(c)
            result["sizes_mb"] = {"plain": _sizes(plain), "partitioned": _sizes(parted)}
            rows: list[dict[str, Any]] = []
            for label, project in classes.items():
                qs = _queries(corpus, project, args.queries, rng)
                truth_sem = [
                    set(r[0] for r in plain.execute(EXACT, (v, project, LEVELS, args.k)).fetchall())
                    for v, _ in qs
                ]
                truth_lex = [
                    set(r[0] for r in plain.execute(LEXICAL_EXACT, (t, project, LEVELS, args.k)))
                    for _, t in qs
                ]
                stages: list[tuple[str, str, list[tuple[Any, ...]], list[set[int]] | None]] = [
                    (
                        "semantic",
                        SEMANTIC,
                        [(v, project, LEVELS, args.k) for v, _ in qs],
                        truth_sem,
                    ),
                    ("lexical", LEXICAL, [(t, project, LEVELS, args.k) for _, t in qs], truth_lex),
                    ("memory.query", QUERY, [(t, v, project, LEVELS, args.k) for v, t in qs], None),
                ]
                for stage, sql, params, truth in stages:
                    for c in (plain, parted):  # warm both caches before timing either
                        for p in params:
                            c.execute(sql, p).fetchall()
                    times: dict[str, list[float]] = {"plain": [], "partitioned": []}
                    recall: dict[str, list[float]] = {"plain": [], "partitioned": []}
                    for i, p in enumerate(params):
                        order = (("plain", plain), ("partitioned", parted))
                        for name, c in order if i % 2 == 0 else order[::-1]:
                            ms, ids = _timed(c, sql, p)
                            times[name].append(ms)
                            if truth is not None:
                                recall[name].append(
                                    len(set(ids) & truth[i]) / max(len(truth[i]), 1)
                                )
                    row: dict[str, Any] = {"filter": label, "stage": stage, "queries": len(params)}
                    for name in ("plain", "partitioned"):
                        row[f"{name}_p50_ms"] = statistics.median(times[name])
                        row[f"{name}_p95_ms"] = float(np.percentile(times[name], 95))
                        row[f"{name}_recall"] = (
                            statistics.fmean(recall[name]) if recall[name] else None
                        )
                    row["p50_ratio"] = row["partitioned_p50_ms"] / row["plain_p50_ms"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            result["rows"] = rows
            median_project = classes[list(classes)[1]]
            assert median_project is not None
            result["ingest_nodes_per_s"] = {
                "plain": _ingest(plain, corpus, median_project, args.ingest),
                "partitioned": _ingest(parted, corpus, median_project, args.ingest),
            }
        _print(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=float)
    finally:
        if not args.keep_db:
            for db in (parted_db, plain_db):
                drop_database(args.url, db)
    return 0


def _print(r: dict[str, Any]) -> None:
    print(f"\n{r['nodes']:,} nodes, {r['projects']} projects (Zipf sizes), k {r['k']}\n")
    print("| filter | stage | p50 ms plain | p50 ms partitioned | ratio | p95 plain | p95 part. "
          "| recall plain | recall part. |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for x in r["rows"]:
        rec = [
            f"{x[k]:.3f}" if x[k] is not None else "-"
            for k in ("plain_recall", "partitioned_recall")
        ]
        print(
            f"| {x['filter']} | {x['stage']} | {x['plain_p50_ms']:.2f} "
            f"| {x['partitioned_p50_ms']:.2f} | {x['p50_ratio']:.2f} "
            f"| {x['plain_p95_ms']:.2f} | {x['partitioned_p95_ms']:.2f} "
            f"| {rec[0]} | {rec[1]} |"
        )
    ld = r["load"]
    print(
        f"\nload (unpartitioned): COPY {ld['copy_seconds']:.0f} s "
        f"({ld['copy_nodes_per_s']:.0f} nodes/s with the statistics triggers), "
        f"edges {ld['edges_seconds']:.0f} s, HNSW all levels {ld['hnsw_build_seconds']:.0f} s; "
        f"CREATE DATABASE TEMPLATE {r['template_copy_s']:.0f} s; "
        f"memory.partition_by_project() {r['partition_s']:.0f} s"
    )
    ing = r["ingest_nodes_per_s"]
    print(f"ingest probe: {ing['plain']:.0f} nodes/s plain, {ing['partitioned']:.0f} partitioned")
    for name, s in r["sizes_mb"].items():
        print(f"sizes {name}: " + ", ".join(f"{k} {v:.0f} MB" for k, v in s.items()))


if __name__ == "__main__":
    raise SystemExit(main())
