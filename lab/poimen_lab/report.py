"""Plain-text tables and an optional matplotlib chart for evaluation and benchmark results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    "ndcg@10",
    "recall@10",
    "recall@100",
    "mrr@10",
    "evidence_recall@5",
    "evidence_recall@10",
    "l0_recall@10",
    "session_recall@10",
    "cited_l0@10",
    "p50_ms",
    "p95_ms",
)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}"
    return str(v)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(h) for h in header]] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def modes_table(modes: Mapping[str, Mapping[str, float]], columns: Sequence[str] = COLUMNS) -> str:
    cols = [c for c in columns if any(c in m for m in modes.values())]
    return table([[name, *(m.get(c) for c in cols)] for name, m in modes.items()], ["mode", *cols])


def category_table(
    by_cat: Mapping[str, Mapping[str, Mapping[str, float]]], measure: str
) -> str | None:
    """Rows: categories; columns: modes; cells: one measure."""
    modes = [m for m, cats in by_cat.items() if any(measure in v for v in cats.values())]
    if not modes:
        return None
    cats = sorted({c for m in modes for c in by_cat[m]}, key=lambda c: (len(c), c))
    rows = [
        [
            c,
            int(by_cat[modes[0]][c].get("queries", 0)),
            *(by_cat[m].get(c, {}).get(measure) for m in modes),
        ]
        for c in cats
    ]
    return f"{measure} by category\n" + table(rows, ["category", "queries", *modes])


def bar_chart(path: Path, modes: Mapping[str, Mapping[str, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quality = [
        c
        for c in COLUMNS
        if not c.endswith("_ms")
        and not c.startswith("cited")
        and any(c in m for m in modes.values())
    ]
    names = list(modes)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(quality), 1)
    for i, c in enumerate(quality):
        xs = [j + i * width for j in range(len(names))]
        ax1.bar(xs, [modes[n].get(c, 0.0) for n in names], width, label=c)
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=20)
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8, ncol=2)
    ax1.set_title(title)
    ax2.bar(names, [modes[n].get("p50_ms", 0.0) for n in names], label="p50")
    ax2.scatter(
        names, [modes[n].get("p95_ms", 0.0) for n in names], color="k", label="p95", zorder=3
    )
    ax2.set_ylabel("ms per query")
    ax2.tick_params(axis="x", rotation=60)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
