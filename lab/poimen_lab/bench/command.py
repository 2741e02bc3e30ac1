"""`poimen-memory bench`: a synthetic corpus COPY-loaded into a fresh database, then HNSW
build and ef_search sweeps (with and without a 1% filter) beside hnswlib and numpy on the
same vectors, bm25s beside memory.lexical_search, fusion and provenance latency, the HTTP
service end to end, and ingest against raw embedder throughput."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from poimen_lab.bench import synthetic
from poimen_lab.bench.ann import AnnBench, matched
from poimen_lab.bench.recall import add_corpus_arguments, make_corpus, service_connection
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.bm25_peer import PgLexemeBM25
from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.db.queries import q
from poimen_memory.settings import Settings

NATURAL_DEFAULT = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "scifact"
# The acceptance table: key -> (goal, "<=" or ">=").
GOALS: dict[str, tuple[float, str]] = {
    # The service as deployed: its own role under row-level security, many tenants; in
    # anonymous mode (every project asserted) and with a one-project API key.
    "http_p50_over_inprocess_p50": (1.5, "<="),
    "http_rps8_over_embed_rps8": (0.6, ">="),
    "http_key_p50_over_inprocess_p50": (1.5, "<="),
    "http_key_rps8_over_embed_rps8": (0.6, ">="),
    "http_p50_over_owner_p50": (1.2, "<="),
    "http_key_p50_over_owner_p50": (1.2, "<="),
    "http_evidence_p50_over_owner_p50": (1.2, "<="),
    "lexical_search_over_bm25s_p50": (10, "<="),
    "lexical_search_over_bm25s_p50_natural": (2, "<="),
    "hnsw_over_hnswlib_p50_at_recall95": (3, "<="),
    "filtered_over_unfiltered_p50": (2, "<="),
    "ingest_over_raw_embed": (0.9, ">="),
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="synthetic-corpus benchmark against hnswlib, numpy, bm25s",
        description=__doc__,
    )
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hnswlib-threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument(
        "--http-requests",
        type=int,
        default=200,
        help="requests per concurrency level (1 and 8 clients)",
    )
    p.add_argument("--no-http", action="store_true", help="skip the end-to-end HTTP part")
    p.add_argument(
        "--tenants",
        type=int,
        default=150,
        help="projects added before the HTTP part, Zipf-sized (the r-th: ceil(largest / r) "
        "nodes); the service serves them as its own role",
    )
    p.add_argument("--tenant-largest", type=int, default=2000, help="nodes of the largest tenant")
    p.add_argument(
        "--ingest-nodes",
        type=int,
        default=1024,
        # Five embed groups (one batch, then POIMEN_INGEST_EMBED_GROUP at a time): the first
        # group's embedding and the last one's writes cannot overlap anything, so a run of
        # few groups measures mostly those.
        help="nodes ingested with the local embedder (0: skip)",
    )
    p.add_argument(
        "--natural",
        type=Path,
        default=NATURAL_DEFAULT,
        metavar="DIR",
        help="a nodes.jsonl + queries*.jsonl folder (default: ../shared/data/scifact beside the "
        "repository) for the natural-text lexical comparison; skipped when absent",
    )
    p.add_argument("--keep-db", action="store_true", help="keep the benchmark database")
    p.add_argument("--json", type=Path, metavar="OUT")
    p.add_argument("--plot", type=Path, metavar="OUT.png")
    add_corpus_arguments(p)
    p.set_defaults(func=cmd_bench)


def _lat(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(ms, 50), 3), "p95_ms": round(percentile(ms, 95), 3)}


def _ann(
    conn: psycopg.Connection[Any],
    corpus: synthetic.Corpus,
    db_ids: np.ndarray[Any, Any],
    threads: int,
) -> tuple[dict[str, Any], Any]:
    bench = AnnBench(conn, corpus.vectors, db_ids, corpus.query_vectors)
    index, build_s = bench.hnswlib(threads)
    out: dict[str, Any] = {"hnswlib_build_seconds": round(build_s, 3), "hnswlib_threads": threads}
    small = np.array([i for i, p in enumerate(corpus.projects) if p == synthetic.SMALL])
    for label, project, subset in (
        ("unfiltered", None, None),
        ("filtered_1pct", synthetic.SMALL, small),
    ):
        truth, exact_ms = bench.exact(project)
        ours = bench.ours(project, truth)
        allowed = None if subset is None else {int(i) for i in subset}
        peer = bench.hnswlib_sweep(index, truth, allowed)
        brute = bench.numpy(subset, truth)
        out[label] = {
            "exact_search": _lat(exact_ms),
            "numpy": brute,
            "ours": ours,
            "hnswlib": peer,
            "matched": matched(ours, peer),
            "filter_nodes": len(corpus.vectors) if subset is None else len(subset),
        }
    return out, index


def _lexical(
    conn: psycopg.Connection[Any],
    url: str,
    s: Settings,
    query_texts: list[str],
    projects: list[str],
    project: str | None = None,
) -> tuple[dict[str, Any], PgLexemeBM25]:
    """memory.lexical_search beside bm25s over the same postings: ours timed as the
    service's role under row-level security, as a deployment runs it (the owner's plans
    hid a probe that read every project's postings: docs/benchmarks.md, "The pruned BM25
    path as the service's role"); bm25s built from the owner's read of them."""
    peer = PgLexemeBM25(conn, projects)
    lexemes = peer.query_lexemes(query_texts)
    ours_ms, peer_ms, same = [], [], 0
    sql = q("lexical_search")
    params = {"project": project, "levels": None, "k": 10, "since": None, "before": None}
    with service_connection(url, conn, s) as service:
        service.execute(sql, {**params, "query": query_texts[0]}).fetchall()  # warm-up
        for text, lx in zip(query_texts, lexemes, strict=True):
            t0 = time.perf_counter()
            rows = service.execute(sql, {**params, "query": text}).fetchall()
            ours_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            ids = peer.search(lx, project, None, 10)
            peer_ms.append((time.perf_counter() - t0) * 1000)
            same += [r[0] for r in rows] == ids
    a, b = _lat(ours_ms), _lat(peer_ms)
    return {
        "lexical_search": a,
        "bm25s": b,
        "identical_top10": round(same / len(lexemes), 4),
        "bm25s_index_seconds": round(peer.index_seconds, 3),
        "ratio_p50_ours_over_bm25s": round(a["p50_ms"] / max(b["p50_ms"], 1e-9), 1),
    }, peer


NATURAL_INSERT = """
INSERT INTO memory.nodes (sha256, project_id, level, external_id, title, text)
SELECT sha256(convert_to(u.ext, 'UTF8')), (SELECT id FROM memory.projects WHERE name = %(p)s),
       'L0', u.ext, u.title, u.text
