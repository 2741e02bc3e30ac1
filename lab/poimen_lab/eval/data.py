"""Evaluation inputs: nodes, queries and qrels files (format: ../shared/data/README.md),
validated up front so a bad file fails with its name and line before any work starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poimen_memory.ingest.nodes import NodeRecord, parse_lines

MOST = 0.5
"""Above this fraction of qrels naming unknown nodes the files cannot belong together."""


class EvalInputError(Exception):
    """A missing or malformed input file (the CLI exits 2 with this message)."""


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    project: str | None = None
    category: str | None = None


@dataclass
class EvalData:
    dataset: str
    records: list[NodeRecord]
    queries: list[Query]
    qrels: dict[str, dict[str, int]]
    session_qrels: dict[str, dict[str, int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def judged(self) -> list[Query]:
        """Queries with at least one relevant node: the ones the measures average over."""
        return [q for q in self.queries if any(r >= 1 for r in self.qrels.get(q.id, {}).values())]


def _jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise EvalInputError(f"{path}: no such file")
    rows: list[tuple[int, dict[str, Any]]] = []
    with path.open(encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise EvalInputError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise EvalInputError(f"{path}:{n}: each line must be a JSON object")
            rows.append((n, obj))
    if not rows:
        raise EvalInputError(f"{path}: the file is empty")
    return rows


def _id(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int) or str(value) == "":
        return None
    return str(value)


def load_queries(path: Path) -> list[Query]:
    out: list[Query] = []
    seen: set[str] = set()
    for n, obj in _jsonl(path):
        qid, text, project = _id(obj.get("id")), obj.get("text"), obj.get("project")
        if qid is None:
            raise EvalInputError(f"{path}:{n}: 'id' must be a non-empty string or integer")
        if not isinstance(text, str) or not text.strip():
            raise EvalInputError(f"{path}:{n}: 'text' must be a non-empty string")
        if project is not None and not isinstance(project, str):
            raise EvalInputError(f"{path}:{n}: 'project' must be a string or null")
        if qid in seen:
            raise EvalInputError(f"{path}:{n}: duplicate query id {qid!r}")
        seen.add(qid)
        cat = obj.get("category")
        out.append(Query(qid, text, project or None, None if cat is None else str(cat)))
    return out


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for n, obj in _jsonl(path):
        qid, nid, score = _id(obj.get("query_id")), _id(obj.get("node_id")), obj.get("score", 1)
        if qid is None or nid is None:
            raise EvalInputError(f"{path}:{n}: 'query_id' and 'node_id' are required")
        if isinstance(score, bool) or not isinstance(score, int | float) or score != int(score):
            raise EvalInputError(f"{path}:{n}: 'score' must be an integer relevance grade")
        out.setdefault(qid, {})[nid] = int(score)
    return out


def load_nodes(path: Path) -> list[NodeRecord]:
    if not path.is_file():
        raise EvalInputError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        records, invalid = parse_lines(f)
    if invalid:
        shown = "; ".join(str(e) for e in invalid[:5])
        raise EvalInputError(f"{path}: {len(invalid)} invalid line(s): {shown}")
    if not records:
        raise EvalInputError(f"{path}: no nodes")
    return records


def _check_against_corpus(
    name: str,
    qrels: dict[str, dict[str, int]],
    corpus: set[str],
    queries: set[str],
    warnings: list[str],
) -> dict[str, dict[str, int]]:
    total = sum(len(j) for j in qrels.values())
    missing = sum(1 for j in qrels.values() for d in j if d not in corpus)
    if missing and missing > MOST * total:
        raise EvalInputError(
            f"{name}: {missing} of {total} judgements name nodes that are not in "
            "the nodes file: wrong files?"
        )
    if missing:
        warnings.append(f"{name}: {missing} of {total} judgements name unknown nodes (ignored)")
    orphans = len(set(qrels) - queries)
    if orphans:
        warnings.append(f"{name}: {orphans} judged query ids are not in the queries file (ignored)")
    return {
        q: {d: r for d, r in j.items() if d in corpus} for q, j in qrels.items() if q in queries
    }


def load(
    nodes: Path,
    queries: Path,
    qrels: Path,
    *,
    session_qrels: Path | None = None,
    dataset: str | None = None,
    limit_queries: int | None = None,
) -> EvalData:
    records = load_nodes(nodes)
    qs = load_queries(queries)
    corpus = {r.external_id for r in records if r.external_id is not None}
    warnings: list[str] = []
    qids = {q.id for q in qs}
    judged = _check_against_corpus(str(qrels), load_qrels(qrels), corpus, qids, warnings)
    sessions: dict[str, dict[str, int]] = {}
    if session_qrels is not None:
        sessions = _check_against_corpus(
            str(session_qrels), load_qrels(session_qrels), corpus, qids, warnings
        )
    if limit_queries is not None:
        qs = qs[:limit_queries]
        kept = {q.id for q in qs}
        judged = {q: j for q, j in judged.items() if q in kept}
        sessions = {q: j for q, j in sessions.items() if q in kept}
    data = EvalData(dataset or nodes.resolve().parent.name, records, qs, judged, sessions, warnings)
    if not data.judged:
        raise EvalInputError(f"{qrels}: no query in {queries} has a relevant node")
    unjudged = len(qs) - len(data.judged)
    if unjudged:
        warnings.append(f"{unjudged} queries have no relevant node and are not measured")
    return data
