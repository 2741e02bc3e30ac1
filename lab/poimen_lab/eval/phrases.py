"""Quoted phrases in natural questions (issue 45; docs/benchmarks.md, "Phrases that help").

Every LoCoMo dev question with a quoted phrase (`When did Melanie read the book "nothing is
impossible"?`) is asked as written and with its quotes removed, through the default path
(memory.answer: the plan, the legs, fusion, the floor, the evidence list; the query
embedded in the database as SQL callers get it), and twice: at the default levels (L1, L2;
evidence recall@10 of its evidence list: the gold L0 turns it cites) and at L0 (recall@10 of
the ten turns returned). Per question, quoted beside unquoted, and the means; empty answers
are counted. Run it on the code before a change and after, on the same database.

    python -m poimen_lab.eval.phrases --url URL --data ../shared/data/locomo-dev --json OUT
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

ANSWER_SQL = """
SELECT coalesce((SELECT array_agg(e ->> 'external_id')
                 FROM jsonb_array_elements(a -> 'evidence') e), '{}'),
       coalesce((SELECT array_agg(r ->> 'external_id')
                 FROM jsonb_array_elements(a -> 'results') r), '{}'),
       (a -> 'counts' ->> 'withheld')::integer
FROM memory.answer(query => %(text)s, project => %(project)s, levels => %(levels)s, k => 10) a
"""


def quoted_questions(data: Path) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    gold: dict[str, set[str]] = defaultdict(set)
    for line in (data / "qrels.jsonl").read_text().splitlines():
        if line:
            r = json.loads(line)
            gold[r["query_id"]].add(r["node_id"])
    queries = [json.loads(x) for x in (data / "queries.jsonl").read_text().splitlines() if x]
    return [q for q in queries if '"' in q["text"] and gold.get(q["id"])], gold


def measure(conn: psycopg.Connection[Any], text: str, project: str, g: set[str]) -> dict[str, Any]:
    ev, _, withheld = conn.execute(
        ANSWER_SQL, {"text": text, "project": project, "levels": ["L1", "L2"]}
    ).fetchone() or ([], [], 0)
    _, l0, _ = conn.execute(
        ANSWER_SQL, {"text": text, "project": project, "levels": ["L0"]}
    ).fetchone() or ([], [], 0)
    return {
        "evidence_recall@10": len(g & set(ev)) / len(g),
        "evidence": len(ev),
        "withheld": withheld,
        "l0_recall@10": len(g & set(l0)) / len(g),
        "l0": len(l0),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--data", type=Path, required=True, help="the locomo-dev folder")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    questions, gold = quoted_questions(a.data)
    rows = []
    with psycopg.connect(a.url, autocommit=True) as conn:
        for q in questions:
            g = gold[q["id"]]
            rows.append(
                {
                    "id": q["id"],
                    "text": q["text"],
                    "quoted": measure(conn, q["text"], q["project"], g),
                    "unquoted": measure(conn, q["text"].replace('"', ""), q["project"], g),
                }
            )
    print(
        "| question | evidence recall@10 quoted / unquoted | cited "
        "| L0 recall@10 quoted / unquoted | L0 rows |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        qd, un = r["quoted"], r["unquoted"]
        print(
            f"| {r['text']} | {qd['evidence_recall@10']:.2f} / {un['evidence_recall@10']:.2f} | "
            f"{qd['evidence']} / {un['evidence']} | {qd['l0_recall@10']:.2f} / "
            f"{un['l0_recall@10']:.2f} | {qd['l0']} / {un['l0']} |"
        )
    n = len(rows)
    summary = {
        side: {
            "evidence_recall@10": round(sum(r[side]["evidence_recall@10"] for r in rows) / n, 4),
            "l0_recall@10": round(sum(r[side]["l0_recall@10"] for r in rows) / n, 4),
            "empty_evidence": sum(r[side]["evidence"] == 0 for r in rows),
            "empty_l0": sum(r[side]["l0"] == 0 for r in rows),
        }
        for side in ("quoted", "unquoted")
    }
    print(f"\n{n} quoted questions: {json.dumps(summary)}")
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
