"""A query response as text for a person at a terminal: results, scores and citations."""

from __future__ import annotations

import textwrap
from typing import Any


def _short(text: str, width: int) -> str:
    return textwrap.shorten(" ".join(text.split()), width=width, placeholder=" …")


def _citations(parents: list[dict[str, Any]], depth: int, out: list[str]) -> None:
    for p in parents:
        pad = "    " * depth
        out.append(
            f"{pad}└─ [{p['level']}] {p.get('source') or p['sha256'][:12]}: "
            f"{_short(p['text'], 100)}"
        )
        _citations(p.get("parents") or [], depth + 1, out)


def render_response(resp: dict[str, Any]) -> str:
    plan = resp["plan"]
    out = [
        f"query: {resp['query']!r}  strategy: {resp['search_strategy']} "
        f"({plan['question_type']}, confidence {plan['confidence']:.2f})"
    ]
    for i, r in enumerate(resp["results"], 1):
        scores = [f"final {r['final_score']:.4f}"]
        if r["query_score"] is not None:
            scores.append(f"cosine {r['query_score']:.3f}")
        if r["lexical_score"] is not None:
            scores.append(f"bm25 {r['lexical_score']:.2f}")
        if r["rerank_score"] is not None:
            scores.append(f"rerank {r['rerank_score']:.3f}")
        out.append(
            f"\n{i}. [{r['level']}] {r['project']} {r.get('source') or r['sha256'][:12]}  "
            f"({', '.join(scores)})"
        )
        out.append(f"   {_short(r['text'], 160)}")
        _citations(r["parents"], 1, out)
    m = resp["metrics"]
    stages = ", ".join(
        f"{stage} {m[f'{stage}_time_ms']:.0f}"
        for stage in ("embed", "semantic", "lexical", "provenance")
        if m[f"{stage}_time_ms"] is not None  # null: the stage did not run
    )
    out.append(f"\n{resp['notes']}. {m['total_time_ms']:.0f} ms total ({stages})")
    if resp["degraded"]:
        out.append(
            "degraded: " + ", ".join(f"{d['stage']}={d['reason']}" for d in resp["degraded"])
        )
    return "\n".join(out)
