"""Recency as a ranking signal, measured (docs/benchmarks.md, "Recency").

Every LoCoMo dev question is answered through memory.answer (the one planner and
executor: the default path, levels L1,L2, limit 10, the policy's evidence list) once with
recency off and once per half-life, the policy changed between passes with
memory.set_policy and reset after. A question is asked at the end of its conversation:
reference_time is the newest timestamp of its project, which is what "now" is to the
people talking. Its query vector is embedded once (memory.embed) and reused by every pass.
Reported per category: evidence recall@10 (the gold L0 turns among the answer's cited
evidence), with a paired bootstrap interval of each setting's change against off.

    python -m poimen_lab.eval.recency --url URL --data ../shared/data/locomo-dev
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
from pgvector.psycopg import register_vector

from poimen_lab.eval.floor import boot

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


def cited(conn: psycopg.Connection[Any], q: dict[str, Any], origin: Any) -> set[str]:
    row = conn.execute(
        "SELECT r -> 'evidence' FROM memory.answer(%(t)s, %(v)s, %(p)s, ARRAY['L1','L2'], 10,"
        " reference_time => %(o)s) r",
        {"t": q["text"], "v": q["vec"], "p": q["project"], "o": origin},
    ).fetchone()
    assert row is not None
    return {e["external_id"] or e["source"] for e in row[0] or []}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--data", type=Path, required=True, help="the locomo-dev folder")
    ap.add_argument("--half-lives", default="7,30,180", help="days, comma-separated")
    ap.add_argument("--weight", type=float, default=0.5)
    ap.add_argument("--limit-queries", type=int)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    gold: dict[str, set[str]] = defaultdict(set)
    for line in (a.data / "qrels.jsonl").read_text().splitlines():
        j = json.loads(line)
        gold[j["query_id"]].add(j["node_id"])
    qs = [json.loads(x) for x in (a.data / "queries.jsonl").read_text().splitlines()]
    qs = [q for q in qs if q["id"] in gold][: a.limit_queries]
    settings: list[float | None] = [None, *(float(x) for x in a.half_lives.split(","))]
    recall: dict[str, list[float]] = {}
    with psycopg.connect(a.url, autocommit=True) as conn:
        register_vector(conn)
        origins: dict[str, Any] = dict(
            conn.execute(
                "SELECT p.name, max(n.ts) FROM memory.nodes n JOIN memory.projects p"
                " ON p.id = n.project_id GROUP BY p.name"
            ).fetchall()
        )
        for q in qs:
            row = conn.execute("SELECT memory.embed(%s)", (q["text"],)).fetchone()
            assert row is not None
            q["vec"] = row[0]
        try:
            conn.execute("SELECT memory.set_policy('recency_weight', %s)", (str(a.weight),))
            for h in settings:
                key = "off" if h is None else f"{h:g}"
                if h is None:
                    conn.execute("SELECT memory.reset_policy('recency_half_life_days')")
                else:
                    conn.execute(
                        "SELECT memory.set_policy('recency_half_life_days', %s)", (f"{h:g}",)
                    )
                recall[key] = [
                    len(cited(conn, q, origins[q["project"]]) & gold[q["id"]]) / len(gold[q["id"]])
                    for q in qs
                ]
        finally:
            conn.execute("SELECT memory.reset_policy('recency_half_life_days')")
            conn.execute("SELECT memory.reset_policy('recency_weight')")
    by_cat: dict[int, list[int]] = defaultdict(list)
    for i, q in enumerate(qs):
        by_cat[int(q.get("category", 0))].append(i)
    groups = {f"{c} {CATEGORIES.get(c, '?')}": ix for c, ix in sorted(by_cat.items())}
    groups["all"] = list(range(len(qs)))
    report: dict[str, Any] = {"weight": a.weight, "questions": len(qs), "groups": {}}
    for name, ix in groups.items():
        g: dict[str, Any] = {"n": len(ix)}
        for key, r in recall.items():
            g[key] = round(sum(r[i] for i in ix) / len(ix), 4)
            if key != "off":
                lo, hi = boot([r[i] - recall["off"][i] for i in ix])
                g[f"{key} change"] = [round(lo, 4), round(hi, 4)]
        report["groups"][name] = g
    print(json.dumps(report, indent=1))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
