"""How much of a sentence's words should vouch for a candidate below the relevance floor
(issue 45; docs/benchmarks.md, "A floor on by default": the choice of floor_term_share).

Every LoCoMo dev question is answered once at level L0 (k 10, no floor, no evidence list)
through memory.answer, and every off-topic question (data/offtopic.txt) once in each
LoCoMo project at the default levels; each result keeps its cosine and the share of the
question's terms (its English lexemes, as the planner's plan.floor.terms) its node holds.
A floor t with a share s then keeps the results with cosine >= t or share >= s, in order:
what memory._after_fusion does for a sentence (a query longer than floor_keyword_words)
over a fused list k deep. Reported per (t, s): L0 recall@10 on categories 1-4 and all, and
the share of off-topic answers left empty.

With --scifact, SciFact's training claims instead (each through memory.answer over project
scifact, L0, k 10, no floor), and nDCG@10 without a floor against the policy's rule
(min_cosine, floor_keyword_words, floor_term_share as the database holds them), with a
95% paired bootstrap interval of the change and the no-floor mean's own interval.

    python -m poimen_lab.eval.floor_words --url URL --data ../shared/data/locomo-dev
    python -m poimen_lab.eval.floor_words --url URL --data ../shared/data/scifact --scifact
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from poimen_lab.eval.fusion_sweep import paired
from poimen_lab.eval.offtopic import questions
from poimen_lab.measures import per_query

PROJECTS = ("conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44")

ROWS_SQL = """
SELECT r ->> 'external_id', (r ->> 'query_score')::float8,
       cardinality(ARRAY(SELECT unnest(t.terms) INTERSECT SELECT unnest(tsvector_to_array(n.tsv))))
         ::float8 / greatest(cardinality(t.terms), 1)
FROM memory.answer(query => %(q)s, project => %(p)s, levels => %(lv)s, k => 10,
                   min_cosine => -1, evidence => 0) a,
     jsonb_array_elements(a -> 'results') r
JOIN memory.nodes n ON n.id = (r ->> 'node_id')::bigint,
     LATERAL (SELECT tsvector_to_array(to_tsvector('english', %(q)s)) AS terms) t
