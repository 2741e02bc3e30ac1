"""Fusion tuning: RRF k, candidate depth per leg, and convex dense weight, scored with the
real memory.fuse on the stage functions' candidate lists (fetched once per query at the
largest depth; a smaller depth is a prefix). The cascade (LexicalFirst) is swept over its
lexical depth: the lexical prefix re-ranked by exact cosine (memory.search_by_ids)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from poimen_lab.eval.data import Query
from poimen_lab.measures import evaluate, per_query
from poimen_memory.db.queries import q

RRF_KS = (5, 10, 20, 30, 40, 60, 80, 100)
DENSE_WEIGHTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
DEPTHS = (20, 50, 100, 200)
CASCADE_DEPTHS = (10, 20, 30, 50, 100, 200)
MEASURES = ("ndcg@10", "recall@10", "recall@100", "mrr@10")
FINAL_K = 100

# memory.fuse over many queries in one round trip; WITH ORDINALITY keeps its output order.
FUSE_MANY_SQL = """
SELECT l.i, f.node_id
FROM unnest(%(lists)s::jsonb[]) WITH ORDINALITY AS l(lists, i),
     LATERAL memory.fuse(l.lists, %(method)s, %(k)s, %(final_k)s)
             WITH ORDINALITY AS f(node_id, ranks, scores, fused_score, fusion_method, pos)
ORDER BY l.i, f.pos
"""


@dataclass
class Candidates:
    lex: list[tuple[int, float]]
    sem: list[tuple[int, float]]
    cosine: dict[int, float]


def fetch(
    conn: psycopg.Connection[Any],
    queries: Sequence[Query],
    vectors: Mapping[str, Any],
    levels: Sequence[str],
    on_done: Callable[[], None] | None = None,
) -> dict[str, Candidates]:
    out: dict[str, Candidates] = {}
    depth = max(DEPTHS)
    for qy in queries:
        base = {"project": qy.project, "levels": list(levels), "since": None, "before": None}
        lex = conn.execute(q("lexical_search"), {**base, "query": qy.text, "k": depth}).fetchall()
        sem = conn.execute(
            q("semantic_search"),
            {**base, "embedding": vectors[qy.id], "k": depth, "ef_search": None},
        ).fetchall()
        cos = conn.execute(
            q("search_by_ids"),
            {**base, "embedding": vectors[qy.id], "ids": [r[0] for r in lex], "k": depth},
        ).fetchall()
        out[qy.id] = Candidates(
            [(r[0], r[2]) for r in lex], [(r[0], r[2]) for r in sem], {r[0]: r[2] for r in cos}
        )
        if on_done:
            on_done()
    return out


def _fuse(
    conn: psycopg.Connection[Any],
    cands: Mapping[str, Candidates],
    qids: Sequence[str],
    method: str,
    k: int,
    depth: int,
    w_sem: float,
    w_lex: float,
) -> dict[str, list[int]]:
    lists = []
    for qid in qids:
        c = cands[qid]
        lists.append(
            json.dumps(
                [
                    {
                        "ids": [i for i, _ in c.sem[:depth]],
                        "scores": [s for _, s in c.sem[:depth]],
                        "weight": w_sem,
                    },
                    {
                        "ids": [i for i, _ in c.lex[:depth]],
                        "scores": [s for _, s in c.lex[:depth]],
                        "weight": w_lex,
                    },
                ]
            )
        )
    out: dict[str, list[int]] = {qid: [] for qid in qids}
    rows = conn.execute(
        FUSE_MANY_SQL, {"lists": lists, "method": method, "k": k, "final_k": FINAL_K}
    ).fetchall()
    for i, nid in rows:
        out[qids[i - 1]].append(nid)
    return out


def sweep(
    conn: psycopg.Connection[Any],
    cands: Mapping[str, Candidates],
    qrels: Mapping[str, Mapping[str, int]],
    to_ext: Mapping[int, str],
    groups: Mapping[str, str],
    *,
    default: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every configuration's measures, overall and per query group (category or question
    type), and paired differences in nDCG@10 against ``default`` (a configuration of the
    grid: the service's settings, see default_config)."""
    default = default or {"method": "rrf", "k": 60, "depth": 50}
    qids = list(cands)
    group_names = sorted(set(groups.values()))
    judged = {qid: qrels[qid] for qid in qids}
    ndcg_by_label: dict[str, list[float]] = {}

    def score(label: str, run_ids: Mapping[str, list[int]]) -> dict[str, Any]:
        run = {qid: [to_ext[i] for i in ids if i in to_ext] for qid, ids in run_ids.items()}
        perq = per_query(judged, run, "ndcg@10")
        ndcg_by_label[label] = [perq[qid] for qid in qids]
        res: dict[str, Any] = {m: round(v, 4) for m, v in evaluate(judged, run, MEASURES).items()}
        res["groups"] = {}
        for g in group_names:
            sub = [qid for qid in qids if groups.get(qid) == g]
            res["groups"][g] = {
                m: round(v, 4)
                for m, v in evaluate(
                    {qid: qrels[qid] for qid in sub}, run, ("ndcg@10", "recall@100")
                ).items()
            }
        return res

    configs: list[dict[str, Any]] = []

    def add(config: dict[str, Any], run_ids: Mapping[str, list[int]]) -> None:
        configs.append({**config, **score(_label(config), run_ids)})

    for depth in DEPTHS:
        for k in RRF_KS:
            add(
                {"method": "rrf", "k": k, "depth": depth},
                _fuse(conn, cands, qids, "rrf", k, depth, 1.0, 1.0),
            )
        for w in DENSE_WEIGHTS:
            add(
                {"method": "convex", "dense_weight": w, "depth": depth},
                _fuse(conn, cands, qids, "convex", 0, depth, w, 1 - w),
            )
    for depth in CASCADE_DEPTHS:
        add(
            {"method": "cascade", "depth": depth},
            {qid: _by_cosine(cands[qid], depth) for qid in qids},
        )
    baselines = {
        "lexical": score(
            "lexical", {qid: [i for i, _ in cands[qid].lex[:FINAL_K]] for qid in qids}
        ),
        "semantic": score(
            "semantic", {qid: [i for i, _ in cands[qid].sem[:FINAL_K]] for qid in qids}
        ),
    }
    best = _best(
        configs, group_names, {g: sum(1 for v in groups.values() if v == g) for g in group_names}
    )
    base_label = _label(default)
    vs_default: dict[str, Any] = {}
    if base_label in ndcg_by_label:
        at_depth = [
            _label(c)
            for c in configs
            if c["method"] != "cascade" and c["depth"] == default["depth"]
        ]
        best_labels = [best[m]["config"] for m in ("rrf", "convex", "cascade")]
        for label in dict.fromkeys([*at_depth, *best_labels, "lexical", "semantic"]):
            if label != base_label:
                vs_default[label] = paired(ndcg_by_label[label], ndcg_by_label[base_label])
    return {
        "configs": configs,
        "baselines": baselines,
        "best": best,
        "default": base_label,
        "vs_default_ndcg@10": vs_default,
        "queries": len(qids),
        "groups": {g: sum(1 for v in groups.values() if v == g) for g in group_names},
    }


