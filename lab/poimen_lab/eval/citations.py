"""Citation integrity under the evidence budget (issue 24): through the service's pipeline
(``Retriever.query``, what GET /memory/query runs), at the policy's evidence budget and each
result count, how many returned L1/L2 results have L0 evidence (their full provenance
reaches an L0 turn) and how many of those come back citing none (every L0 turn of their
tree cut by the budget). Also the evidence recall of each answer (gold L0 turns cited, in
the trees and the list alike), so a change to the selection is seen on both at once.

    python -m poimen_lab.eval.citations --url URL --data ../shared/data/locomo-dev --json OUT
    python -m poimen_lab.eval.citations --compare A.json B.json   # B - A, paired, 95% CI

The database must hold the data set already (``poimen-memory ingest`` or ``eval`` loads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from poimen_memory.retrieval.models import QueryRequest
from poimen_memory.services import open_services
from poimen_memory.settings import Settings

KS = (5, 10)


def _l0(tree: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out, stack = [], list(tree)
    while stack:
        node = stack.pop()
        if node.get("level") == "L0":
            out.append(node)
        stack.extend(node.get("parents") or [])
    return out


async def measure(url: str, data: Path, every: int) -> dict[str, Any]:
    s = Settings.from_env()
    s = replace(s, embedding=replace(s.embedding, cache_size=0))
    queries = [json.loads(x) for x in (data / "queries.jsonl").read_text().splitlines() if x]
    queries = queries[::every]
    gold: dict[str, set[str]] = defaultdict(set)
    for line in (data / "qrels.jsonl").read_text().splitlines():
        if line:
            r = json.loads(line)
            gold[r["query_id"]].add(r["node_id"])
    out: dict[str, Any] = {"questions": len(queries), "every": every}
    async with open_services(s, url=url, rerank=False, wait=True) as svc:
        for k in KS:
            results = with_l0 = uncited = 0
            recall: list[float] = []
            per_query: dict[str, float] = {}
            cited_n: list[int] = []
            examples: list[str] = []
            for qy in queries:
                req = QueryRequest(
                    query=qy["text"], project=qy.get("project"), limit=k, timeout_s=30.0
                )
                resp = await svc.retriever.query(req)
                cited: set[str] = set()  # sha256 of every L0 turn the answer cites
                named: set[str] = set()  # their external ids
                for r in resp["results"]:
                    if r["level"] not in ("L1", "L2"):
                        continue
                    results += 1
                    kept = _l0(r["parents"] or [])
                    cited |= {n["sha256"] for n in kept}
                    named |= {n["external_id"] for n in kept if n.get("external_id")}
                    if kept or r.get("provenance_l0_omitted", 0) > 0:
                        with_l0 += 1
                        if not kept:
                            uncited += 1
                            if len(examples) < 5:
                                examples.append(f"{qy['id']} rank {r['rank']} {r['external_id']}")
                cited |= {e["sha256"] for e in resp["evidence"]}
                named |= {e["external_id"] for e in resp["evidence"] if e["external_id"]}
                cited_n.append(len(cited))
                g = gold.get(qy["id"], set())
                if g:
                    recall.append(len(g & named) / len(g))
                    per_query[qy["id"]] = recall[-1]
            out[f"k{k}"] = {
                "l1_l2_results": results,
                "with_l0_evidence": with_l0,
                "uncited": uncited,
                "evidence_recall": round(sum(recall) / max(len(recall), 1), 4),
                "cited_l0": round(sum(cited_n) / max(len(cited_n), 1), 2),
                "examples": examples,
                "per_query": per_query,
            }
    return out


def compare(a: dict[str, Any], b: dict[str, Any], rounds: int = 10_000) -> dict[str, Any]:
    """B - A of evidence recall per result count, over the questions both measured, with a
    paired bootstrap 95% interval (seeded: the same files give the same interval)."""
    rng = random.Random(24)
    out: dict[str, Any] = {}
    for k in KS:
        qa, qb = a[f"k{k}"]["per_query"], b[f"k{k}"]["per_query"]
        ids = sorted(set(qa) & set(qb))
        d = [qb[i] - qa[i] for i in ids]
        means = sorted(sum(rng.choices(d, k=len(d))) / len(d) for _ in range(rounds))
        out[f"k{k}"] = {
            "questions": len(ids),
            "A": round(sum(qa[i] for i in ids) / len(ids), 4),
            "B": round(sum(qb[i] for i in ids) / len(ids), 4),
            "B-A": round(sum(d) / len(d), 4),
            "ci95": [round(means[int(0.025 * rounds)], 4), round(means[int(0.975 * rounds)], 4)],
            "uncited A": a[f"k{k}"]["uncited"],
            "uncited B": b[f"k{k}"]["uncited"],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url")
    p.add_argument("--data", type=Path)
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"))
    p.add_argument("--every", type=int, default=1, help="every n-th question (default 1)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.compare:
        first, second = (json.loads(f.read_text()) for f in a.compare)
        print(json.dumps(compare(first, second), indent=2))
        return
    if not (a.url and a.data):
        p.error("--url and --data are required (or --compare A.json B.json)")
    res = asyncio.run(measure(a.url, a.data, a.every))
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
