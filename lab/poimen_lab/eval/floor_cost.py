"""What the default relevance floor costs an answer (issue 45; docs/benchmarks.md, "A floor
on by default"), side by side in one run.

Each LoCoMo dev question (the first --questions of them) is embedded once, then answered
through memory.answer (the whole default path: plan, legs, fusion, the floor, support,
provenance, the evidence list; limit 10, default levels) twice on one connection, with no
floor (min_cosine -1) and with the policy's, alternating which goes first; the connection's
role is the URL's (give a role granted the projects, so row-level security applies as in a
deployment). Reported per side: p50 and p95 of the statement's wall time, the median of
the per-question ratios, and the backend's CPU per answer (read from /proc for the server
process that serves the connection: run it on the database's machine, as root or as the
server's OS user).

    python -m poimen_lab.eval.floor_cost --url URL --data ../shared/data/locomo-dev
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg

from poimen_lab.eval.answer_side_by_side import _cpu_ms

ANSWER_SQL = """
SELECT jsonb_array_length(a -> 'results'), (a -> 'counts' ->> 'withheld')::integer
FROM memory.answer(query => %(text)s, query_embedding => %(vec)s::vector,
                   project => %(project)s, k => 10, min_cosine => %(floor)s) a
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--data", type=Path, required=True, help="the locomo-dev folder")
    p.add_argument("--questions", type=int, default=300)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    qs = [json.loads(x) for x in (a.data / "queries.jsonl").read_text().splitlines() if x]
    qs = qs[: a.questions]
    sides: dict[str, dict[str, list[float]]] = {
        s: {"ms": [], "cpu": [], "results": []} for s in ("off", "policy")
    }
    floors: dict[str, float | None] = {"off": -1.0, "policy": None}
    with psycopg.connect(a.url, autocommit=True) as conn:
        pid = conn.info.backend_pid
        for i, q in enumerate(qs):
            row = conn.execute("SELECT memory.embed(%s)::text", (q["text"],)).fetchone()
            assert row is not None
            params = {"text": q["text"], "vec": row[0], "project": q["project"]}
            for side in ("off", "policy") if i % 2 == 0 else ("policy", "off"):
                cpu0 = _cpu_ms(pid)
                t0 = time.perf_counter()
                got = conn.execute(ANSWER_SQL, {**params, "floor": floors[side]}).fetchone()
                sides[side]["ms"].append((time.perf_counter() - t0) * 1000)
                sides[side]["cpu"].append(_cpu_ms(pid) - cpu0)
                sides[side]["results"].append(float(got[0]) if got else 0.0)
    out: dict[str, Any] = {}
    for side, m in sides.items():
        ms = sorted(m["ms"])
        out[side] = {
            "p50_ms": round(statistics.median(ms), 2),
            "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 2),
            "cpu_ms_per_answer": round(statistics.mean(m["cpu"]), 2),
            "results_per_answer": round(statistics.mean(m["results"]), 2),
        }
    ratio = statistics.median(
        b / a for a, b in zip(sides["off"]["ms"], sides["policy"]["ms"], strict=True)
    )
    out["median_ratio_policy_over_off"] = round(ratio, 3)
    print(f"{len(qs)} questions, alternating")
    print("| floor | p50 ms | p95 ms | CPU ms / answer | results / answer |")
    print("|---|---:|---:|---:|---:|")
    for side in ("off", "policy"):
        o = out[side]
        print(
            f"| {side} | {o['p50_ms']} | {o['p95_ms']} | {o['cpu_ms_per_answer']} | "
            f"{o['results_per_answer']} |"
        )
    print(f"median per-question ratio (policy / off): {out['median_ratio_policy_over_off']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