FROM unnest(%(ext)s::text[], %(titles)s::text[], %(texts)s::text[]) AS u(ext, title, text)
"""


def _natural(server_url: str, s: Settings, folder: Path, n_queries: int) -> dict[str, Any]:
    """memory.lexical_search beside bm25s on natural text: the folder's nodes (lexical
    statistics only, no embeddings) in a database of their own, its queries' first n."""
    nodes = [json.loads(line) for line in (folder / "nodes.jsonl").read_text().splitlines()]
    qfile = sorted(folder.glob("queries*.jsonl"))[0]
    texts = [json.loads(line)["text"] for line in qfile.read_text().splitlines()][:n_queries]
    project = nodes[0]["project"]
    name, url = fresh_database(server_url)
    try:
        with connect(url, autocommit=True) as conn:
            migrate(conn, s.plpython_root)
            conn.execute("INSERT INTO memory.projects (name) VALUES (%s)", (project,))
            t0 = time.perf_counter()
            conn.execute(
                NATURAL_INSERT,
                {
                    "p": project,
                    "ext": [n["id"] for n in nodes if n["project"] == project],
                    "titles": [n.get("title") for n in nodes if n["project"] == project],
                    "texts": [n["text"] for n in nodes if n["project"] == project],
                },
            )
            load_s = time.perf_counter() - t0
            conn.execute("VACUUM ANALYZE memory.postings")
            out, _ = _lexical(conn, url, s, texts, [project], project)
    finally:
        drop_database(server_url, name)
    return {"corpus": folder.name, "nodes": len(nodes), "load_seconds": round(load_s, 2), **out}


