"""How much gold L0 evidence a response could cite within a budget of turns, by design.

Measures designs before any of them goes into the product: for every question it asks
``memory_query()`` (the ranking GET /memory/query returns, tests/test_policy.py) for the
top 10 L1/L2 results and the top 50 L0 turns, walks the results' provenance to L0, and
then chooses, per design, which distinct L0 turns the response would cite:

- ``provenance@10``: the seed, every L0 turn below the top 10 results;
- ``prov@n + L0 to B``: the provenance of the top n results, filled up to B turns with
  the best direct L0 hits;
- ``hierarchy w, decay``: every candidate turn scored by its own fused L0 score
  (normalised by the question's best) plus ``w / rank^decay`` of the best result citing
  it, the top B kept;
- ``pool``: every candidate at all (the ceiling of any selection from these candidates).

    python -m poimen_lab.eval.evidence_budget --url URL --data ../shared/data/locomo-dev
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poimen_memory.db.connect import connect
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.settings import Settings


@dataclass(frozen=True)
class Candidates:
    category: str
    gold: frozenset[str]
    results: list[list[str]]  # per L1/L2 result in rank order: the L0 turns it cites
    direct: list[tuple[str, float]]  # L0 turns with their fused score, best first


Design = Callable[[Candidates], set[str]]


def collect(url: str, data: Path) -> list[Candidates]:
    gold: dict[str, set[str]] = defaultdict(set)
    for line in (data / "qrels.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["score"] >= 1:
            gold[r["query_id"]].add(r["node_id"])
    queries = [json.loads(x) for x in (data / "queries.jsonl").read_text().splitlines()]
    embedder = build_embedder(Settings.from_env().embedding)
    out = []
    with connect(url) as conn:
        for qy in (q for q in queries if q["id"] in gold):
            vec = embedder.embed_query(qy["text"])
            args = (qy["text"], vec, qy["project"])
            ids = [r[0] for r in conn.execute(q_results, args).fetchall()]
            cites: dict[int, list[str]] = defaultdict(list)
            for root, ext in conn.execute(q_provenance, (ids,)).fetchall():
                cites[root].append(ext)
            direct = [(r[0], float(r[1])) for r in conn.execute(q_direct, args).fetchall()]
            out.append(
                Candidates(
                    str(qy.get("category")),
                    frozenset(gold[qy["id"]]),
                    [sorted(cites[i]) for i in ids],
                    direct,
                )
            )
    return out


q_results = "SELECT node_id FROM memory_query(%s, %s, %s, k => 10)"
q_direct = (
    "SELECT external_id, final_score FROM memory_query(%s, %s, %s, levels => ARRAY['L0'], k => 50)"
)
q_provenance = (
    "SELECT DISTINCT w.root_id, n.external_id FROM memory.provenance_walk(%s, 4) w "
    "JOIN memory.nodes n ON n.id = w.parent_id WHERE n.level = 'L0'"
)


def provenance(n: int) -> Design:
    return lambda c: {e for cited in c.results[:n] for e in cited}


def filled(n: int, budget: int) -> Design:
    def pick(c: Candidates) -> set[str]:
        chosen = provenance(n)(c)
        for e, _ in c.direct:
            if len(chosen) >= budget:
                break
            chosen.add(e)
        return chosen

    return pick


def hierarchy(w: float, decay: float, budget: int) -> Design:
    def pick(c: Candidates) -> set[str]:
        score: dict[str, float] = defaultdict(float)
        top = max((s for _, s in c.direct), default=0.0) or 1.0
        for e, s in c.direct:
            score[e] += s / top
        support: dict[str, float] = {}
        for rank, cited in enumerate(c.results, start=1):
            for e in cited:
                support[e] = max(support.get(e, 0.0), w / rank**decay)
        for e, s in support.items():
            score[e] += s
        return set(sorted(score, key=lambda e: (-score[e], e))[:budget])

    return pick


def pool(c: Candidates) -> set[str]:
    return provenance(10)(c) | {e for e, _ in c.direct}


DESIGNS: dict[str, Design] = {
    "provenance@10 (the seed)": provenance(10),
    "prov@5 + 10 L0 (the issue's floor)": lambda c: (
        provenance(5)(c) | {e for e, _ in c.direct[:10]}
    ),
    "prov@3 + L0 to 20": filled(3, 20),
    "prov@5 + L0 to 20": filled(5, 20),
    "L0 alone, 20": filled(0, 20),
    "hierarchy w 0.3, decay 0, 20": hierarchy(0.3, 0.0, 20),
    "hierarchy w 0.5, decay 0.5, 20": hierarchy(0.5, 0.5, 20),
    "hierarchy w 1.0, decay 1, 20": hierarchy(1.0, 1.0, 20),
    "pool (every candidate)": pool,
}


def measure(cands: list[Candidates]) -> list[dict[str, Any]]:
    rows = []
    cats = sorted({c.category for c in cands})
    for name, design in DESIGNS.items():
        recall: dict[str, list[float]] = defaultdict(list)
        cited = []
        for c in cands:
            chosen = design(c)
            r = len(c.gold & chosen) / len(c.gold)
            recall["all"].append(r)
            recall[c.category].append(r)
            cited.append(len(chosen))
        row: dict[str, Any] = {"design": name, "cited": round(sum(cited) / len(cited), 1)}
        for g in ["all", *cats]:
            row[g] = round(sum(recall[g]) / len(recall[g]), 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="database the eval ingested")
    p.add_argument("--data", type=Path, required=True, help="folder of queries/qrels.jsonl")
    args = p.parse_args(argv)
    rows = measure(collect(args.url, args.data))
    keys = [k for k in rows[0] if k not in ("design", "cited")]
    print("| design | cited L0 | " + " | ".join(f"recall {k}" for k in keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for r in rows:
        print(f"| {r['design']} | {r['cited']} | " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
