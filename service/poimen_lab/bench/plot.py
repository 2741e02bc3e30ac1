"""Recall-versus-latency chart of `poimen-memory bench` (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot(path: Path, result: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, label in zip(axes, ("unfiltered", "filtered_1pct"), strict=True):
        a = result["ann"][label]
        for key, style in (("ours", "o-"), ("hnswlib", "s-")):
            rows = a[key]
            ax.plot(
                [r["p50_ms"] for r in rows],
                [r["recall@10"] for r in rows],
                style,
                label="pgvector semantic_search" if key == "ours" else "hnswlib",
            )
            for r in rows:
                ax.annotate(
                    str(r["ef_search"]),
                    (r["p50_ms"], r["recall@10"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(3, -9),
                )
        ax.plot([a["numpy"]["p50_ms"]], [a["numpy"]["recall@10"]], "k^", label="numpy brute force")
        ax.plot([a["exact_search"]["p50_ms"]], [1.0], "rv", label="memory.exact_search")
        ax.set_xscale("log")
        ax.set_xlabel("p50 latency per query (ms, log)")
        ax.set_ylabel("recall@10 vs exact_search")
        ax.set_title(f"{label}: {a['filter_nodes']} candidate nodes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"{result['nodes']} nodes x {result['dim']} dims, {result['queries']} queries; "
        "labels: ef_search"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
