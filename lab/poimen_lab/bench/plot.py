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


# bench-recall's scopes in the order it measures them (recall.scopes): the label of each
# position, whatever share the project nearest it holds at a given size.
RECALL_SCOPES = ("unfiltered", "largest project", "project ~10%", "project ~1%", "project ~0.1%")


def recall_by_size(path: Path, runs: list[Mapping[str, Any]]) -> None:
    """recall@10 against the store's size, from `bench-recall --json` runs at several sizes:
    the semantic leg at its defaults and memory_query()'s answers, per scope."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: int(r["nodes"]))
    sizes = [int(r["nodes"]) for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    panels = (
        ("semantic leg (memory.semantic_search, its defaults)", "results"),
        ("memory_query() answers (k 10, default levels)", "answers"),
    )
    for ax, (title, key) in zip(axes, panels, strict=True):
        for pos, label in enumerate(RECALL_SCOPES):
            ys = []
            for r in runs:
                scope = _scope_at(r, pos)
                rows = [
                    x
                    for x in r.get(key, [])
                    if x["scope"] == scope and x.get("setting", "default") == "default"
                ]
                ys.append(rows[0]["recall@10"] if rows else float("nan"))
            ax.plot(sizes, ys, "o-", label=label)
        ax.axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("nodes in the store (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("recall@10 against an exact ground truth")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"bench-recall, {runs[0]['corpus']} corpus, as the service's role under RLS")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _scope_at(run: Mapping[str, Any], pos: int) -> str | None:
    """The label of the run's pos-th scope, in the order it measured them."""
    seen: list[str] = []
    for x in run.get("results", []):
        if x["scope"] not in seen:
            seen.append(x["scope"])
    return seen[pos] if pos < len(seen) else None


def peers_cost_quality(path: Path, result: Mapping[str, Any]) -> None:
    """`bench-peers`: each system's CPU per query (every process summed) against its quality,
    one panel per data set; the labels give the p50 latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(result["sets"].items())
    fig, axes = plt.subplots(1, max(len(sets), 1), figsize=(6.5 * max(len(sets), 1), 4.8))
    axes = [axes] if len(sets) <= 1 else list(axes)
    markers = {"supabase": "s", "langchain": "D", "poimen": "o", "poimen-evidence0": "^"}
    for ax, (name, s) in zip(axes, sets, strict=False):
        for system, r in s["systems"].items():
            if s["measure"] is None:  # no judgements (the realistic corpus): cost and time
                ax.plot([r["cpu_ms"]], [r["p50_ms"]], markers.get(system, "o"), label=system)
                continue
            lo, hi = r["quality_ci95"]
            ax.errorbar(
                [r["cpu_ms"]],
                [r["quality"]],
                yerr=[[r["quality"] - lo], [hi - r["quality"]]],
                fmt=markers.get(system, "o"),
                capsize=3,
                label=system,
            )
            ax.annotate(
                f"p50 {r['p50_ms']:.0f} ms",
                (r["cpu_ms"], r["quality"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(5, -10),
            )
        ax.set_xlabel("CPU per query, ms (database + server + client)")
        ax.set_ylabel(s["measure"] or "p50 ms")
        ax.set_title(f"{name}: {s['questions']} questions", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("bench-peers: cost against quality, same cluster, nodes and vectors")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
