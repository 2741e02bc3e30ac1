"""Optional parts of `poimen-memory eval`: the bm25s peer (--bm25s) and the fusion sweep
(--sweep), both on the stage SQL functions rather than the HTTP query path."""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg

from poimen_core.optimizer import QueryOptimizerError, optimize_query
from poimen_lab.bm25_peer import PgLexemeBM25
from poimen_lab.eval.data import EvalData, Query
from poimen_lab.eval.fusion_sweep import fetch, plot, sweep
from poimen_lab.eval.runner import Corpus
from poimen_lab.measures import evaluate, percentile
from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder
from poimen_memory.progress import Progress


def _lat(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(ms, 50), 3), "p95_ms": round(percentile(ms, 95), 3)}


def bm25_comparison(
    conn: psycopg.Connection[Any],
    corpus: Corpus,
    data: EvalData,
    levels: tuple[str, ...],
    limit: int,
    depth: int,
) -> dict[str, Any]:
    """bm25s and memory.lexical_search on identical lexemes: quality, agreement, latency."""
    queries = data.judged
    peer = PgLexemeBM25(conn, sorted({r.project for r in data.records}))
    lexemes = peer.query_lexemes([qy.text for qy in queries])
    ours: dict[str, list[str]] = {}
    theirs: dict[str, list[str]] = {}
    ours_ms: list[float] = []
    theirs_ms: list[float] = []
    lv = None if set(levels) == {"L0", "L1", "L2"} else list(levels)
    for qy, lx in zip(queries, lexemes, strict=True):
        t0 = time.perf_counter()
        rows = conn.execute(
            q("lexical_search"),
            {
                "query": qy.text,
                "project": qy.project,
                "levels": lv,
                "k": depth,
                "since": None,
                "before": None,
            },
        ).fetchall()
        ours_ms.append((time.perf_counter() - t0) * 1000)
        ours[qy.id] = [corpus.by_db_id[r[0]] for r in rows if r[0] in corpus.by_db_id]
        t0 = time.perf_counter()
        ids = peer.search(lx, qy.project, lv, depth)
        theirs_ms.append((time.perf_counter() - t0) * 1000)
        theirs[qy.id] = [corpus.by_db_id[i] for i in ids if i in corpus.by_db_id]
    qrels = {qy.id: data.qrels[qy.id] for qy in queries}
    names = ("ndcg@10", "recall@10", "recall@100", "mrr@10")
    m_ours = evaluate(qrels, {k: v[:limit] for k, v in ours.items()}, names[:2] + names[3:])
    m_ours["recall@100"] = evaluate(qrels, ours, ["recall@100"])["recall@100"]
    m_theirs = evaluate(qrels, {k: v[:limit] for k, v in theirs.items()}, names[:2] + names[3:])
    m_theirs["recall@100"] = evaluate(qrels, theirs, ["recall@100"])["recall@100"]
    same10 = sum(1 for qid in ours if ours[qid][:10] == theirs[qid][:10])
    overlap = [
        len(set(ours[qid][:10]) & set(theirs[qid][:10])) / max(len(ours[qid][:10]), 1)
        for qid in ours
    ]
    lat_ours, lat_theirs = _lat(ours_ms), _lat(theirs_ms)
    return {
        "postgres_sql": {**{k: round(v, 4) for k, v in m_ours.items()}, **lat_ours},
        "bm25s": {**{k: round(v, 4) for k, v in m_theirs.items()}, **lat_theirs},
        "identical_top10": round(same10 / len(ours), 4),
        "overlap@10": round(sum(overlap) / len(overlap), 4),
        "p50_ratio_ours_over_bm25s": round(lat_ours["p50_ms"] / max(lat_theirs["p50_ms"], 1e-9), 2),
        "bm25s_index_seconds": round(peer.index_seconds, 3),
        "depth": depth,
        "note": "latency: ours = one lexical_search(k=depth) round trip over the Unix socket; "
        "bm25s = in-process retrieve on pre-fetched lexemes (numpy backend)",
    }


def _group(qy: Query, by: str) -> str:
    """The sweep's per-query group: the query's category, or the optimizer's question type."""
    if by == "category" and qy.category is not None:
        return f"category {qy.category}"
    try:
        return optimize_query(qy.text).question_type.value
    except QueryOptimizerError:
        return "invalid"


def run_extras(
    conn: psycopg.Connection[Any],
    embedder: Embedder,
    corpus: Corpus,
    data: EvalData,
    levels: tuple[str, ...],
    args: argparse.Namespace,
    *,
    default: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {}}
    if args.bm25s:
        cmp_ = bm25_comparison(conn, corpus, data, levels, args.limit, args.depth)
        out["bm25_comparison"] = cmp_
        out["modes"]["bm25s"] = cmp_["bm25s"]
    if args.sweep:
        with Progress(
            len(data.judged), "sweep: candidates", "queries", enabled=not args.quiet
        ) as bar:
            vectors = {qy.id: embedder.embed_query(qy.text) for qy in data.judged}
            cands = fetch(conn, data.judged, vectors, levels, lambda: bar.update(1))
        groups = {qy.id: _group(qy, args.sweep_groups) for qy in data.judged}
        result = sweep(conn, cands, data.qrels, corpus.by_db_id, groups, default=default)
        out["sweep"] = result
        plot(args.sweep, result, f"{data.dataset}: fusion sweep over {result['queries']} queries")
    return out
