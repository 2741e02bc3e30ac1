"""`poimen-memory eval`: retrieval quality and cost on a labelled data set, through the real
query path (see eval_runner.py for the path each mode takes)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from poimen_lab.eval.data import EvalData, EvalInputError, load
from poimen_lab.eval.fusion_sweep import default_config
from poimen_lab.eval.runner import DEEP_PATHS, EVIDENCE_KS, MODES, Corpus, Outcome, Runner
from poimen_lab.eval.scores import per_query_scores, score_mode
from poimen_lab.measures import percentile
from poimen_lab.report import bar_chart, category_table, modes_table, table
from poimen_memory.db.connect import connect, database_url
from poimen_memory.db.migrate import migrate
from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.ingest.nodes import NodeRecord
from poimen_memory.ingest.writer import ingest
from poimen_memory.progress import Progress
from poimen_memory.retrieval.pipeline import LEVELS
from poimen_memory.retrieval.policy import aread_policy, read_policy
from poimen_memory.settings import Settings

DEFAULT_MODES = ("lexical", "semantic", "exact", "hybrid", "hybrid-convex", "cascade", "auto")


def _modes(raw: str) -> list[str]:
    names = [m.strip() for m in raw.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))


def _levels(raw: str) -> tuple[str, ...]:
    levels = tuple(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip()))
    if not levels or any(lv not in LEVELS for lv in levels):
        raise argparse.ArgumentTypeError("levels must be a comma-separated subset of L0,L1,L2")
    return levels


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "eval",
        help="measure retrieval quality and latency on a labelled data set",
        description=__doc__,
    )
    p.add_argument("--nodes", type=Path, required=True, help="nodes.jsonl (ingested first)")
    p.add_argument("--queries", type=Path, required=True, help="queries.jsonl")
    p.add_argument("--qrels", type=Path, required=True, help="qrels.jsonl (relevant node ids)")
    p.add_argument(
        "--qrels-sessions",
        type=Path,
        help="gold L2 sessions for --evidence (default: qrels_sessions.jsonl beside "
        "--qrels, if present)",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        help=f"comma-separated, from {', '.join(MODES)} "
        f"(default: {','.join(DEFAULT_MODES)}, plus hybrid-rerank when POIMEN_RERANK_URL "
        "is set)",
    )
    p.add_argument(
        "--evidence",
        action="store_true",
        help="also query levels L1,L2 and measure the L0 evidence their provenance "
        "cites (evidence_recall@5/@10, session_recall); default --levels L0",
    )
    p.add_argument(
        "--levels",
        type=_levels,
        help="level filter of the ranked runs (default L0,L1,L2; L0 with --evidence)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=10,
        help="results per real-path query (<= POIMEN_MAX_LIMIT; default 10)",
    )
    p.add_argument("--depth", type=int, default=100, help="depth of the recall@100 runs")
    p.add_argument("--limit-queries", type=int, help="only the first N queries")
    p.add_argument("--dataset", help="name in the report (default: the nodes file's folder)")
    p.add_argument(
        "--embed-sample",
        type=int,
        default=256,
        help="nodes embedded alone to measure raw embedder throughput (0: skip)",
    )
    p.add_argument(
        "--bm25s",
        action="store_true",
        help="add a bm25s row: the bm25s library on PostgreSQL's own lexemes",
    )
    p.add_argument(
        "--sweep",
        type=Path,
        metavar="OUT.png",
        help="also sweep RRF k, candidate depths and convex weights; chart to OUT.png",
    )
    p.add_argument(
        "--sweep-groups",
        choices=["category", "type"],
        default="category",
        help="break the sweep down by the queries' category (default, when they have one) or "
        "by the optimizer's question type (what the fusion_by_type policy selects on)",
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="bar chart of the modes")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_eval)


def _url(s: Settings) -> str:
    return database_url(s, start=True)


def _corpus(conn: psycopg.Connection[Any], records: list[NodeRecord]) -> Corpus:
    by_sha = {r.sha256.hex(): r.external_id for r in records if r.external_id is not None}
    shas = [bytes.fromhex(h) for h in by_sha]
    by_db_id: dict[int, str] = {}
    for i in range(0, len(shas), 5000):
        for sha, nid in conn.execute(q("stored_hashes"), {"shas": shas[i : i + 5000]}):
            by_db_id[nid] = by_sha[bytes(sha).hex()]
    parents = {r.external_id: r.parents for r in records if r.external_id is not None}
    l2_of: dict[str, set[str]] = {}
    for r in records:
        if r.level != "L2" or r.external_id is None:
            continue
        stack, seen = list(r.parents), set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            l2_of.setdefault(node, set()).add(r.external_id)
            stack.extend(parents.get(node, ()))
    return Corpus(by_sha, by_db_id, l2_of)


def _ingest(
    conn: psycopg.Connection[Any],
    data: EvalData,
    embedder: Embedder,
    s: Settings,
    sample: int,
    quiet: bool,
) -> dict[str, Any]:
    migrate(conn, s.plpython_root)
    load_fn = getattr(embedder, "load", None)
    if callable(load_fn):
        load_fn()  # model loading is neither ingest nor embedding throughput
    report = ingest(
        conn,
        data.records,
        embedder,
        batch_size=s.ingest_batch,
        embed_group=s.ingest_embed_group,
        progress=not quiet,
    )
    out: dict[str, Any] = {
        "nodes": len(data.records),
        "inserted": report.inserted,
        "duplicates": report.duplicates,
        "seconds": round(report.seconds, 2),
    }
    if report.inserted:
        out["nodes_per_s"] = round(report.rate, 2)
        out["embed_nodes_per_s_in_ingest"] = round(report.inserted / report.embed_seconds, 2)
    if sample > 0:
        texts = [
            r.text for r in random.Random(0).sample(data.records, min(sample, len(data.records)))
        ]
        t0 = time.perf_counter()
        embedder.embed_documents(texts)
        out["raw_embed_sample"] = len(texts)
        out["raw_embed_nodes_per_s"] = round(len(texts) / (time.perf_counter() - t0), 2)
    return out


async def _run_all(
    url: str,
    s: Settings,
    embedder: Embedder,
    corpus: Corpus,
    data: EvalData,
    modes: list[str],
    args: argparse.Namespace,
    levels: tuple[str, ...],
) -> dict[str, dict[str, Outcome]]:
    from dataclasses import replace

    from poimen_memory.services import open_services

    small = replace(s, pool_min=2, pool_max=4, embedding=replace(s.embedding, cache_size=0))
    # The one wiring function, twice: without the reranker, and (for hybrid-rerank) with it.
    async with (
        open_services(small, url=url, embedder=embedder, rerank=False, wait=True) as svc,
        open_services(small, url=url, embedder=embedder, wait=True) as with_rerank,
    ):
        async with svc.pool.connection() as conn:
            policy = await aread_policy(conn)
        rr = with_rerank.retriever if with_rerank.reranker else None
        runner = Runner(
            svc.pool,
            embedder,
            s,
            corpus,
            levels=levels,
            limit=args.limit,
            depth=args.depth,
            retriever=svc.retriever,
            policy=policy,
            rerank_retriever=rr,
        )
        ev_k = max(EVIDENCE_KS) if args.evidence else 0
        for mode in modes:  # warm-up: connections, plans and caches; not measured
            for qy in data.queries[:3]:
                await runner.run(mode, qy)
        results: dict[str, dict[str, Outcome]] = {}
        with Progress(
            len(modes) * len(data.judged), "eval", "queries", enabled=not args.quiet
        ) as bar:
            for mode in modes:
                results[mode] = {}
                for qy in data.judged:
                    results[mode][qy.id] = await runner.run(mode, qy, evidence_k=ev_k)
                    bar.update(1)
        return results


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        if args.evidence and args.qrels_sessions is None:
            beside = args.qrels.with_name("qrels_sessions.jsonl")
            args.qrels_sessions = beside if beside.is_file() else None
        data = load(
            args.nodes,
            args.queries,
            args.qrels,
            session_qrels=args.qrels_sessions,
            dataset=args.dataset,
            limit_queries=args.limit_queries,
        )
    except EvalInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for w in data.warnings:
        print(f"warning: {w}", file=sys.stderr)
    s = Settings.from_env()
    if not 1 <= args.limit <= s.max_limit:
        print(f"error: --limit must be 1..{s.max_limit}", file=sys.stderr)
        return 2
    rerank = s.rerank.url is not None
    modes: list[str] = args.modes or [*DEFAULT_MODES, *(["hybrid-rerank"] if rerank else [])]
    if "hybrid-rerank" in modes and not rerank:
        print("warning: hybrid-rerank skipped: POIMEN_RERANK_URL is not set", file=sys.stderr)
        modes.remove("hybrid-rerank")
    levels: tuple[str, ...] = args.levels or (("L0",) if args.evidence else LEVELS)
    embedder = build_embedder(s.embedding)
    url = _url(s)
    with connect(url, autocommit=True) as conn:
        ingest_info = _ingest(conn, data, embedder, s, args.embed_sample, args.quiet)
        corpus = _corpus(conn, data.records)
        policy = read_policy(conn)
    if not args.quiet:
        print(f"ingest: {json.dumps(ingest_info)}", file=sys.stderr)
    outcomes = asyncio.run(_run_all(url, s, embedder, corpus, data, modes, args, levels))

    result: dict[str, Any] = {"dataset": data.dataset, "queries": len(data.judged), "modes": {}}
    by_category: dict[str, dict[str, dict[str, float]]] = {}
    strategies: dict[str, dict[str, int]] = {}
    stages: dict[str, dict[str, float]] = {}
    queries: dict[str, dict[str, dict[str, float]]] = {}
    for mode, outs in outcomes.items():
        overall, cats = score_mode(data, outs, corpus.l2_of, l0_only=levels == ("L0",))
        queries[mode] = per_query_scores(data, outs)
        result["modes"][mode] = {k: round(v, 4) for k, v in overall.items()}
        if cats:
            by_category[mode] = {c: {k: round(v, 4) for k, v in m.items()} for c, m in cats.items()}
        counts: dict[str, int] = {}
        for o in outs.values():
            counts[o.strategy or "error"] = counts.get(o.strategy or "error", 0) + 1
        strategies[mode] = counts
        stage_names = sorted({k for o in outs.values() for k in o.stages})
        if stage_names:
            stages[mode] = {
                k: round(percentile([o.stages.get(k, 0.0) for o in outs.values()], 50), 3)
                for k in stage_names
            }
    extra: dict[str, Any] = {}
    if args.bm25s or args.sweep:
        from poimen_lab.eval.extras import run_extras

        with connect(url, autocommit=True) as conn:
            extra = run_extras(
                conn, embedder, corpus, data, levels, args, default=default_config(policy)
            )
        result["modes"].update(extra.pop("modes", {}))
    result.update(
        {
            "by_category": by_category,
            "strategies": strategies,
            "stage_p50_ms": stages,
            "ingest": ingest_info,
            "paths": {m: DEEP_PATHS.get(m, "none") for m in result["modes"]},
            "settings": {
                "levels": list(levels),
                "limit": args.limit,
                "depth": args.depth,
                "policy": dataclasses.asdict(policy),
                "embedder": embedder.model_name,
                "evidence_ks": list(EVIDENCE_KS),
            },
            "warnings": data.warnings,
            "per_query": queries,
            "categories": {qy.id: qy.category for qy in data.judged},
            **extra,
        }
    )
    _print(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        bar_chart(args.plot, result["modes"], f"{data.dataset}: {len(data.judged)} queries")
    return 0


def _print(result: dict[str, Any]) -> None:
    print(
        f"{result['dataset']}: {result['queries']} judged queries, levels "
        f"{','.join(result['settings']['levels'])}"
    )
    print(modes_table(result["modes"]))
    for measure in ("evidence_recall@10", "l0_recall@10", "ndcg@10"):
        t = category_table(result["by_category"], measure) if result["by_category"] else None
        if t:
            print()
            print(t)
    sweep = result.get("sweep")
    if sweep:
        print()
        print("fusion sweep, best by ndcg@10: " + json.dumps(sweep["best"]))
        rows = [
            [label, d["diff"], d["ci95_low"], d["ci95_high"]]
            for label, d in sweep["vs_default_ndcg@10"].items()
        ]
        print(f"\nnDCG@10 minus the default's ({sweep['default']}), paired bootstrap 95% CI")
        print(table(rows, ["configuration", "diff", "ci95_low", "ci95_high"]))
