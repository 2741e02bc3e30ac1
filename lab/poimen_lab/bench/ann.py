"""Vector search benchmark: memory.semantic_search's ef_search sweep against the
memory.exact_search ground truth, beside hnswlib (same M and ef_construction) and numpy
brute force on the same vectors, with and without a selective (1%) project filter."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import psycopg

from poimen_lab.measures import percentile
from poimen_memory.db.queries import q

EF_SEARCH = (10, 20, 40, 64, 100, 200, 400)
TARGETS = (0.90, 0.95, 0.99)
K = 10


def _timed(fn: Callable[[int], list[int]], n: int) -> tuple[list[list[int]], list[float]]:
    out: list[list[int]] = []
    ms: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        out.append(fn(i))
        ms.append((time.perf_counter() - t0) * 1000)
    return out, ms


def recall(found: Sequence[Sequence[int]], truth: Sequence[Sequence[int]]) -> float:
    vals = [
        len(set(f[:K]) & set(t[:K])) / max(len(t[:K]), 1) for f, t in zip(found, truth, strict=True)
    ]
    return sum(vals) / len(vals) if vals else 0.0


def _row(
    name: str,
    ef: int | None,
    found: list[list[int]],
    truth: list[list[int]],
    ms: list[float],
    **extra: Any,
) -> dict[str, Any]:
    return {
        "engine": name,
        "ef_search": ef,
        "recall@10": round(recall(found, truth), 4),
        "p50_ms": round(percentile(ms, 50), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        **extra,
    }


class AnnBench:
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        vectors: np.ndarray[Any, Any],
        db_ids: np.ndarray[Any, Any],
        queries: np.ndarray[Any, Any],
    ) -> None:
        self.conn, self.vectors, self.db_ids, self.queries = conn, vectors, db_ids, queries
        self.pos = {int(d): i for i, d in enumerate(db_ids)}

    def _sql(self, name: str, qi: int, project: str | None, **params: Any) -> list[int]:
        rows = self.conn.execute(
            q(name),
            {
                "embedding": self.queries[qi],
                "project": project,
                "levels": None,
                "k": K,
                "since": None,
                "before": None,
                **params,
            },
        ).fetchall()
        return [self.pos[r[0]] for r in rows]

    def _semantic(self, i: int, *, project: str | None, ef: int) -> list[int]:
        return self._sql("semantic_search", i, project, ef_search=ef)

    def exact(self, project: str | None) -> tuple[list[list[int]], list[float]]:
        return _timed(lambda i: self._sql("exact_search", i, project), len(self.queries))

    def ours(self, project: str | None, truth: list[list[int]]) -> list[dict[str, Any]]:
        rows = []
        for ef in EF_SEARCH:
            self._sql("semantic_search", 0, project, ef_search=ef)  # warm the plan
            found, ms = _timed(partial(self._semantic, project=project, ef=ef), len(self.queries))
            filled = sum(len(f) == K for f in found) / max(len(found), 1)
            rows.append(_row("pgvector hnsw", ef, found, truth, ms, limit_filled=round(filled, 4)))
        return rows

    def numpy(self, subset: np.ndarray[Any, Any] | None, truth: list[list[int]]) -> dict[str, Any]:
        idx = np.arange(len(self.vectors)) if subset is None else subset
        mat = np.ascontiguousarray(self.vectors[idx])

        def search(i: int) -> list[int]:
            scores = mat @ self.queries[i]
            top = np.argpartition(-scores, min(K, len(idx) - 1))[:K]
            return [int(idx[j]) for j in top[np.argsort(-scores[top], kind="stable")]]

        found, ms = _timed(search, len(self.queries))
        return _row("numpy brute force", None, found, truth, ms)

    def hnswlib(self, threads: int) -> tuple[Any, float]:
        import hnswlib

        index = hnswlib.Index(space="cosine", dim=self.vectors.shape[1])
        t0 = time.perf_counter()
        index.init_index(max_elements=len(self.vectors), M=16, ef_construction=64, random_seed=0)
        index.add_items(self.vectors, np.arange(len(self.vectors)), num_threads=threads)
        return index, time.perf_counter() - t0

    def hnswlib_sweep(
        self, index: Any, truth: list[list[int]], allowed: set[int] | None = None
    ) -> list[dict[str, Any]]:
        rows = []
        flt = None if allowed is None else (lambda label: label in allowed)
        for ef in EF_SEARCH:
            index.set_ef(max(ef, K))
            failed = 0

            def search(i: int) -> list[int]:
                nonlocal failed
                try:
                    labels, _ = index.knn_query(self.queries[i], k=K, num_threads=1, filter=flt)
                except RuntimeError:  # fewer than k results pass the filter at this ef
                    failed += 1
                    return []
                return [int(x) for x in labels[0]]

            found, ms = _timed(search, len(self.queries))
            extra = {"incomplete": failed} if allowed is not None else {}
            rows.append(_row("hnswlib", ef, found, truth, ms, **extra))
        return rows


def matched(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each recall target: the fastest configuration of each engine that reaches it."""
    out = []
    for target in TARGETS:
        a = min(
            (r for r in ours if r["recall@10"] >= target), key=lambda r: r["p50_ms"], default=None
        )
        b = min(
            (r for r in peer if r["recall@10"] >= target), key=lambda r: r["p50_ms"], default=None
        )
        row: dict[str, Any] = {"target_recall": target}
        if a:
            row.update(ours_ef=a["ef_search"], ours_p50_ms=a["p50_ms"])
        if b:
            row.update(peer_ef=b["ef_search"], peer_p50_ms=b["p50_ms"])
        if a and b:
            row["ratio_ours_over_peer"] = round(a["p50_ms"] / max(b["p50_ms"], 1e-9), 1)
        out.append(row)
    return out
