"""The default answer on two databases, interleaved question by question: a change's SQL
against the code before it, on the same cluster, data and query vectors, so load from other
work on the machine falls on both sides alike.

Each side runs ``memory.answer`` (the whole default path GET /memory/query runs in the
database: plan, legs, fusion, support, provenance and the evidence list) at the default
levels, limit 10, with the question's vector, as the role in each URL (give the service's
role or a granted reader, so row-level security applies as in a deployment). Reported per
side: evidence recall@10 of the gold L0 turns (with the paired difference and its 95%
interval), the p50 and p95 of the statement's wall time, the median of the per-question
ratios, and the backend's CPU per answer (read from /proc for the server process that
serves the connection: the benchmark must run on the database's machine, as root or as
the server's OS user). Also how many evidence lists are identical.

    python -m poimen_lab.eval.answer_side_by_side --a URL_BEFORE --b URL_AFTER \\
        --data ../shared/data/locomo-dev --vectors /tmp/locomo-vectors.npz --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from poimen_lab.eval.evidence_policies import ANSWER_SQL, _load, vectors
from poimen_lab.eval.fusion_sweep import paired
from poimen_memory.db.connect import connect

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def _cpu_ms(pid: int) -> float:
    """User plus system CPU of a process so far, in ms (fields 14 and 15 of its stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def run(
    urls: dict[str, str],
    queries: list[dict[str, Any]],
    gold: dict[str, set[str]],
    vecs: dict[str, np.ndarray[Any, Any]],
    k: int,
) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {side: {} for side in urls}
    conns: dict[str, psycopg.Connection[Any]] = {
        side: connect(url, autocommit=True) for side, url in urls.items()
    }
    try:
        pids = {side: c.info.backend_pid for side, c in conns.items()}
        order = list(urls)
        for i, qy in enumerate(queries):
            params = {
                "text": qy["text"],
                "vec": "[" + ",".join(f"{x:.7g}" for x in vecs[qy["id"]]) + "]",
                "project": qy["project"],
                "k": k,
            }
            g = gold[qy["id"]]
            for side in order if i % 2 == 0 else order[::-1]:
                cpu0 = _cpu_ms(pids[side])
                t0 = time.perf_counter()
                ids, _ = conns[side].execute(ANSWER_SQL, params).fetchone() or ([], [])
                ms = (time.perf_counter() - t0) * 1000
                out[side][qy["id"]] = {
                    "evidence_recall@10": len(g & set(ids)) / len(g),
                    "latency_ms": ms,
                    "cpu_ms": _cpu_ms(pids[side]) - cpu0,
                    "evidence": list(ids),
                }
    finally:
        for c in conns.values():
            c.close()
    return out


def report(per: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    a, b = list(per)
    ids = list(per[a])

    def col(side: str, key: str) -> list[float]:
        return [float(per[side][i][key]) for i in ids]

    summary: dict[str, Any] = {"questions": len(ids)}
    for side in (a, b):
        lat = col(side, "latency_ms")
        summary[side] = {
            "evidence_recall@10": round(float(np.mean(col(side, "evidence_recall@10"))), 4),
            "p50_ms": round(statistics.median(lat), 2),
            "p95_ms": round(float(np.percentile(lat, 95)), 2),
            # the kernel counts CPU in ticks (10 ms): the mean over many answers is the estimate
            "cpu_ms_mean": round(float(np.mean(col(side, "cpu_ms"))), 2),
        }
    summary["recall_diff_b_minus_a"] = paired(
        col(b, "evidence_recall@10"), col(a, "evidence_recall@10")
    )
    summary["p50_ratio_b_over_a"] = round(summary[b]["p50_ms"] / summary[a]["p50_ms"], 3)
    summary["median_per_question_ratio"] = round(
        statistics.median(
            x / y for x, y in zip(col(b, "latency_ms"), col(a, "latency_ms"), strict=True)
        ),
        3,
    )
    summary["cpu_ratio_b_over_a"] = round(
        summary[b]["cpu_ms_mean"] / max(summary[a]["cpu_ms_mean"], 1e-9), 3
    )
    summary["identical_evidence"] = sum(per[a][i]["evidence"] == per[b][i]["evidence"] for i in ids)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="database with the SQL before the change")
    p.add_argument("--b", required=True, help="database with the SQL after the change")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--vectors", type=Path, required=True, help="query vectors (made once)")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--every", type=int, default=1, help="every n-th question only")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    queries, gold = _load(args.data)
    queries = queries[:: args.every]
    vecs = vectors(args.vectors, queries)
    per = run({"a": args.a, "b": args.b}, queries, gold, vecs, args.k)
    summary = report(per)
    a, b = summary["a"], summary["b"]
    print("| side | evidence recall@10 | p50 ms | p95 ms | CPU ms / answer |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("a (before)", a), ("b (after)", b)):
        print(
            f"| {name} | {s['evidence_recall@10']:.3f} | {s['p50_ms']:.1f} | "
            f"{s['p95_ms']:.1f} | {s['cpu_ms_mean']:.1f} |"
        )
    d = summary["recall_diff_b_minus_a"]
    print(
        f"{summary['questions']} questions; recall b - a {d['diff']:+.4f} "
        f"[{d['ci95_low']:+.4f}, {d['ci95_high']:+.4f}]; p50 b/a {summary['p50_ratio_b_over_a']}; "
        f"median per-question ratio {summary['median_per_question_ratio']}; CPU b/a "
        f"{summary['cpu_ratio_b_over_a']}; identical evidence lists "
        f"{summary['identical_evidence']}/{summary['questions']}"
    )
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "per_query": per}, indent=1))


if __name__ == "__main__":
    main()
