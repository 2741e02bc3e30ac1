"""RM3 pseudo-relevance feedback over the lexical leg, measured before it is built (issue 13:
"query expansion without a language model").

The relevance model of the first pass's top ``fb_docs`` turns (each term weighted by its
share of each document, tf / length, times the document's share of the BM25 scores), its
``fb_terms`` heaviest terms, interpolated with the query's own terms (``orig_w`` each
side), scored again with BM25 with those weights as query-term weights. Written in SQL as a
session-temporary function (``pg_temp``), so it leaves nothing in the database. Prints
nDCG@10 and recall@10 of the plain lexical leg and of each setting, per category when the
queries have one:

    python -m poimen_lab.eval.rm3 --url URL --data ../shared/data/scifact --levels L0 \\
        --queries queries-train.jsonl --qrels qrels-train.jsonl --setting 10,10,0.5
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from poimen_lab.measures import ndcg_at, recall_at
from poimen_lab.report import table
from poimen_memory.db.connect import connect

RM3_SQL = """
CREATE FUNCTION pg_temp.rm3(query text, project text, levels text[], k integer,
                            fb_docs integer, fb_terms integer, orig_w double precision)
RETURNS TABLE (node_id bigint, score double precision)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    pid integer := memory.project_id(project);
    k1 double precision := 1.2;
    b double precision := 0.75;
    terms text[];
    n double precision;
    avgdl double precision;
BEGIN
    SELECT x.terms, x.n, x.avgdl INTO terms, n, avgdl
      FROM memory.lexical_query(query, pid, k, k1, b) x;
    IF cardinality(terms) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH fb AS (
        SELECT l.node_id, l.lexical_score / sum(l.lexical_score) OVER () AS w
        FROM memory.lexical_search(query, project, levels, fb_docs) l
    ), model AS (
        SELECT p.lexeme, sum(fb.w * p.tf::double precision / p.dl) AS w
        FROM fb JOIN memory.postings p ON p.node_id = fb.node_id
        WHERE pid IS NULL OR p.project_id = pid
        GROUP BY p.lexeme
        ORDER BY 2 DESC, 1
        LIMIT fb_terms
    ), q AS (
        SELECT u.lexeme, sum(u.w) AS w
        FROM (SELECT t AS lexeme, orig_w / cardinality(terms) AS w FROM unnest(terms) t
              UNION ALL
              SELECT m.lexeme, (1 - orig_w) * m.w / sum(m.w) OVER () FROM model m) u
        GROUP BY u.lexeme
        HAVING sum(u.w) > 0  -- a term of weight 0 would only match, never score
    ), weighted AS (
        SELECT q.lexeme, q.w * ln(1 + (n - sum(t.df) + 0.5) / (sum(t.df) + 0.5)) AS w
        FROM q JOIN memory.term_stats t ON t.lexeme = q.lexeme
        WHERE pid IS NULL OR t.project_id = pid
        GROUP BY q.lexeme, q.w
    )
    SELECT p.node_id, sum(w.w * p.tf * (k1 + 1) / (p.tf + k1 * (1 - b + b * p.dl / avgdl))) AS s
    FROM weighted w JOIN memory.postings p ON p.lexeme = w.lexeme
    WHERE (pid IS NULL OR p.project_id = pid) AND (levels IS NULL OR p.level = ANY (levels))
    GROUP BY p.node_id
    ORDER BY 2 DESC, 1
    LIMIT k;
END $$
"""


def measure(
    url: str,
    queries: list[dict[str, Any]],
    judged: dict[str, dict[str, int]],
    levels: list[str] | None,
    settings: list[tuple[int, int, float]],
) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per setting ("plain" first) and category ("all" first): nDCG@10, recall@10, n."""
    out: dict[str, dict[str, tuple[float, float, int]]] = {}
    with connect(url) as conn:
        conn.execute(RM3_SQL)
        ext = dict(conn.execute("SELECT id, external_id FROM memory.nodes").fetchall())
        for setting in [None, *settings]:
            by: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for q in queries:
                args: tuple[Any, ...] = (q["text"], q.get("project"), levels)
                if setting is None:
                    sql = "SELECT node_id FROM memory.lexical_search(%s, %s, %s, 10)"
                else:
                    sql = "SELECT node_id FROM pg_temp.rm3(%s, %s, %s, 10, %s, %s, %s)"
                    args = (*args, *setting)
                ranked = [ext[r[0]] for r in conn.execute(sql, args).fetchall()]
                m = (ndcg_at(judged[q["id"]], ranked, 10), recall_at(judged[q["id"]], ranked, 10))
                by["all"].append(m)
                if "category" in q:
                    by[str(q["category"])].append(m)
            name = "plain" if setting is None else ",".join(map(str, setting))
            out[name] = {
                cat: (
                    statistics.mean(a for a, _ in ms),
                    statistics.mean(b for _, b in ms),
                    len(ms),
                )
                for cat, ms in by.items()
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--queries", default="queries.jsonl")
    p.add_argument("--qrels", default="qrels.jsonl")
    p.add_argument("--levels", default=None, help="comma-separated, e.g. L0")
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        help="fb_docs,fb_terms,orig_w (repeatable; default 10,10,0.5: Anserini's)",
    )
    args = p.parse_args()
    judged: dict[str, dict[str, int]] = defaultdict(dict)
    for line in (args.data / args.qrels).read_text().splitlines():
        r = json.loads(line)
        if r["score"] >= 1:
            judged[r["query_id"]][r["node_id"]] = int(r["score"])
    lines = (args.data / args.queries).read_text().splitlines()
    queries = [q for q in map(json.loads, lines) if q["id"] in judged]
    settings = [
        (int(d), int(t), float(w))
        for d, t, w in (s.split(",") for s in args.setting or ["10,10,0.5"])
    ]
    levels = args.levels.split(",") if args.levels else None
    out = measure(args.url, queries, judged, levels, settings)
    cats = list(next(iter(out.values())))
    rows = [[name, *(f"{v[c][0]:.3f} / {v[c][1]:.3f}" for c in cats)] for name, v in out.items()]
    print(table(rows, ["nDCG@10 / recall@10", *(f"{c} ({out['plain'][c][2]})" for c in cats)]))


if __name__ == "__main__":
    main()
