"""Cost curves from several `poimen-memory bench --json` runs at different sizes: one row per
stage, one column per size, p50 ms unless the row says otherwise, and (with --plot) the
same on log-log axes.

    python -m poimen_lab.bench.curve bench-10000.json bench-100000.json bench-1000000.json \\
        --plot curve.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from poimen_lab.report import table

Run = dict[str, Any]


def _ours(r: Run, label: str, ef: int, key: str) -> Any:
    return next((x[key] for x in r["ann"][label]["ours"] if x["ef_search"] == ef), None)


def _peer(r: Run, ef: int, key: str) -> Any:
    return next((x[key] for x in r["ann"]["unfiltered"]["hnswlib"] if x["ef_search"] == ef), None)


def _http(r: Run, clients: int, key: str) -> Any:
    return next((h[key] for h in r.get("http", []) if h["clients"] == clients), None)


# (row label, whether it is a latency to plot, how to read it from one run)
ROWS: list[tuple[str, bool, Callable[[Run], Any]]] = [
    ("COPY with lexical triggers, s", False, lambda r: r["load"]["copy_seconds"]),
    ("COPY nodes/s", False, lambda r: round(r["load"]["copy_nodes_per_s"])),
    ("HNSW build (pgvector), s", False, lambda r: r["load"]["hnsw_build_seconds"]),
    ("HNSW build (hnswlib), s", False, lambda r: r["ann"]["hnswlib_build_seconds"]),
    ("HNSW index, MiB", False, lambda r: round(r["load"]["hnsw_index_mb"])),
    ("exact_search", True, lambda r: r["ann"]["unfiltered"]["exact_search"]["p50_ms"]),
    ("numpy brute force", True, lambda r: r["ann"]["unfiltered"]["numpy"]["p50_ms"]),
    ("semantic_search ef 100", True, lambda r: _ours(r, "unfiltered", 100, "p50_ms")),
    ("  recall@10", False, lambda r: _ours(r, "unfiltered", 100, "recall@10")),
    ("hnswlib ef 100", True, lambda r: _peer(r, 100, "p50_ms")),
    ("  recall@10", False, lambda r: _peer(r, 100, "recall@10")),
    ("semantic_search 1% filter ef 100", True, lambda r: _ours(r, "filtered_1pct", 100, "p50_ms")),
    ("  recall@10", False, lambda r: _ours(r, "filtered_1pct", 100, "recall@10")),
    ("lexical_search top 10", True, lambda r: r["lexical"]["lexical_search"]["p50_ms"]),
    ("bm25s top 10", True, lambda r: r["lexical"]["bm25s"]["p50_ms"]),
    ("fuse (rrf, 2 x 50)", True, lambda r: r["fuse_rrf_2x50"]["p50_ms"]),
    ("hydrate 10 with provenance", True, lambda r: r["hydrate_10_with_provenance"]["p50_ms"]),
    ("provenance_walk 10", True, lambda r: r["provenance_walk_10"]["p50_ms"]),
    ("GET /memory/query, 1 client", True, lambda r: _http(r, 1, "p50_ms")),
    ("GET /memory/query, 8 clients, req/s", False, lambda r: _http(r, 8, "req_per_s")),
    ("same pipeline in process", True, lambda r: r.get("inprocess", {}).get("p50_ms")),
]


def _cells(read: Callable[[Run], Any], runs: Sequence[Run]) -> list[Any]:
    """One stage across the runs; None where a run lacks the part (e.g. --no-http)."""
    cells = []
    for r in runs:
        try:
            cells.append(read(r))
        except (KeyError, TypeError):
            cells.append(None)
    return cells


def rows(runs: Sequence[Run]) -> list[list[Any]]:
    return [[label, *_cells(read, runs)] for label, _, read in ROWS]


def plot(path: Path, runs: Sequence[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["nodes"] for r in runs]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lines = [(label, read) for label, latency, read in ROWS if latency]
    colours = plt.get_cmap("tab20")(range(len(lines)))
    for (label, read), colour in zip(lines, colours, strict=True):
        pts = [(x, y) for x, y in zip(sizes, _cells(read, runs), strict=True) if y]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes (log)")
    ax.set_ylabel("p50 ms per query (log)")
    ax.set_title("poimen-memory bench: cost per stage against corpus size")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", ncols=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="bench --json outputs")
    p.add_argument("--plot", type=Path, metavar="OUT.png")
    args = p.parse_args(argv)
    runs = sorted((json.loads(f.read_text()) for f in args.runs), key=lambda r: r["nodes"])
    print(table(rows(runs), ["stage (p50 ms unless named)", *(f"{r['nodes']:,}" for r in runs)]))
    if args.plot:
        plot(args.plot, runs)


if __name__ == "__main__":
    main()
