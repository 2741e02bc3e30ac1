"""The HTTP body of an answer: the database's answer document (memory._finish,
sql/071_execute.sql) in the response's shape, with what only the service knows (its
upstreams' times and failures, the replica that served). Nothing here ranks, scores or
selects: the values are the database's, as memory.query and memory.answer return them."""

from __future__ import annotations

from typing import Any

from poimen_memory.errors import from_sqlstate
from poimen_memory.retrieval.models import QueryRequest, Trace

# The stage times the database measures, as the metrics name them; a stage that did not
# run is null (the database leaves it out).
_DB_STAGES = (
    "lexical_time_ms",
    "semantic_time_ms",
    "evidence_legs_time_ms",
    "fusion_time_ms",
    "provenance_time_ms",
    "evidence_time_ms",
)
# What results and evidence show of a node alike, then what each adds.
_NODE_FIELDS = (
    "rank",
    "external_id",
    "level",
    "sha256",
    "project",
    "title",
    "text",
    "source",
    "breadcrumb",
    "timestamp",
    "metadata",
)
_RESULT_FIELDS = (
    *_NODE_FIELDS,
    "query_score",
    "lexical_score",
    "final_score",
    "rerank_score",
    "semantic_rank",
    "lexical_rank",
    "fusion_method",
)
_EVIDENCE_FIELDS = (
    *_NODE_FIELDS,
    "score",
    "direct_rank",
    "cited_by",
    "neighbour_score",
    "revision",
    "superseded",
)


def _result(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: r.get(k) for k in _RESULT_FIELDS}
    out["parents"] = r["provenance"]
    out["provenance_truncated"] = r["provenance_truncated"]
    if "provenance_l0_omitted" in r:
        out["provenance_l0_omitted"] = r["provenance_l0_omitted"]
    out["support"] = r["support"]
    out["changed_parents"] = r["changed_parents"]
    out["uncited_reason"] = r["uncited_reason"]
    return out


def response(
    req: QueryRequest, doc: dict[str, Any], trace: Trace, reranked: bool, elapsed_ms: float
) -> dict[str, Any]:
    plan = doc["plan"]
    counts = doc["counts"]
    results = [_result(r) for r in doc["results"]]
    # The replica's account first (it chose where the plan ran), then the plan's, then the
    # reranker's (it ran last).
    first = [d for d in trace.degraded if d["stage"] == "replica"]
    degraded = first + plan["degraded"] + [d for d in trace.degraded if d not in first]
    served = trace.why[: len(first)]
    why = served + plan["why"] + trace.why[len(first) :]
    engines: dict[str, str | None] = {}
    if plan["lexical"]["engine"]:
        engines["lexical"] = plan["lexical"]["engine"]
    if plan["semantic"]["engine"]:
        engines["semantic"] = plan["semantic"]["engine"]
    engines.update(trace.engines)
    metrics = dict(trace.metrics)
    for key in _DB_STAGES:
        ms = doc["stages"].get(key)
        metrics[key] = None if ms is None else round(float(ms), 3)
    if plan["lexical"]["engine"] == "opensearch" and metrics["lexical_time_ms"] is not None:
        # The leg is the service's OpenSearch call; the database only joined its hits.
        metrics["lexical_time_ms"] = round(
            metrics["lexical_time_ms"] + trace.metrics["opensearch_time_ms"], 3
        )
    metrics.update(
        {
            "semantic_candidates": counts["semantic_candidates"],
            "lexical_candidates": counts["lexical_candidates"],
            "evidence_legs": counts["evidence_legs"],
            "final_count": len(results),
            "withheld": counts["withheld"],
            "total_time_ms": round(elapsed_ms, 3),
        }
    )
    # What the service runs, null when it did not run (no embedding, reranker or OpenSearch
    # call).
    for key in ("embed_time_ms", "rerank_time_ms", "opensearch_time_ms", "embedding_cache_hit"):
        metrics.setdefault(key, None)
    evidence_plan: dict[str, Any] = {
        "budget": plan["evidence"]["budget"],
        "source": plan["evidence"]["source"],
        "direct_candidates": counts["direct_candidates"],
    }
    failed = doc.get("evidence_failed")
    if failed:
        code = from_sqlstate(failed["sqlstate"], failed["message"]).code
        evidence_plan["degraded"] = code
        degraded.append({"stage": "evidence", "reason": code})
        why.append(f"evidence failed ({code}): the results keep their whole trees")
    notes = [f"{len(results)} result{'' if len(results) == 1 else 's'}"]
    if reranked:
        notes.append(f"reranker reduced {counts['fused']} candidates to {len(results)}")
    return {
        "query": req.query,
        "project": req.project,
        "level_filter": plan["levels"],
        "search_strategy": plan["search_strategy"],
        "plan": {
            "question_type": plan["question_type"],
            "confidence": plan["confidence"],
            "reasons": plan["reasons"],
            "optimizer_strategy": plan["optimizer_strategy"],
            "time_filter": plan["time_filter"],
            "grammar": plan["grammar"],
            "filter": plan["filter"],
            "floor": plan["floor"],
            "recency": plan["recency"],
            "as_of": plan["as_of"],
            "valid_at": plan["valid_at"],
            "evidence": evidence_plan,
            "engines": engines,
            "why": why,
        },
        "results": results,
        "withheld": counts["withheld"],
        "demoted": counts["demoted"],
        "excluded": counts["excluded"],
        "evidence": [{k: e.get(k) for k in _EVIDENCE_FIELDS} for e in doc["evidence"] or []],
        "metrics": metrics,
        "latency_ms": round(elapsed_ms, 3),
        "notes": "; ".join(notes + why),
        "degraded": degraded,
    }
