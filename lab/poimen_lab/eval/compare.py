"""Paired comparison of two `poimen-memory eval --json` runs of the same queries: per
measure, overall and per query category, the mean of (B - A) per query with a 95% paired
bootstrap interval, and the means of A and B side by side.

    python -m poimen_lab.eval.compare A.json B.json [--mode auto] [--mode-b auto]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from poimen_lab.eval.fusion_sweep import paired

MEASURES = ("evidence_recall@10", "cited_l0@10", "recall@10", "ndcg@10", "latency_ms")


def compare(a: dict[str, Any], b: dict[str, Any], mode_a: str, mode_b: str) -> list[dict[str, Any]]:
    qa, qb = a["per_query"][mode_a], b["per_query"][mode_b]
    cats: dict[str, Any] = a.get("categories", {})
    ids = sorted(set(qa) & set(qb))
    groups = {"all": ids}
    for cat in sorted({str(cats[i]) for i in ids if cats.get(i) is not None}):
        groups[f"category {cat}"] = [i for i in ids if str(cats.get(i)) == cat]
    rows = []
    for measure in MEASURES:
        for name, members in groups.items():
            sel = [i for i in members if measure in qa[i] and measure in qb[i]]
            if not sel:
                continue
            va, vb = [qa[i][measure] for i in sel], [qb[i][measure] for i in sel]
            rows.append(
                {
                    "measure": measure,
                    "group": name,
                    "queries": len(sel),
                    "a": round(sum(va) / len(va), 4),
                    "b": round(sum(vb) / len(vb), 4),
                    **paired(vb, va),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--mode", default="auto", help="mode of A (default auto)")
    p.add_argument("--mode-b", help="mode of B (default: --mode)")
    args = p.parse_args(argv)
    a, b = (json.loads(path.read_text()) for path in (args.a, args.b))
    print("| measure | group | queries | A | B | B - A [95% CI] |")
    print("|---|---|---:|---:|---:|---:|")
    for r in compare(a, b, args.mode, args.mode_b or args.mode):
        print(
            f"| {r['measure']} | {r['group']} | {r['queries']} | {r['a']} | {r['b']} | "
            f"{r['diff']:+.3f} [{r['ci95_low']:+.3f}, {r['ci95_high']:+.3f}] |"
        )


if __name__ == "__main__":
    main()
