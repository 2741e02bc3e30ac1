"""Ranking signals beyond today's two legs, measured before any is built (issue 13: SciFact
nDCG@10 at least 0.75 on the default path, which stands at 0.736).

Every signal is scored over the whole corpus in process, from what the database holds: the
nodes' own vectors (memory.nodes.embedding), BM25 on the database's own lexemes (bm25s on
memory.postings, as ``--bm25s`` in ``poimen-memory eval``: identical top-10s) and the
local embedder for queries and sentences. Fusion is memory.fuse's convex rule (min-max over
each list's top ``depth``, 0 where a node is absent), so the ``default`` row must
reproduce the service's hybrid-convex nDCG@10 (0.736 on SciFact): that is the check that
the other rows measure the same pipeline. Each row has its nDCG@10 on all queries, on the
two alternating halves (a setting chosen on one half can be read on the other) and its
paired difference from ``default`` with a 95% bootstrap interval.

The one signal that needs new vectors, ``passages``, embeds every sentence of every node
(about 7 minutes for SciFact's 45k sentences here); ``--cache`` keeps them:

    python -m poimen_lab.eval.signals --url URL --data ../shared/data/scifact \\
        --queries queries-train.jsonl --qrels qrels-train.jsonl --cache /var/tmp/sf-sentences.npz
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from poimen_lab.bm25_peer import PgLexemeBM25
from poimen_lab.eval.data import load_qrels, load_queries
from poimen_lab.eval.fusion_sweep import paired
from poimen_lab.measures import ndcg_at
from poimen_lab.report import table
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LOCAL_MODEL_NAME, LocalEmbedder

Array = npt.NDArray[Any]
Signals = dict[str, Array]

# A sentence ends at . ! or ? followed by space and an upper-case letter, digit or "(":
# enough for abstracts, and cheap; "e.g. X" splits wrongly, which only costs a vector.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(])")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()]


def best_per_owner(scores: Array, owner: Array, n: int) -> Array:
    """Each owner's best score (-1, cosine's floor, for an owner without sentences)."""
    out = np.full(n, -1.0, dtype=np.float64)
    np.maximum.at(out, owner, scores)
    return out


def top(
    scores: Array, ids: Array, depth: int, *, positive: bool, eligible: Array | None = None
) -> Array:
    """Indices of the best ``depth`` eligible nodes by score, ties by lower id (as the SQL
    legs order)."""
    order = np.lexsort((ids, -scores))
    if eligible is not None:
        order = order[eligible[order]]
    order = order[:depth]
    return order[scores[order] > 0] if positive else order


def convex(
    signals: Mapping[str, Array],
    weights: Mapping[str, float],
    ids: Array,
    depth: int,
    eligible: Array | None = None,
) -> Array:
    """memory.fuse's convex rule over the top ``depth`` of each weighted signal, among the
    ``eligible`` nodes (the query's project): indices, best first. BM25 lists keep only
    nodes that match (score > 0), as lexical_search does."""
    lists = {
        name: top(signals[name], ids, depth, positive=name.startswith("bm25"), eligible=eligible)
        for name, w in weights.items()
        if w > 0
    }
    cand = np.unique(np.concatenate(list(lists.values())))
    fused = np.zeros(len(cand))
    best_rank = np.full(len(cand), np.iinfo(np.int64).max)
    for name, idx in lists.items():
        s = signals[name][idx]
        lo, hi = float(s.min()), float(s.max())
        v = signals[name][cand]
        norm = (v - lo) / (hi - lo) if hi > lo else np.ones_like(v)
        fused += weights[name] * np.where(np.isin(cand, idx), norm, 0.0)
        rank = {int(c): r for r, c in enumerate(idx, start=1)}
        best_rank = np.minimum(best_rank, [rank.get(int(c), best_rank[0]) for c in cand])
    # memory.fuse's order: fused score, then the best single-list rank, then the lower id.
    return cand[np.lexsort((ids[cand], best_rank, -fused))]


@dataclass
class Corpus:
    ids: Array
    external: list[str]
    vectors: Array
    texts: list[str]
    projects: list[str]


def load_corpus(url: str) -> Corpus:
    """The embedded nodes (a node without a vector is in no dense list, as in the service)."""
    with connect(url) as conn:
        model = conn.execute("SELECT model FROM memory.embedding_model")
        found = model.fetchone()
        if found is None or found[0] != LOCAL_MODEL_NAME:
            raise SystemExit(
                f"the database's vectors are {found[0] if found else 'absent'!r}; these"
                f" measurements embed queries and sentences with {LOCAL_MODEL_NAME!r}"
            )
        rows = conn.execute(
            "SELECT n.id, n.external_id, n.embedding::text, n.text, p.name"
            " FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
            " WHERE n.embedding IS NOT NULL ORDER BY n.id"
        ).fetchall()
    return Corpus(
        ids=np.array([r[0] for r in rows], dtype=np.int64),
        external=[r[1] for r in rows],
        vectors=np.array([json.loads(r[2]) for r in rows], dtype=np.float64),
        texts=[r[3] for r in rows],
        projects=[r[4] for r in rows],
    )


def sentence_vectors(
    corpus: Corpus, embedder: LocalEmbedder, cache: Path | None
) -> tuple[Array, Array]:
    """(vectors, owner index) of every sentence of every node, from ``cache`` when it holds
    them for this corpus."""
    key = np.array([LOCAL_MODEL_NAME, SENTENCE_END.pattern])
    if cache is not None and cache.exists():
        saved = np.load(cache)
        if (
            np.array_equal(saved["ids"], corpus.ids)
            and "key" in saved
            and np.array_equal(saved["key"], key)
        ):
            return saved["vectors"], saved["owner"]
    texts, owner = [], []
    for j, text in enumerate(corpus.texts):
        for s in sentences(text):
            texts.append(s)
            owner.append(j)
    vectors = np.asarray(embedder.embed_documents(texts), dtype=np.float64)
    owners = np.array(owner, dtype=np.int64)
    if cache is not None:
        np.savez(cache, ids=corpus.ids, vectors=vectors, owner=owners, key=key)
    return vectors, owners


# name -> (weights over signals, how the signals are made). "dense" is the node's vector,
# "passage" the best of its sentences', "mixed" a blend of the two; "bm25" today's BM25
# (k1 1.2, b 0.75) and "bm25_k09b04" Anserini's defaults.
Config = tuple[dict[str, float], str]
CONFIGS: dict[str, Config] = {
    "default (bm25 .6, dense .4)": ({"bm25": 0.6, "dense": 0.4}, ""),
    "lexical only": ({"bm25": 1.0}, ""),
    "dense only": ({"dense": 1.0}, ""),
    "bm25 k1 0.9 b 0.4": ({"bm25_k09b04": 0.6, "dense": 0.4}, ""),
    "dense feedback (top 3, beta .5)": ({"bm25": 0.6, "dense": 0.4}, "prf"),
    "passage only": ({"passage": 1.0}, ""),
    "mixed only (node .6, passage .4)": ({"mixed": 1.0}, ""),
    "bm25 .5, mixed .5": ({"bm25": 0.5, "mixed": 0.5}, ""),
    "bm25 .6, mixed .4": ({"bm25": 0.6, "mixed": 0.4}, ""),
    "bm25 .5, dense .3, passage .2": ({"bm25": 0.5, "dense": 0.3, "passage": 0.2}, ""),
    "bm25 .4, dense .3, passage .3": ({"bm25": 0.4, "dense": 0.3, "passage": 0.3}, ""),
}


def rank(
    config: Config,
    signals: Signals,
    corpus: Corpus,
    query_vector: Array,
    query_signals: Callable[[Array], Signals],
    depth: int,
    eligible: Array | None,
) -> Array:
    weights, how = config
    ranked = convex(signals, weights, corpus.ids, depth, eligible)
    if how == "prf":
        # Rocchio in vector space: the query moved towards its first three fused results.
        q2 = query_vector + 0.5 * corpus.vectors[ranked[:3]].mean(axis=0)
        q2 = q2 / np.linalg.norm(q2)
        ranked = convex({**signals, **query_signals(q2)}, weights, corpus.ids, depth, eligible)
    return ranked


def measure(
    url: str,
    queries: Sequence[Any],
    judged: Mapping[str, Mapping[str, int]],
    *,
    cache: Path | None = None,
    configs: Mapping[str, Config] = CONFIGS,
    depth: int = 50,
) -> dict[str, list[float]]:
    """Per configuration, nDCG@10 of each query (in ``queries``' order)."""
    corpus = load_corpus(url)
    embedder = LocalEmbedder()
    sent, owner = sentence_vectors(corpus, embedder, cache)
    n = len(corpus.ids)
    with connect(url) as conn:
        peers = {
            "bm25": PgLexemeBM25(conn, sorted(set(corpus.projects))),
            "bm25_k09b04": PgLexemeBM25(conn, sorted(set(corpus.projects)), k1=0.9, b=0.4),
        }
        lexemes = peers["bm25"].query_lexemes([q.text for q in queries])
    qvecs = np.asarray(embedder.embed_documents([q.text for q in queries]), dtype=np.float64)
    position = {int(i): j for j, i in enumerate(corpus.ids)}

    def bm25(peer: PgLexemeBM25, terms: list[str], project: str | None) -> Array:
        out = np.zeros(n)
        # Without a project, one index over every project (PgLexemeBM25 builds it when
        # there are several), as lexical_search sums their statistics.
        ix = peer.indexes.get(project) if project else next(reversed(peer.indexes.values()))
        if ix is None:
            return out
        known = [t for t in terms if t in ix.model.vocab_dict]
        if known:
            for node, s in zip(ix.ids, ix.model.get_scores(known), strict=True):
                out[position[int(node)]] = s
        return out

    def dense(v: Array) -> Signals:
        d = corpus.vectors @ v
        p = best_per_owner(sent @ v, owner, n)
        return {"dense": d, "passage": p, "mixed": 0.6 * d + 0.4 * p}

    projects = np.array(corpus.projects)
    out: dict[str, list[float]] = {name: [] for name in configs}
    for q, terms, v in zip(queries, lexemes, qvecs, strict=True):
        eligible = None if q.project is None else projects == q.project
        signals = {name: bm25(peer, terms, q.project) for name, peer in peers.items()}
        signals.update(dense(v))
        for name, config in configs.items():
            ranked = rank(config, signals, corpus, v, dense, depth, eligible)
            out[name].append(ndcg_at(judged[q.id], [corpus.external[i] for i in ranked], 10))
    return out


def report(per_query: Mapping[str, list[float]], baseline: str) -> str:
    rows = []
    for name, values in per_query.items():
        a = np.asarray(values)
        d = paired(values, per_query[baseline])
        rows.append(
            [
                name,
                f"{a.mean():.4f}",
                f"{a[0::2].mean():.4f}",
                f"{a[1::2].mean():.4f}",
                f"{d['diff']:+.4f} [{d['ci95_low']:+.4f}, {d['ci95_high']:+.4f}]",
            ]
        )
    return table(rows, ["signals", "nDCG@10", "half A", "half B", f"vs {baseline}"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--queries", default="queries.jsonl")
    p.add_argument("--qrels", default="qrels.jsonl")
    p.add_argument("--cache", type=Path, default=None, help="sentence vectors (.npz), reused")
    p.add_argument("--json", type=Path, default=None, help="per-query nDCG@10 of every row")
    args = p.parse_args(argv)
    judged = load_qrels(args.data / args.qrels)
    queries = [q for q in load_queries(args.data / args.queries) if judged.get(q.id)]
    per_query = measure(args.url, queries, judged, cache=args.cache)
    print(report(per_query, next(iter(CONFIGS))))
    if args.json:
        args.json.write_text(json.dumps(per_query))


if __name__ == "__main__":
    main()
