"""Retrieval measures with trec_eval's definitions, on plain ranked lists of ids.

``qrels`` maps a query id to ``{doc_id: relevance}``; a document is relevant when its
relevance is >= 1 (trec_eval's default ``relevance_level``). ``run`` maps a query id to
its ranked ids, best first. Means are over every judged query (trec_eval ``-c``): a
query with an empty or missing run scores 0 instead of being dropped. The per-query
values equal trec_eval's/ir-measures' ``nDCG@k`` (ndcg_cut, linear gain), ``R@k``
(recall_k) and ``RR@k`` (recip_rank cut at k); tests/test_measures.py checks that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

Qrels = Mapping[str, Mapping[str, int]]
Run = Mapping[str, Sequence[str]]


def _relevant(judged: Mapping[str, int]) -> set[str]:
    return {d for d, r in judged.items() if r >= 1}


def _dedup(ranked: Sequence[str]) -> list[str]:
    """First occurrence wins (trec_eval would count a repeated id twice; we never emit any)."""
    return list(dict.fromkeys(ranked))


def ndcg_at(judged: Mapping[str, int], ranked: Sequence[str], k: int) -> float:
    gains = [max(r, 0) for r in judged.values()]
    ideal = sorted((g for g in gains if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    if idcg == 0:
        return 0.0
    dcg = sum(max(judged.get(d, 0), 0) / math.log2(i + 2) for i, d in enumerate(_dedup(ranked)[:k]))
    return dcg / idcg


def recall_at(judged: Mapping[str, int], ranked: Sequence[str], k: int) -> float:
    rel = _relevant(judged)
    if not rel:
        return 0.0
    return len(rel.intersection(_dedup(ranked)[:k])) / len(rel)


def rr_at(judged: Mapping[str, int], ranked: Sequence[str], k: int) -> float:
    rel = _relevant(judged)
    for i, d in enumerate(_dedup(ranked)[:k]):
        if d in rel:
            return 1.0 / (i + 1)
    return 0.0


def coverage(gold: AbstractSet[str], found: AbstractSet[str]) -> float:
    """Fraction of the gold ids among the found ones (0 when nothing is gold)."""
    return len(gold & found) / len(gold) if gold else 0.0


MEASURES: dict[str, tuple[Callable[[Mapping[str, int], Sequence[str], int], float], int]] = {
    "ndcg@10": (ndcg_at, 10),
    "recall@10": (recall_at, 10),
    "recall@100": (recall_at, 100),
    "mrr@10": (rr_at, 10),
}


def per_query(qrels: Qrels, run: Run, name: str) -> dict[str, float]:
    fn, k = MEASURES[name]
    return {qid: fn(judged, run.get(qid, ()), k) for qid, judged in qrels.items()}


def mean(values: Sequence[float] | Mapping[str, float]) -> float:
    vals = list(values.values()) if isinstance(values, Mapping) else list(values)
    return sum(vals) / len(vals) if vals else 0.0


def evaluate(qrels: Qrels, run: Run, names: Sequence[str]) -> dict[str, float]:
    """Mean of each named measure over all judged queries."""
    return {name: mean(per_query(qrels, run, name)) for name in names}


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method), 0 <= p <= 100."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
