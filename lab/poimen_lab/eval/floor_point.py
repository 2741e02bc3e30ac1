"""The relevance floor's default for a database's model (docs/benchmarks.md, "A floor on by
default"): the cosine that keeps a share (0.95) of a labelled set's relevant pairs.

Each question is embedded in the database (memory.embed: the database's model, with its
query prefix where the model has one) and compared with the stored vector of every node
its qrels judge relevant (the passages as the model embedded them at ingest); the floor is
the pairs' cosine at the ``--keep`` quantile from below. The pairs do not depend on what
else the database holds, so a subset of a corpus that keeps the judged nodes measures the
same point.

    python -m poimen_lab.eval.floor_point --url URL --queries Q.jsonl --qrels R.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import psycopg

PAIRS_SQL = """
SELECT 1 - (n.embedding <=> memory.embed(%(text)s))
FROM memory.nodes n
WHERE n.external_id = ANY (%(ids)s) AND n.embedding IS NOT NULL
"""


def _jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def cosines(url: str, queries: Path, qrels: Path, limit: int | None) -> list[float]:
    judged: dict[str, list[str]] = {}
    for r in _jsonl(qrels):
        if int(str(r.get("score", 1))) > 0:
            judged.setdefault(str(r["query_id"]), []).append(str(r["node_id"]))
    asked = [q for q in _jsonl(queries) if str(q["id"]) in judged][:limit]
    out: list[float] = []
    with psycopg.connect(url, autocommit=True) as conn:
        for q in asked:
            rows = conn.execute(PAIRS_SQL, {"text": q["text"], "ids": judged[str(q["id"])]})
            out += [float(c) for (c,) in rows.fetchall()]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m poimen_lab.eval.floor_point")
    p.add_argument("--url", required=True)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--qrels", type=Path, required=True)
    p.add_argument("--limit", type=int, help="only the first N judged questions")
    p.add_argument("--keep", type=float, default=0.95, help="share of relevant pairs kept")
    a = p.parse_args(argv)
    c = np.array(cosines(a.url, a.queries, a.qrels, a.limit))
    if not len(c):
        raise SystemExit("no judged pair found in the database")
    qs = (0.01, 0.05, 0.10, 0.25, 0.50)
    print(
        f"{len(c)} relevant pairs; cosine quantiles: "
        + ", ".join(f"{q:.2f}: {np.quantile(c, q):.3f}" for q in qs)
    )
    print(f"floor keeping {a.keep:.0%} of them: {np.quantile(c, 1 - a.keep):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
