"""The default answer with two embedding models, interleaved question by question (issue 45).

Each database holds the same data embedded with its own model (memory.embedding_model names
it: MiniLM or e5). For every question, on each side in turn (the order alternating), the
side's local model embeds the question in this process, then ``memory.answer`` (the whole
default path GET /memory/query runs in the database) answers it with that vector, as the
role in the URL (give a member of the service role, so row-level security applies as in a
deployment; the session asserts every project, as the service's ingest does).
Load from other work on the machine falls on both sides alike.

Reported per side: the p50 and p95 of the whole (embedding plus answer) and of the
embedding alone, and CPU per query: this process's CPU for the embedding (time.process_time;
the embedder runs nothing else) plus the backend's for the answer (read from /proc, as
answer_side_by_side does: run it on the database's machine, as root or the server's OS
user). With ``--evidence`` also evidence recall@10 of the gold L0 turns (LoCoMo), with the
paired difference and its 95% interval; otherwise the answer is asked at level L0 (SciFact:
every node is L0) and only the costs are reported.

    python -m poimen_lab.eval.models_side_by_side --a URL_MINILM --b URL_E5 \\
        --data ../shared/data/locomo-dev --evidence --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from poimen_core.vocabulary import E5_MODEL, LOCAL_MODEL
from poimen_lab.eval.answer_side_by_side import _cpu_ms
from poimen_lab.eval.fusion_sweep import paired
from poimen_memory.db import tenant
from poimen_memory.db.connect import connect
from poimen_memory.embedders.base import Embedder

ANSWER_SQL = """
SELECT coalesce((SELECT array_agg(e ->> 'external_id' ORDER BY (e ->> 'rank')::integer)
                 FROM jsonb_array_elements(a -> 'evidence') e), '{}')
FROM memory.answer(query => %(text)s, query_embedding => %(vec)s::vector,
                   project => %(project)s, k => 10, levels => %(levels)s) a