ORDER BY (r ->> 'rank')::integer
"""

Row = tuple[str, float | None, float]


def _kept(rows: list[Row], t: float, s: float) -> list[Row]:
    return [r for r in rows if r[1] is None or r[1] >= t or r[2] >= s]


def scifact(url: str, data: Path, limit: int | None = None) -> dict[str, Any]:
    """nDCG@10 of SciFact's training claims without the floor and with the policy's."""
    qrels: dict[str, dict[str, int]] = defaultdict(dict)
    for line in (data / "qrels-train.jsonl").read_text().splitlines():
        if line:
            r = json.loads(line)
            qrels[r["query_id"]][r["node_id"]] = int(r.get("score", 1))
    qs = [json.loads(x) for x in (data / "queries-train.jsonl").read_text().splitlines() if x]
    qs = [q for q in qs if q["id"] in qrels][:limit]
    off: dict[str, list[str]] = {}
    on: dict[str, list[str]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        pol = conn.execute(
            "SELECT memory._policy_value('min_cosine')::float8, "
            "memory._policy_value('floor_keyword_words')::integer, "
            "memory._policy_value('floor_term_share')::float8"
        ).fetchone()
        assert pol is not None
        t, words, share = pol
        for q in qs:
            rows = conn.execute(
                ROWS_SQL, {"q": q["text"], "p": q["project"], "lv": ["L0"]}
            ).fetchall()
            n = conn.execute(
                "SELECT cardinality(tsvector_to_array(to_tsvector('english', %s)))", (q["text"],)
            ).fetchone()
            terms = n[0] if n else 0
            # the plan's keep_with_terms, as memory._plan computes it
            need = 1 if len(q["text"].split()) <= words else max(1, -(-terms * share // 1))
            off[q["id"]] = [r[0] for r in rows]
            on[q["id"]] = [
                r[0]
                for r in rows
                if r[1] is None or r[1] >= t or (terms and round(r[2] * terms) >= need)
            ]
    judged = {q["id"]: qrels[q["id"]] for q in qs}
    a = per_query(judged, off, "ndcg@10")
    b = per_query(judged, on, "ndcg@10")
    ids = sorted(a)
    va, vb = [a[i] for i in ids], [b[i] for i in ids]
    rng = np.random.default_rng(0)
    arr = np.asarray(va)
    means = arr[rng.integers(0, len(arr), (2000, len(arr)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {
        "claims": len(ids),
        "policy": {"min_cosine": t, "floor_keyword_words": words, "floor_term_share": share},
        "ndcg@10_no_floor": round(sum(va) / len(va), 4),
        "no_floor_ci95": [round(float(lo), 4), round(float(hi), 4)],
        "ndcg@10_floor": round(sum(vb) / len(vb), 4),
        "change": paired(vb, va),
        "results_withheld": sum(len(off[i]) - len(on[i]) for i in ids),
        "answers_emptied": sum(bool(off[i]) and not on[i] for i in ids),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--data", type=Path, required=True, help="the locomo-dev folder")
    p.add_argument("--floors", default="0.25,0.3,0.35")
    p.add_argument("--shares", default="1,0.75,0.5,0.34")
    p.add_argument("--scifact", action="store_true", help="SciFact's training claims")
    p.add_argument("--limit-queries", type=int, help="--scifact: the first N judged claims")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.scifact:
        out = scifact(a.url, a.data, a.limit_queries)
        print(json.dumps(out, indent=1))
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
        return
    gold: dict[str, set[str]] = defaultdict(set)
    for line in (a.data / "qrels.jsonl").read_text().splitlines():
        if line:
            r = json.loads(line)
            gold[r["query_id"]].add(r["node_id"])
    qs = [json.loads(x) for x in (a.data / "queries.jsonl").read_text().splitlines() if x]
    on: list[dict[str, Any]] = []
    off: list[list[Row]] = []
    with psycopg.connect(a.url, autocommit=True) as conn:
        for q in qs:
            if gold.get(q["id"]):
                rows = conn.execute(
                    ROWS_SQL, {"q": q["text"], "p": q["project"], "lv": ["L0"]}
                ).fetchall()
                on.append({"cat": q.get("category"), "gold": gold[q["id"]], "rows": rows})
        for proj in PROJECTS:
            for text in questions():
                off.append(
                    conn.execute(ROWS_SQL, {"q": text, "p": proj, "lv": ["L1", "L2"]}).fetchall()
                )

    def recall(x: dict[str, Any], t: float, s: float) -> float:
        return len(x["gold"] & {r[0] for r in _kept(x["rows"], t, s)}) / len(x["gold"])

    c14 = [x for x in on if x["cat"] in (1, 2, 3, 4)]
    base = sum(recall(x, -2, 2) for x in c14) / len(c14)
    print(f"no floor: L0 recall@10 categories 1-4 {base:.4f} ({len(c14)} questions)")
    print("| min_cosine | share | L0 recall@10 cat 1-4 | all | off-topic empty |")
    print("|---:|---:|---:|---:|---:|")
    report = []
    for t in (float(x) for x in a.floors.split(",")):
        for s in [float(x) for x in a.shares.split(",")] + [2.0]:
            r14 = sum(recall(x, t, s) for x in c14) / len(c14)
            rall = sum(recall(x, t, s) for x in on) / len(on)
            empty = sum(not _kept(rows, t, s) for rows in off) / len(off)
            label = "none" if s > 1 else f"{s:g}"
            print(f"| {t:g} | {label} | {r14:.4f} | {rall:.4f} | {empty:.1%} |")
            report.append({"floor": t, "share": label, "cat14": r14, "all": rall, "empty": empty})
    if a.json:
        a.json.write_text(json.dumps({"no_floor_cat14": base, "rows": report}, indent=1))


if __name__ == "__main__":
    main()
