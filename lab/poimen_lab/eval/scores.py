"""Turns per-query outcomes into the reported measures, overall and per query category."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from poimen_lab.eval.data import EvalData, Query
from poimen_lab.eval.runner import EVIDENCE_KS, Outcome
from poimen_lab.measures import coverage, mean, per_query, percentile


def _relevant(judged: Mapping[str, int]) -> set[str]:
    return {d for d, r in judged.items() if r >= 1}


def retrieval(
    data: EvalData, queries: Sequence[Query], outcomes: Mapping[str, Outcome], *, l0_only: bool
) -> dict[str, float]:
    qrels = {qy.id: data.qrels[qy.id] for qy in queries}
    ranked = {qy.id: outcomes[qy.id].ranked for qy in queries}
    out = {
        name: mean(per_query(qrels, ranked, name)) for name in ("ndcg@10", "recall@10", "mrr@10")
    }
    if all(outcomes[qy.id].deep is not None for qy in queries):
        deep = {qy.id: outcomes[qy.id].deep or [] for qy in queries}
        out["recall@100"] = mean(per_query(qrels, deep, "recall@100"))
    if l0_only:
        out["l0_recall@10"] = out["recall@10"]
    return out


def evidence(
    data: EvalData,
    queries: Sequence[Query],
    outcomes: Mapping[str, Outcome],
    l2_of: Mapping[str, set[str]],
) -> dict[str, float]:
    """Evidence recall@k: gold L0 turns covered by the provenance of the top-k L1/L2 results.
    Session recall@k: gold L2 sessions returned, or reached from a returned node below them."""
    if any(outcomes[qy.id].evidence is None for qy in queries):
        return {}
    out: dict[str, float] = {}
    for k in EVIDENCE_KS:
        recall, cited, sessions = [], [], []
        for qy in queries:
            top = (outcomes[qy.id].evidence or [])[:k]
            r, n = evidence_of(data, qy, outcomes[qy.id], k)
            recall.append(r)
            cited.append(n)
            gold = _relevant(data.session_qrels.get(qy.id, {}))
            if gold:
                hit = {ext for ext, _ in top}
                for ext, _ in top:
                    hit |= l2_of.get(ext, set())
                sessions.append(coverage(gold, hit))
        out[f"evidence_recall@{k}"] = mean(recall)
        out[f"cited_l0@{k}"] = mean(cited)
        if sessions:
            out[f"session_recall@{k}"] = mean(sessions)
    return out


def evidence_of(data: EvalData, qy: Query, outcome: Outcome, k: int) -> tuple[float, float]:
    """(evidence recall@k, distinct L0 turns cited@k) of one query: what the k-result
    response cites (trees and evidence list), or the top k trees of a longer one."""
    top = (outcome.evidence or [])[:k]
    found = outcome.cited.get(k)
    if found is None:
        found = frozenset().union(*(l0 for _, l0 in top))
    return coverage(_relevant(data.qrels[qy.id]), found), float(len(found))


def per_query_scores(
    data: EvalData, outcomes: Mapping[str, Outcome]
) -> dict[str, dict[str, float]]:
    """Each judged query's own values, for paired comparisons of two runs
    (python -m poimen_lab.eval.compare)."""
    out: dict[str, dict[str, float]] = {}
    for qy in data.judged:
        o = outcomes.get(qy.id)
        if o is None or o.error is not None:
            continue
        one_qrels, one_run = {qy.id: data.qrels[qy.id]}, {qy.id: o.ranked}
        row = {
            "recall@10": mean(per_query(one_qrels, one_run, "recall@10")),
            "ndcg@10": mean(per_query(one_qrels, one_run, "ndcg@10")),
            "latency_ms": o.latency_ms,
        }
        if o.evidence is not None:
            row["evidence_recall@10"], row["cited_l0@10"] = evidence_of(data, qy, o, 10)
        out[qy.id] = row
    return out


def latency(outcomes: Mapping[str, Outcome]) -> dict[str, float]:
    ms = [o.latency_ms for o in outcomes.values() if o.error is None]
    return {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95)}


def score_mode(
    data: EvalData, outcomes: Mapping[str, Outcome], l2_of: Mapping[str, set[str]], *, l0_only: bool
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(overall measures, {category: measures}) for one mode."""
    judged = [qy for qy in data.judged if qy.id in outcomes]
    overall = {
        **retrieval(data, judged, outcomes, l0_only=l0_only),
        **evidence(data, judged, outcomes, l2_of),
        **latency(outcomes),
    }
    errors = sum(1 for o in outcomes.values() if o.error is not None)
    if errors:
        overall["errors"] = float(errors)
    by_cat: dict[str, dict[str, float]] = {}
    cats = sorted({qy.category for qy in judged if qy.category is not None})
    for cat in cats:
        subset = [qy for qy in judged if qy.category == cat]
        by_cat[cat] = {
            "queries": float(len(subset)),
            **retrieval(data, subset, outcomes, l0_only=l0_only),
            **evidence(data, subset, outcomes, l2_of),
            **latency({qy.id: outcomes[qy.id] for qy in subset}),
        }
    return overall, by_cat
