"""Off-topic questions through the default path (issue 45; docs/benchmarks.md, "A floor on
by default").

Every question of data/offtopic.txt (sentence questions on subjects no corpus here is
about, written for this project) is asked in each project named, through memory.answer with
the database's policy (the floor as it is configured; the query embedded in the database,
as SQL callers get it), and the answer is counted empty when it has no result. Reported per
project: the share of empty answers, the results and evidence turns the others returned,
and the candidates the floor withheld. ``--min-cosine`` asks with that floor instead of the
policy's (-1: none).

    python -m poimen_lab.eval.offtopic --url URL --projects conv-26,conv-30 --json OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import psycopg

QUESTIONS = Path(__file__).with_name("data") / "offtopic.txt"

ANSWER_SQL = """
SELECT jsonb_array_length(a -> 'results'), coalesce(jsonb_array_length(a -> 'evidence'), 0),
       (a -> 'counts' ->> 'withheld')::integer
FROM memory.answer(query => %(text)s, project => %(project)s, min_cosine => %(floor)s) a
"""


def questions() -> list[str]:
    return [
        x.strip() for x in QUESTIONS.read_text().splitlines() if x.strip() and not x.startswith("#")
    ]


def run(url: str, projects: list[str], floor: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for p in projects:
            rows = []
            for text in questions():
                n, ev, withheld = conn.execute(
                    ANSWER_SQL, {"text": text, "project": p, "floor": floor}
                ).fetchone() or (0, 0, 0)
                rows.append({"text": text, "results": n, "evidence": ev, "withheld": withheld})
            answered = [r for r in rows if r["results"] > 0]
            out[p] = {
                "questions": len(rows),
                "empty": sum(r["results"] == 0 for r in rows) / len(rows),
                "results_when_answered": statistics.mean(r["results"] for r in answered)
                if answered
                else 0,
                "evidence_when_answered": statistics.mean(r["evidence"] for r in answered)
                if answered
                else 0,
                "withheld": statistics.mean(r["withheld"] for r in rows),
                "answered": [r["text"] for r in answered],
                "rows": rows,
            }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--projects", required=True, help="comma-separated")
    p.add_argument("--min-cosine", type=float, help="the request's floor (default: the policy's)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    out = run(a.url, a.projects.split(","), a.min_cosine)
    print("| project | questions | empty | results / evidence when answered | withheld (mean) |")
    print("|---|---:|---:|---:|---:|")
    for proj, r in out.items():
        print(
            f"| {proj} | {r['questions']} | {r['empty']:.1%} | "
            f"{r['results_when_answered']:.1f} / {r['evidence_when_answered']:.1f} | "
            f"{r['withheld']:.1f} |"
        )
    n = sum(r["questions"] for r in out.values())
    empty = sum(r["empty"] * r["questions"] for r in out.values())
    print(f"\nall: {empty:.0f} of {n} empty ({empty / n:.1%})")
    for proj, r in out.items():
        for text in r["answered"]:
            print(f"answered in {proj}: {text}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