"""


def _embedder(model: str) -> Embedder:
    if model == E5_MODEL:
        from poimen_memory.embedders.e5 import E5Embedder

        return E5Embedder()
    if model == LOCAL_MODEL:
        from poimen_memory.embedders.local import LocalEmbedder

        return LocalEmbedder()
    raise SystemExit(f"no local embedder for the database's model {model!r}")


def _load(data: Path, queries: str, qrels: str) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    rows = [json.loads(x) for x in (data / queries).read_text().splitlines() if x]
    gold: dict[str, set[str]] = {}
    for line in (data / qrels).read_text().splitlines():
        if line:
            r = json.loads(line)
            gold.setdefault(str(r["query_id"]), set()).add(r["node_id"])
    return [qy for qy in rows if gold.get(str(qy["id"]))], gold


def run(
    urls: dict[str, str],
    queries: list[dict[str, Any]],
    gold: dict[str, set[str]],
    evidence: bool,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, str], dict[str, dict[str, dict[str, Any]]]]:
    conns = {side: connect(url, autocommit=True) for side, url in urls.items()}
    for c in conns.values():
        # As the service's ingest and drain connections do: under row-level security (a
        # member of the service role) the session then sees every project.
        tenant.assert_for_session(c, tenant.ALL_PROJECTS)
    out: dict[str, dict[str, dict[str, Any]]] = {side: {} for side in urls}
    try:
        models: dict[str, str] = {}
        for side, c in conns.items():
            row = c.execute("SELECT model FROM memory.embedding_model").fetchone()
            models[side] = row[0] if row else "(none)"
        embedders = {side: _embedder(m) for side, m in models.items()}
        for e in embedders.values():
            getattr(e, "load", lambda: None)()
            e.embed_query("warm-up")
        pids = {side: c.info.backend_pid for side, c in conns.items()}
        order = list(urls)
        levels = ["L1", "L2"] if evidence else ["L0"]
        for i, qy in enumerate(queries):
            for side in order if i % 2 == 0 else order[::-1]:
                t0, c0 = time.perf_counter(), time.process_time()
                vec = embedders[side].embed_query(qy["text"])
                t1, c1 = time.perf_counter(), time.process_time()
                b0 = _cpu_ms(pids[side])
                params = {
                    "text": qy["text"],
                    "vec": "[" + ",".join(f"{x:.7g}" for x in vec) + "]",
                    "project": qy.get("project"),
                    "levels": levels,
                }
                row = conns[side].execute(ANSWER_SQL, params).fetchone()
                t2 = time.perf_counter()
                ids = set(row[0]) if row else set()
                g = gold[str(qy["id"])]
                out[side][str(qy["id"])] = {
                    "embed_ms": (t1 - t0) * 1000,
                    "total_ms": (t2 - t0) * 1000,
                    "embed_cpu_ms": (c1 - c0) * 1000,
                    "cpu_ms": (c1 - c0) * 1000 + _cpu_ms(pids[side]) - b0,
                    "evidence_recall@10": len(g & ids) / len(g),
                }
            if progress is not None:
                progress(i + 1)
        for e in embedders.values():
            e.close()
    finally:
        for c in conns.values():
            c.close()
    return models, out


def report(
    models: dict[str, str], per: dict[str, dict[str, dict[str, Any]]], evidence: bool
) -> dict[str, Any]:
    a, b = list(per)
    ids = list(per[a])

    def col(side: str, key: str) -> list[float]:
        return [float(per[side][i][key]) for i in ids]

    summary: dict[str, Any] = {"questions": len(ids), "models": models}
    for side in (a, b):
        total, emb = col(side, "total_ms"), col(side, "embed_ms")
        summary[side] = {
            "p50_ms": round(statistics.median(total), 2),
            "p95_ms": round(float(np.percentile(total, 95)), 2),
            "embed_p50_ms": round(statistics.median(emb), 2),
            # process_time and the kernel's ticks are coarse: the mean over many is the estimate
            "cpu_ms_mean": round(float(np.mean(col(side, "cpu_ms"))), 2),
            "embed_cpu_ms_mean": round(float(np.mean(col(side, "embed_cpu_ms"))), 2),
        }
        if evidence:
            summary[side]["evidence_recall@10"] = round(
                float(np.mean(col(side, "evidence_recall@10"))), 4
            )
    summary["p50_ratio_b_over_a"] = round(summary[b]["p50_ms"] / summary[a]["p50_ms"], 3)
    summary["cpu_ratio_b_over_a"] = round(
        summary[b]["cpu_ms_mean"] / max(summary[a]["cpu_ms_mean"], 1e-9), 3
    )
    if evidence:
        summary["recall_diff_b_minus_a"] = paired(
            col(b, "evidence_recall@10"), col(a, "evidence_recall@10")
        )
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="database embedded with one model")
    p.add_argument("--b", required=True, help="the same data embedded with the other")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--queries", default="queries.jsonl")
    p.add_argument("--qrels", default="qrels.jsonl")
    p.add_argument("--evidence", action="store_true", help="LoCoMo: default levels, recall")
    p.add_argument("--every", type=int, default=1, help="every n-th question only")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    queries, gold = _load(args.data, args.queries, args.qrels)
    queries = queries[:: args.every]
    models, per = run({"a": args.a, "b": args.b}, queries, gold, args.evidence)
    summary = report(models, per, args.evidence)
    print("| side | model | p50 ms | p95 ms | embed p50 ms | CPU ms / query | embed CPU ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for side in ("a", "b"):
        s = summary[side]
        print(
            f"| {side} | {models[side]} | {s['p50_ms']:.1f} | {s['p95_ms']:.1f} | "
            f"{s['embed_p50_ms']:.1f} | {s['cpu_ms_mean']:.1f} | {s['embed_cpu_ms_mean']:.1f} |"
        )
    print(json.dumps({k: v for k, v in summary.items() if k not in ("a", "b")}))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "per_query": per}, indent=1) + "\n")


if __name__ == "__main__":
    main()