def _fusion_provenance(conn: psycopg.Connection[Any], corpus: synthetic.Corpus) -> dict[str, Any]:
    fuse_ms, hydrate_ms, walk_ms, l0 = [], [], [], []
    for text, vec in zip(corpus.query_texts, corpus.query_vectors, strict=True):
        base = {"project": None, "levels": None, "k": 50, "since": None, "before": None}
        sem = conn.execute(
            q("semantic_search"), {**base, "embedding": vec, "ef_search": None}
        ).fetchall()
        lex = conn.execute(q("lexical_search"), {**base, "query": text}).fetchall()
        lists = json.dumps(
            [
                {"ids": [r[0] for r in sem], "scores": [r[2] for r in sem]},
                {"ids": [r[0] for r in lex], "scores": [r[2] for r in lex]},
            ]
        )
        t0 = time.perf_counter()
        conn.execute(
            q("fuse"), {"lists": lists, "method": "rrf", "k": 60, "final_k": 10}
        ).fetchall()
        fuse_ms.append((time.perf_counter() - t0) * 1000)
        top = conn.execute(
            q("semantic_search"),
            {**base, "embedding": vec, "k": 10, "levels": ["L1", "L2"], "ef_search": None},
        )
        ids = [r[0] for r in top.fetchall()]
        t0 = time.perf_counter()
        conn.execute(q("hydrate"), {"ids": ids, "embedding": vec, "project": None}).fetchall()
        hydrate_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        rows = conn.execute(q("provenance_l0"), {"ids": ids}).fetchall()
        walk_ms.append((time.perf_counter() - t0) * 1000)
        l0.append(len(rows))
    floor = []
    for _ in range(200):
        t0 = time.perf_counter()
        conn.execute("SELECT 1").fetchall()
        floor.append((time.perf_counter() - t0) * 1000)
    return {
        "sql_roundtrip_floor": _lat(floor),
        "fuse_rrf_2x50": _lat(fuse_ms),
        "hydrate_10_with_provenance": _lat(hydrate_ms),
        "provenance_walk_10": _lat(walk_ms),
        "l0_reached_per_query": round(sum(l0) / max(len(l0), 1), 1),
    }


def _ingest(
    conn: psycopg.Connection[Any], embedder: Any, n: int, seed: int, s: Settings
) -> dict[str, Any]:
    from poimen_memory.ingest.nodes import NodeRecord
    from poimen_memory.ingest.writer import ingest

    rng = np.random.default_rng(seed + 1)
    words = synthetic.vocabulary(5000, np.random.default_rng(seed))
    texts = [" ".join(rng.choice(words, int(rng.integers(15, 50)))) for _ in range(n)]
    embedder.load()
    embedder.embed_documents(texts[:16])  # warm-up: first runs are slower
    t0 = time.perf_counter()
    embedder.embed_documents(texts)
    raw = n / (time.perf_counter() - t0)
    records = [
        NodeRecord(
            line_no=i + 1, project="bench-ingest", level="L0", text=t, external_id=f"i{seed}-{i}"
        )
        for i, t in enumerate(texts)
    ]
    report = ingest(
        conn,
        records,
        embedder,
        batch_size=s.ingest_batch,
        embed_group=s.ingest_embed_group,
        progress=False,
        # Per-batch commits, as every ingest rate in docs/benchmarks.md was measured.
        commit_every_batch=True,
    )
    return {
        "nodes": n,
        "raw_embed_nodes_per_s": round(raw, 2),
        "ingest_nodes_per_s": round(report.rate, 2),
        "ingest_over_raw": round(report.rate / raw, 3),
    }


def _http_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed + 2)
    words = synthetic.vocabulary(5000, np.random.default_rng(seed))
    return [" ".join(rng.choice(words, int(rng.integers(4, 8)))) + f" {i}" for i in range(n)]