def default_config(policy: Any) -> dict[str, Any]:
    """The database's fusion policy (memory.policy()) as a sweep configuration."""
    if policy.fusion == "convex":
        return {"method": "convex", "dense_weight": policy.dense_weight, "depth": policy.candidates}
    return {"method": "rrf", "k": policy.rrf_k, "depth": policy.candidates}


def paired(a: Sequence[float], b: Sequence[float], *, resamples: int = 2000) -> dict[str, float]:
    """Mean of a - b per query with a 95% paired-bootstrap interval (seeded, reproducible)."""
    import numpy as np

    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (resamples, len(d)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {
        "diff": round(float(d.mean()), 4),
        "ci95_low": round(float(lo), 4),
        "ci95_high": round(float(hi), 4),
    }


def _by_cosine(c: Candidates, depth: int) -> list[int]:
    """The cascade: the lexical prefix ordered by exact cosine (as memory.search_by_ids)."""
    ids = [i for i, _ in c.lex[:depth]]
    return sorted(ids, key=lambda i: (-c.cosine.get(i, -2.0), i))[:FINAL_K]


def _label(c: Mapping[str, Any]) -> str:
    if c["method"] == "rrf":
        return f"rrf k={c['k']} depth={c['depth']}"
    if c["method"] == "convex":
        return f"convex w_dense={c['dense_weight']} depth={c['depth']}"
    return f"cascade depth={c['depth']}"


MIN_GROUP = 30
"""Groups with fewer queries get no per-group recommendation (too noisy)."""


def _best(
    configs: Sequence[Mapping[str, Any]], groups: Sequence[str], sizes: Mapping[str, int]
) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for method in ("rrf", "convex", "cascade"):
        mine = [c for c in configs if c["method"] == method]
        top = max(mine, key=lambda c: (c["ndcg@10"], c["recall@100"]))
        best[method] = {
            "config": _label(top),
            "ndcg@10": top["ndcg@10"],
            "recall@100": top["recall@100"],
        }
    best["by_group"] = {}
    for g in groups:
        if sizes[g] < MIN_GROUP:
            best["by_group"][g] = {"queries": sizes[g], "config": None}
            continue
        top = max(configs, key=lambda c: (c["groups"][g]["ndcg@10"], c["groups"][g]["recall@100"]))
        best["by_group"][g] = {"queries": sizes[g], "config": _label(top), **top["groups"][g]}
    return best


def plot(path: Path, result: Mapping[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs, base = result["configs"], result["baselines"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharey="row")
    for row, measure in enumerate(("ndcg@10", "recall@100")):
        for depth in DEPTHS:
            rrf = [c for c in configs if c["method"] == "rrf" and c["depth"] == depth]
            axes[row][0].plot(
                [c["k"] for c in rrf], [c[measure] for c in rrf], marker="o", label=f"depth {depth}"
            )
            cvx = [c for c in configs if c["method"] == "convex" and c["depth"] == depth]
            axes[row][1].plot(
                [c["dense_weight"] for c in cvx],
                [c[measure] for c in cvx],
                marker="o",
                label=f"depth {depth}",
            )
        cas = [c for c in configs if c["method"] == "cascade"]
        axes[row][2].plot(
            [c["depth"] for c in cas], [c[measure] for c in cas], marker="o", label="cascade"
        )
        for ax in axes[row]:
            ax.axhline(base["lexical"][measure], color="grey", ls="--", label="lexical only")
            ax.axhline(base["semantic"][measure], color="k", ls=":", label="semantic only")
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel(measure)
    axes[1][0].set_xlabel("RRF k")
    axes[1][1].set_xlabel("convex: dense weight (lexical = 1 - w)")
    axes[1][2].set_xlabel("cascade: lexical candidates")
    axes[1][2].set_xticks(CASCADE_DEPTHS)
    axes[0][0].set_title("rrf")
    axes[0][1].set_title("convex (min-max per list)")
    axes[0][2].set_title("cascade (LexicalFirst)")
    axes[0][0].legend(fontsize=8)
    axes[0][2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
