"""The relevance floor's trade-off (docs/benchmarks.md, "A relevance floor").

Every question is answered once through memory.answer (the one planner and executor) with
its query vector, no floor and no evidence list (whole provenance trees), k 10; each
result's cosine (query_score) is kept. A floor t then keeps the results with cosine >= t,
in their order: exactly what memory._run_legs does with min_cosine t, since the fused list
is k deep without a reranker. Measured per floor: the share of answers left empty (for
off-topic questions and LoCoMo's category 5), evidence recall@10 (the gold L0 turns the
kept results' provenance trees reach) by category, SciFact recall@10, with a paired
bootstrap interval of the change.

    python -m poimen_lab.eval.floor --url URL --data ../shared/data --set locomo-dev
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

# Questions no corpus here answers: written for this measurement, not taken from any set.
OFF_TOPIC = [
    "what is a good chocolate cake recipe",
    "how long should I boil an egg for a soft yolk",
    "what is the capital of Australia",
    "how do black holes evaporate through Hawking radiation",
    "who won the football world cup in 1998",
    "what is the best way to learn to play the cello as an adult",
    "how do I file a tax return as a freelancer in Germany",
    "what are the rules of cricket",
    "how does a diesel engine differ from a petrol engine",
    "what is the boiling point of nitrogen",
    "recommend a hiking trail in the Swiss Alps",
    "how do I replace a bicycle chain",
    "what is the plot of Moby Dick",
    "how many moons does Jupiter have",
    "what is a Fourier transform used for",
    "how do I make sourdough starter from scratch",
    "which wines pair with grilled salmon",
    "what caused the fall of the Roman Empire",
    "how do vaccines train the immune system",
    "what is the difference between a crocodile and an alligator",
    "how do I knit a scarf for beginners",
    "what is the tallest mountain in Africa",
    "how does compound interest work on a mortgage",
    "how do I repot an orchid",
    "what is the speed of sound in water",
    "explain the offside rule in ice hockey",
    "what are good exercises for lower back pain",
    "how do I descale a coffee machine",
    "who painted the ceiling of the Sistine Chapel",
    "what is quantum entanglement",
]


def answer_rows(
    conn: psycopg.Connection[Any], text: str, project: str | None, levels: list[str]
) -> list[dict[str, Any]]:
    row = conn.execute(
        "SELECT r -> 'results' FROM memory.answer(%(q)s, memory.embed(%(q)s), %(p)s, %(lv)s, "
        "10, evidence => 0) r",
        {"q": text, "p": project, "lv": levels},
    ).fetchone()
    assert row is not None
    out = []
    for r in row[0]:
        l0: set[str] = set()
        stack = [r]
        while stack:
            n = stack.pop()
            if n.get("level") == "L0" and n.get("source"):
                l0.add(n["source"])
            stack.extend(n.get("provenance") or n.get("parents") or [])
        out.append({"cos": r["query_score"], "l0": l0, "id": r["external_id"] or r["source"]})
    return out


def kept(rows: list[dict[str, Any]], t: float | None) -> list[dict[str, Any]]:
    return [r for r in rows if t is None or r["cos"] is None or r["cos"] >= t]


def _recall(x: dict[str, Any], rows: list[dict[str, Any]], data: str) -> float:
    if data == "locomo-dev":
        got: set[str] = set().union(*(r["l0"] for r in rows)) if rows else set()
    else:
        got = {r["id"] for r in rows}
    return len(got & x["gold"]) / len(x["gold"])


def boot(deltas: list[float], n: int = 2000) -> tuple[float, float]:
    rnd = random.Random(25)
    means = sorted(sum(rnd.choice(deltas) for _ in deltas) / len(deltas) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--set", choices=["locomo-dev", "scifact", "offtopic"], required=True)
    ap.add_argument("--projects", default="", help="offtopic: comma-separated projects")
    ap.add_argument("--floors", default="0.1,0.15,0.2,0.25,0.3,0.35,0.4")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    floors: list[float | None] = [None, *(float(x) for x in a.floors.split(","))]
    per_q: list[dict[str, Any]] = []
    with psycopg.connect(a.url, autocommit=True) as conn:
        if a.set == "offtopic":
            for p in a.projects.split(","):
                for text in OFF_TOPIC:
                    rows = answer_rows(conn, text, p, ["L1", "L2"] if p != "scifact" else ["L0"])
                    per_q.append({"project": p, "rows": rows})
        else:
            d = a.data / a.set
            qfile = "queries.jsonl" if a.set == "locomo-dev" else "queries-train.jsonl"
            rfile = "qrels.jsonl" if a.set == "locomo-dev" else "qrels-train.jsonl"
            gold: dict[str, set[str]] = defaultdict(set)
            for line in (d / rfile).read_text().splitlines():
                j = json.loads(line)
                gold[j["query_id"]].add(j["node_id"])
            for line in (d / qfile).read_text().splitlines():
                q = json.loads(line)
                if q["id"] not in gold:
                    continue
                lv = ["L1", "L2"] if a.set == "locomo-dev" else ["L0"]
                rows = answer_rows(conn, q["text"], q["project"], lv)
                per_q.append({"cat": q.get("category", 0), "gold": gold[q["id"]], "rows": rows})
    report: dict[str, Any] = {}
    for t in floors:
        key = "off" if t is None else f"{t:g}"
        if a.set == "offtopic":
            by: dict[str, list[int]] = defaultdict(list)
            for x in per_q:
                by[x["project"]].append(int(not kept(x["rows"], t)))
            report[key] = {
                "empty": sum(sum(v) for v in by.values()) / len(per_q),
                **{p: sum(v) / len(v) for p, v in by.items()},
            }
            continue
        recall = [_recall(x, kept(x["rows"], t), a.set) for x in per_q]
        ref = [_recall(x, x["rows"], a.set) for x in per_q]
        cats: dict[int, list[int]] = defaultdict(list)
        for i, x in enumerate(per_q):
            cats[x["cat"]].append(i)
        report[key] = {
            str(c): {
                "n": len(ix),
                "recall@10": sum(recall[i] for i in ix) / len(ix),
                "empty": sum(not kept(per_q[i]["rows"], t) for i in ix) / len(ix),
            }
            for c, ix in sorted(cats.items())
        }
        on = [i for i, x in enumerate(per_q) if x["cat"] != 5]
        report[key]["1-4"] = {
            "n": len(on),
            "recall@10": sum(recall[i] for i in on) / len(on),
            "delta_ci": boot([recall[i] - ref[i] for i in on]),
            "mean_ci": boot([recall[i] for i in on]),
        }
    print(json.dumps(report, indent=1))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