def cmd_bench(args: argparse.Namespace) -> int:
    from poimen_memory.db.connect import database_url

    if args.nodes < 100 or args.queries < 1 or not 1 <= args.dim <= 2000:
        print(
            "error: --nodes >= 100, --queries >= 1 and --dim 1..2000 are required", file=sys.stderr
        )
        return 2
    s = Settings.from_env()
    server_url = database_url(s, start=True)
    embedder: Any = None
    model = f"synthetic-{args.dim}"
    if not args.no_http or args.ingest_nodes:
        from poimen_memory.embedders.factory import build_embedder

        embedder = build_embedder(s.embedding)
        if embedder.dim == args.dim:
            model = embedder.model_name
        else:
            print(
                f"note: --dim {args.dim} differs from the embedder's {embedder.dim}: "
                "HTTP and ingest parts skipped",
                file=sys.stderr,
            )
            embedder = None
    name, url = fresh_database(server_url)
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "dim": args.dim,
        "queries": args.queries,
        "database": conninfo_to_dict(url).get("dbname"),
    }
    try:
        with connect(url, autocommit=True) as conn:
            migrate(conn, s.plpython_root)
            t0 = time.perf_counter()
            if args.corpus == "real":  # real MiniLM vectors recombined (bench/realistic.py)
                corpus, _ = make_corpus(args, s)
            else:
                corpus = synthetic.generate(args.nodes, args.dim, args.queries, seed=args.seed)
            result["corpus"] = args.corpus
            gen_s = time.perf_counter() - t0
            print(f"bench: generated {args.nodes} nodes in {gen_s:.1f}s; loading", file=sys.stderr)
            load = synthetic.load(conn, corpus, model)
            db_ids = load.pop("db_ids")
            result["load"] = {
                k: round(v, 3) if isinstance(v, float) else v for k, v in load.items()
            }
            print("bench: vector search", file=sys.stderr)
            result["ann"], hnsw_index = _ann(conn, corpus, db_ids, args.hnswlib_threads)
            print("bench: lexical, fusion, provenance", file=sys.stderr)
            result["lexical"], bm25 = _lexical(
                conn, url, s, corpus.query_texts, [synthetic.MAIN, synthetic.SMALL]
            )
            result.update(_fusion_provenance(conn, corpus))
            http_texts = _http_texts(5 + 2 * args.http_requests, args.seed)
            http_lexemes = bm25.query_lexemes(http_texts)
            if embedder is not None and args.ingest_nodes:
                print("bench: ingest", file=sys.stderr)
                result["ingest"] = _ingest(conn, embedder, args.ingest_nodes, args.seed, s)
        if embedder is not None and not args.no_http:
            from poimen_lab.bench import inprocess
            from poimen_lab.bench.http import run
            from poimen_memory.api.auth import key_hash, new_key
            from poimen_memory.db.connect import ensure_service_login

            with connect(url, autocommit=True) as conn:
                if args.tenants:
                    print(f"bench: {args.tenants} Zipf-sized tenants", file=sys.stderr)
                    result["tenants"] = synthetic.add_tenants(
                        conn, args.tenants, args.tenant_largest, args.seed
                    )
                ensure_service_login(conn, s.service_role)
            service_url = make_conninfo(url, user=s.service_role)
            # Every request names its project, as almost every real one does; the same
            # requests in each mode, each against a server (and embedding cache) of its own.
            params = {"limit": "10", "evidence": "0", "project": synthetic.MAIN}
            n = args.http_requests
            # A pass to warm PostgreSQL's caches for these requests, so no mode below pays
            # for being first.
            print("bench: HTTP warm-up pass (discarded)", file=sys.stderr)
            run(url, http_texts, requests=n, params=params)
            print("bench: HTTP as the service role (anonymous mode)", file=sys.stderr)
            result["http"] = run(service_url, http_texts, requests=n, params=params)
            print("bench: HTTP as the owner (no row-level security)", file=sys.stderr)
            result["http_owner"] = run(url, http_texts, requests=n, params=params)
            # The default answer cites its evidence list (the policy's budget), which the
            # in-process reference has no part of: measured apart, one client, as the
            # service role and as the owner, so row-level security's share of its cost shows
            # (it was 1.9 s against 46 ms at 20k nodes before the evidence joins were made
            # leakproof; tests/test_query_cost.py). Before the key below exists: once one
            # does, anonymous mode is over and keyless requests are 401s.
            cited = {k: v for k, v in params.items() if k != "evidence"}
            print("bench: HTTP with the evidence list, service role and owner", file=sys.stderr)
            result["http_evidence"] = run(
                service_url, http_texts, concurrency=(1,), requests=n, params=cited
            )
            result["http_owner_evidence"] = run(
                url, http_texts, concurrency=(1,), requests=n, params=cited
            )
            key = new_key()
            with connect(url, autocommit=True) as conn:
                conn.execute(
                    q("key_insert"),
                    {
                        "key_hash": key_hash(key),
                        "prefix": key[:12],
                        "projects": [synthetic.MAIN],
                        "can_write": False,
                        "note": "bench",
                    },
                )
            print("bench: HTTP as the service role with a one-project key", file=sys.stderr)
            result["http_key"] = run(
                service_url,
                http_texts,
                requests=n,
                params=params,
                headers={"Authorization": f"Bearer {key}"},
            )
            print("bench: the service's query path in process, no HTTP", file=sys.stderr)
            result["service_inprocess"] = inprocess.service(
                service_url, embedder, http_texts, params, requests=n
            )
            print("bench: the same pipeline in process", file=sys.stderr)
            one = slice(5, 5 + args.http_requests)  # the texts the 1-client run sent
            result["inprocess"] = inprocess.pipeline(
                embedder.embed_query,
                hnsw_index,
                lambda lx, k: bm25.search_scored(lx, None, None, k),
                http_texts[one],
                http_lexemes[one],
            )
            fresh = [t + " again" for t in http_texts[5 + args.http_requests :]]
            result["embed_only"] = inprocess.embed_throughput(embedder.embed_query, fresh, 8)
        if args.natural is not None and (args.natural / "nodes.jsonl").exists():
            print(f"bench: lexical on natural text ({args.natural})", file=sys.stderr)
            result["lexical_natural"] = _natural(server_url, s, args.natural, args.queries)
    finally:
        if not args.keep_db:
            drop_database(server_url, name)
    result["ratios"] = _ratios(result)
    _print(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        from poimen_lab.bench.plot import plot

        plot(args.plot, result)
    return 0


def _ratios(r: dict[str, Any]) -> dict[str, Any]:
    ann = r["ann"]
    out: dict[str, Any] = {
        "hnsw_build_ours_over_hnswlib": round(
            r["load"]["hnsw_build_seconds"] / max(ann["hnswlib_build_seconds"], 1e-9), 2
        ),
        "exact_search_over_numpy_p50": round(
            ann["unfiltered"]["exact_search"]["p50_ms"]
            / max(ann["unfiltered"]["numpy"]["p50_ms"], 1e-9),
            1,
        ),
        "lexical_search_over_bm25s_p50": r["lexical"]["ratio_p50_ours_over_bm25s"],
    }
    for label in ("unfiltered", "filtered_1pct"):
        for m in ann[label]["matched"]:
            if "ratio_ours_over_peer" in m:
                out[f"ann_{label}_recall{m['target_recall']}_ours_over_hnswlib_p50"] = m[
                    "ratio_ours_over_peer"
                ]
    # The acceptance table (GOALS); a key is absent when its part did not run.
    at95 = [m for m in ann["unfiltered"]["matched"] if m["target_recall"] == 0.95]
    if at95 and "ratio_ours_over_peer" in at95[0]:
        out["hnsw_over_hnswlib_p50_at_recall95"] = at95[0]["ratio_ours_over_peer"]
    # at the default ef_search (100), as memory.semantic_search runs without one
    u = next((x for x in ann["unfiltered"]["ours"] if x["ef_search"] == 100), None)
    f = next((x for x in ann["filtered_1pct"]["ours"] if x["ef_search"] == 100), None)
    if u is not None and f is not None:
        out["filtered_over_unfiltered_p50"] = round(f["p50_ms"] / max(u["p50_ms"], 1e-9), 2)
        out["filtered_limit_filled"] = f.get("limit_filled")
    if "lexical_natural" in r:
        ln = r["lexical_natural"]
        out["lexical_search_over_bm25s_p50_natural"] = ln["ratio_p50_ours_over_bm25s"]
        out["lexical_natural_corpus"] = ln["corpus"]
    if "ingest" in r:
        out["ingest_over_raw_embed"] = r["ingest"]["ingest_over_raw"]
    for mode, prefix in (("http", "http"), ("http_key", "http_key")):
        if mode not in r or "inprocess" not in r:
            continue
        by = {h["clients"]: h for h in r[mode]}
        if 1 in by:
            out[f"{prefix}_p50_over_inprocess_p50"] = round(
                by[1]["p50_ms"] / max(r["inprocess"]["p50_ms"], 1e-9), 2
            )
        if 8 in by and "embed_only" in r:
            out[f"{prefix}_rps8_over_embed_rps8"] = round(
                by[8]["req_per_s"] / max(r["embed_only"]["queries_per_s"], 1e-9), 2
            )
        owner = {h["clients"]: h for h in r.get("http_owner", [])}
        if 1 in by and 1 in owner:
            out[f"{prefix}_p50_over_owner_p50"] = round(
                by[1]["p50_ms"] / max(owner[1]["p50_ms"], 1e-9), 2
            )
    # Where the time goes (no goal of their own): what HTTP adds to the service's own query
    # path, and that path (the database's statements beside the embedding) against the
    # in-process reference.
    svc = {h["clients"]: h for h in r.get("service_inprocess", [])}
    http = {h["clients"]: h for h in r.get("http", [])}
    for c, tag in ((1, "p50"), (8, "rps8")):
        if c not in svc:
            continue
        field = "p50_ms" if c == 1 else "req_per_s"
        if c in http:
            over = http[c][field] / max(svc[c][field], 1e-9)
            out[f"http_{tag}_over_service_{tag}"] = round(over, 2)
        if c == 1 and "inprocess" in r:
            out["service_p50_over_inprocess_p50"] = round(
                svc[1]["p50_ms"] / max(r["inprocess"]["p50_ms"], 1e-9), 2
            )
        if c == 8 and "embed_only" in r:
            out["service_rps8_over_embed_rps8"] = round(
                svc[8]["req_per_s"] / max(r["embed_only"]["queries_per_s"], 1e-9), 2
            )
    # A run with failed requests measured its failures: no ratio from it.
    if (
        r.get("http_evidence")
        and r.get("http_owner_evidence")
        and not r["http_evidence"][0].get("errors")
        and not r["http_owner_evidence"][0].get("errors")
    ):
        out["http_evidence_p50_over_owner_p50"] = round(
            r["http_evidence"][0]["p50_ms"] / max(r["http_owner_evidence"][0]["p50_ms"], 1e-9), 2
        )
    return out


def goals(ratios: dict[str, Any]) -> list[list[Any]]:
    """Rows key, measured, goal, met (None: not measured in this run)."""
    rows = []
    for key, (goal, op) in GOALS.items():
        v = ratios.get(key)
        met = None if v is None else (v <= goal if op == "<=" else v >= goal)
        rows.append([key, v, f"{op} {goal}", {None: "not run", True: "yes", False: "NO"}[met]])
    return rows


def _print(r: dict[str, Any]) -> None:
    load, ann = r["load"], r["ann"]
    print(
        f"{r.get('corpus', 'synthetic')} corpus: {r['nodes']} nodes x {r['dim']} dims, "
        f"{r['queries']} queries"
    )
    print(
        f"COPY {load['copy_seconds']:.1f}s ({load['copy_nodes_per_s']:.0f} nodes/s, lexical "
        f"triggers included); edges {load['edges']} in {load['edges_seconds']:.1f}s"
    )
    print(
        f"HNSW build {load['hnsw_build_seconds']:.1f}s (pgvector, "
        f"{load['parallel_maintenance_workers']} parallel workers, maintenance_work_mem "
        f"{load.get('maintenance_work_mem')}, shared_buffers {load.get('shared_buffers')}), index "
        f"{load['hnsw_index_mb']:.1f} MiB; hnswlib {ann['hnswlib_build_seconds']:.1f}s "
        f"({ann['hnswlib_threads']} threads)"
    )
    for label in ("unfiltered", "filtered_1pct"):
        a = ann[label]
        print(
            f"\nvector search top-10, {label} ({a['filter_nodes']} candidate nodes); exact_search "
            f"p50 {a['exact_search']['p50_ms']:.2f} ms"
        )
        rows = [
            [x["engine"], x["ef_search"], x["recall@10"], x["p50_ms"], x["p95_ms"]]
            for x in [*a["ours"], *a["hnswlib"], a["numpy"]]
        ]
        print(table(rows, ["engine", "ef_search", "recall@10", "p50_ms", "p95_ms"]))
        print(
            table(
                [
                    [
                        m["target_recall"],
                        m.get("ours_ef"),
                        m.get("ours_p50_ms"),
                        m.get("peer_ef"),
                        m.get("peer_p50_ms"),
                        m.get("ratio_ours_over_peer"),
                    ]
                    for m in a["matched"]
                ],
                ["recall>=", "ours ef", "ours p50", "hnswlib ef", "hnswlib p50", "ratio"],
            )
        )
    lx = r["lexical"]
    print(
        f"\nlexical top-10: lexical_search p50 {lx['lexical_search']['p50_ms']:.2f} ms, p95 "
        f"{lx['lexical_search']['p95_ms']:.2f}; bm25s p50 {lx['bm25s']['p50_ms']:.3f} ms, p95 "
        f"{lx['bm25s']['p95_ms']:.3f}; ratio {lx['ratio_p50_ours_over_bm25s']}x; identical "
        f"top-10 {lx['identical_top10']:.0%}"
    )
    for key in (
        "sql_roundtrip_floor",
        "fuse_rrf_2x50",
        "hydrate_10_with_provenance",
        "provenance_walk_10",
    ):
        print(f"{key}: p50 {r[key]['p50_ms']:.2f} ms, p95 {r[key]['p95_ms']:.2f} ms")
    if "ingest" in r:
        i = r["ingest"]
        print(
            f"ingest {i['ingest_nodes_per_s']:.1f} nodes/s vs raw embedder "
            f"{i['raw_embed_nodes_per_s']:.1f} nodes/s ({i['ingest_over_raw']:.0%})"
        )
    if "http" in r:
        if "tenants" in r:
            t = r["tenants"]
            print(
                f"\n{t['projects']} tenants more, Zipf-sized ({t['nodes']} nodes, the largest "
                f"{t['largest']})"
            )
        print("\nGET /memory/query end to end (local embedder, no reranker, one project named)")
        modes = [
            ("service role, anonymous", "http"),
            ("service role, one-project key", "http_key"),
            ("owner (no row-level security)", "http_owner"),
            ("service role, anonymous, evidence list", "http_evidence"),
            ("owner, evidence list", "http_owner_evidence"),
            ("service role, anonymous, in process (no HTTP)", "service_inprocess"),
        ]
        print(
            table(
                [
                    [
                        label,
                        h["clients"],
                        h["requests"],
                        h["errors"],
                        h["p50_ms"],
                        h["p95_ms"],
                        h["req_per_s"],
                        h.get("server_cpu_ms"),
                        h.get("database_cpu_ms"),
                    ]
                    for label, key in modes
                    for h in r.get(key, [])
                ],
                [
                    "as",
                    "clients",
                    "requests",
                    "errors",
                    "p50_ms",
                    "p95_ms",
                    "req/s",
                    "server cpu ms/req",
                    "database cpu ms/req",
                ],
            )
        )
    if "lexical_natural" in r:
        ln = r["lexical_natural"]
        print(
            f"\nlexical top-10 on natural text ({ln['corpus']}, {ln['nodes']} nodes): "
            f"lexical_search p50 {ln['lexical_search']['p50_ms']:.2f} ms; bm25s p50 "
            f"{ln['bm25s']['p50_ms']:.3f} ms; ratio {ln['ratio_p50_ours_over_bm25s']}x; "
            f"identical top-10 {ln['identical_top10']:.0%}"
        )
    if "inprocess" in r:
        print(
            f"same pipeline in process (embed + hnswlib + bm25s + convex fusion): p50 "
            f"{r['inprocess']['p50_ms']:.2f} ms; embedder alone, 8 threads: "
            f"{r['embed_only']['queries_per_s']:.1f} queries/s, "
            f"{r['embed_only']['cpu_ms']:.1f} ms of CPU a query"
        )
    print("\n" + table(goals(r["ratios"]), ["ratio", "measured", "goal", "met"]))
    print("\nratios: " + json.dumps(r["ratios"]))
