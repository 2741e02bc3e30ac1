"""Evidence recall of the default answer under policy settings, without re-embedding (issue 29).

Each question is embedded once (the vectors are kept in ``--vectors``, outside the
repository); then, for each setting, every question runs through ``memory.answer`` (the one
pipeline: the plan, the legs, the fusion and ``memory.select_evidence``, as GET /memory/query
runs them) at the default levels with limit 10, inside a transaction that sets the policy
keys and is rolled back, so the database's policy is never changed. The answer cites its
evidence list (its trees are cut to it), so the recall is of the gold L0 turns in the list.

    python -m poimen_lab.eval.evidence_policies --url URL --data ../shared/data/locomo-dev \
        --vectors /tmp/locomo-vectors.npz --setting base: \
        --setting decay:evidence_session_decay=0.7 --json OUT.json

Each ``--setting NAME:key=value,key=value`` is one run (``NAME:`` alone: the policy in
force). The JSON has ``per_query`` by setting name in the form ``poimen_lab.eval.compare``
reads (``python -m poimen_lab.eval.compare OUT.json OUT.json --mode base --mode-b decay``),
and ``--split`` prints the means on the projects named (the conversations the defaults are
chosen on) and on the rest apart. The settings run interleaved, question by question on a
connection each, so their p50 latencies (of the whole ``memory.answer`` statement) are side
by side under the same load. Settings that set the same key run in passes of their own (each
with the base again): two open transactions setting one key would wait on each other.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from poimen_lab.eval.fusion_sweep import paired
from poimen_memory.db.connect import connect
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.settings import Settings

ANSWER_SQL = """
SELECT coalesce((SELECT array_agg(e ->> 'external_id' ORDER BY (e ->> 'rank')::integer)
                 FROM jsonb_array_elements(a -> 'evidence') e), '{}'),
       coalesce((SELECT array_agg(DISTINCT e ->> 'title')
                 FROM jsonb_array_elements(a -> 'evidence') e), '{}')
FROM memory.answer(query => %(text)s, query_embedding => %(vec)s::vector,
                   project => %(project)s, k => %(k)s) a
"""


def _load(data: Path) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    queries = [json.loads(x) for x in (data / "queries.jsonl").read_text().splitlines() if x]
    gold: dict[str, set[str]] = defaultdict(set)
    for line in (data / "qrels.jsonl").read_text().splitlines():
        if line:
            r = json.loads(line)
            gold[r["query_id"]].add(r["node_id"])
    return [qy for qy in queries if gold.get(qy["id"])], gold


def vectors(path: Path, queries: list[dict[str, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    if path.is_file():
        with np.load(path) as z:
            have = {k: z[k] for k in z.files}
        if all(qy["id"] in have for qy in queries):
            return have
    emb = build_embedder(Settings.from_env().embedding)
    have = {qy["id"]: np.asarray(emb.embed_query(qy["text"]), dtype=np.float32) for qy in queries}
    np.savez(path, **have)
    return have


def _setting(raw: str) -> tuple[str, dict[str, str]]:
    name, _, rest = raw.partition(":")
    keys = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, keys


def passes(settings: list[tuple[str, dict[str, str]]]) -> list[list[tuple[str, dict[str, str]]]]:
    """The settings split into passes whose keys are disjoint, each led by the first setting
    (the base): two open transactions that set one key would wait on each other's row of
    memory.config, so no pass may hold one key twice."""
    base, rest = settings[0], settings[1:]
    groups: list[list[tuple[str, dict[str, str]]]] = []
    for s in rest:
        if set(s[1]) & set(base[1]):
            raise SystemExit(f"setting {s[0]} sets a key of the base {base[0]}: use another base")
        for g in groups:
            if all(not set(s[1]) & set(o[1]) for o in g):
                g.append(s)
                break
        else:
            groups.append([s])
    return [[base, *g] for g in groups] or [[base]]


def run(
    url: str,
    queries: list[dict[str, Any]],
    gold: dict[str, set[str]],
    vecs: dict[str, np.ndarray[Any, Any]],
    settings: list[tuple[str, dict[str, str]]],
    k: int,
) -> dict[str, dict[str, dict[str, float]]]:
    """Every setting on its own connection (its policy set in a transaction that is rolled
    back), the settings interleaved question by question, their order rotating, so their
    latencies are taken side by side under the same load."""
    out: dict[str, dict[str, dict[str, float]]] = {name: {} for name, _ in settings}
    conns = [connect(url) for _ in settings]
    try:
        for conn, (_, keys) in zip(conns, settings, strict=True):
            for key, value in keys.items():
                conn.execute("SELECT memory.set_policy(%s, %s)", (key, value))
        for i, qy in enumerate(queries):
            params = {
                "text": qy["text"],
                "vec": "[" + ",".join(f"{x:.7g}" for x in vecs[qy["id"]]) + "]",
                "project": qy["project"],
                "k": k,
            }
            g = gold[qy["id"]]
            for j in range(len(settings)):
                at = (i + j) % len(settings)
                t0 = time.perf_counter()
                ids, titles = conns[at].execute(ANSWER_SQL, params).fetchone() or ([], [])
                ms = (time.perf_counter() - t0) * 1000
                out[settings[at][0]][qy["id"]] = {
                    "evidence_recall@10": len(g & set(ids)) / len(g),
                    "cited_l0@10": float(len(ids)),
                    "sessions@10": float(len(titles)),
                    "latency_ms": ms,
                }
    finally:
        for conn in conns:
            conn.rollback()  # the policy was never the database's
            conn.close()
    return out


def ceilings(
    per: dict[str, dict[str, dict[str, float]]],
    cats: dict[str, Any],
    projects: dict[str, str],
    train: set[str],
) -> dict[str, Any]:
    """What any choice among the settings run could reach (evidence recall@10 by group).

    ``oracle``: each question's best setting, chosen knowing its gold turns: the ceiling of
    every router over these settings. ``by type``: each category's setting best on the
    ``train`` projects (the true category standing in for a perfect classifier), applied to
    every question; ``held out`` compares it with the first setting (today) on the other
    projects, where a choice made on ``train`` has to hold."""
    names = list(per)
    ids = list(per[names[0]])

    def recall(name: str, qid: str) -> float:
        return per[name][qid]["evidence_recall@10"]

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs)) if xs else float("nan")

    kinds = sorted({str(c) for c in cats.values()})
    chosen: dict[str, str] = {}
    for c in kinds:
        on_train = [i for i in ids if str(cats[i]) == c and projects[i] in train]
        chosen[c] = max(
            names, key=lambda n: (mean([recall(n, i) for i in on_train]), -names.index(n))
        )
    groups = {"all": ids} | {f"cat {c}": [i for i in ids if str(cats[i]) == c] for c in kinds}
    best = {i: max(recall(n, i) for n in names) for i in ids}
    routed = {i: recall(chosen[str(cats[i])], i) for i in ids}
    held = [i for i in ids if projects[i] not in train]
    return {
        "oracle": {g: mean([best[i] for i in q]) for g, q in groups.items()},
        "by type": {g: mean([routed[i] for i in q]) for g, q in groups.items()},
        "chosen": chosen,
        "held out": {
            f"cat {c}": (
                mean([routed[i] for i in held if str(cats[i]) == c]),
                mean([recall(names[0], i) for i in held if str(cats[i]) == c]),
            )
            for c in kinds
        },
    }


def _print_ceilings(path: Path, train: set[str]) -> None:
    got = json.loads(path.read_text())
    c = ceilings(got["per_query"], got["categories"], got["projects"], train)
    groups = list(c["oracle"])
    print("| ceiling | " + " | ".join(groups) + " |")
    print("|---|" + "---:|" * len(groups))
    for row in ("oracle", "by type"):
        print(f"| {row} | " + " | ".join(f"{c[row][g]:.3f}" for g in groups) + " |")
    for g, (routed, today) in c["held out"].items():
        cat = g.split()[1]
        print(
            f"{g}: {c['chosen'][cat]} chosen on the training projects;"
            f" held out {routed:.3f} (today {today:.3f})"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url")
    p.add_argument("--data", type=Path)
    p.add_argument("--vectors", type=Path)
    p.add_argument("--setting", action="append", type=_setting)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--every", type=int, default=1, help="every n-th question only")
    p.add_argument("--projects", help="only these projects' questions (comma-separated)")
    p.add_argument(
        "--split",
        default="conv-26,conv-41,conv-43",
        help="projects reported apart (the ones the defaults are chosen on)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--oracle",
        type=Path,
        metavar="JSON",
        help="only print what any choice among the settings of an earlier --json could reach",
    )
    args = p.parse_args(argv)
    if args.oracle:
        _print_ceilings(args.oracle, set(args.split.split(",")))
        return
    if not (args.url and args.data and args.vectors and args.setting):
        p.error("--url, --data, --vectors and --setting are required (or --oracle)")
    queries, gold = _load(args.data)
    vecs = vectors(args.vectors, queries)
    queries = queries[:: args.every]
    if args.projects:
        queries = [qy for qy in queries if qy["project"] in args.projects.split(",")]
    cats = {qy["id"]: qy.get("category") for qy in queries}
    train = set(args.split.split(","))
    per: dict[str, dict[str, dict[str, float]]] = {}
    base = args.setting[0][0]
    for group in passes(args.setting):
        got = run(args.url, queries, gold, vecs, group, args.k)
        for name, rows in got.items():
            for qid, row in rows.items():  # the base of the same pass, for the p50 ratio
                row["base_latency_ms"] = got[base][qid]["latency_ms"]
            per.setdefault(name, rows)  # the base's first pass: its recall is the same in each
    groups: dict[str, list[str]] = {"all": [qy["id"] for qy in queries]}
    groups["train"] = [qy["id"] for qy in queries if qy["project"] in train]
    groups["held out"] = [qy["id"] for qy in queries if qy["project"] not in train]
    for c in sorted({str(c) for c in cats.values()}):
        groups[f"cat {c}"] = [i for i in groups["all"] if str(cats[i]) == c]
        groups[f"cat {c} train"] = [i for i in groups[f"cat {c}"] if i in set(groups["train"])]
    print(
        "| setting | group | n | recall@10 | - base [95% CI] | cited | sessions | p50 ms"
        " | p50 / base |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, _ in args.setting:
        for g, ids in groups.items():
            if not ids:
                continue
            r = [per[name][i]["evidence_recall@10"] for i in ids]
            d = paired(r, [per[base][i]["evidence_recall@10"] for i in ids])
            p50 = np.percentile([per[name][i]["latency_ms"] for i in ids], 50)
            print(
                f"| {name} | {g} | {len(ids)} | {np.mean(r):.3f} | {d['diff']:+.3f} "
                f"[{d['ci95_low']:+.3f}, {d['ci95_high']:+.3f}] | "
                f"{np.mean([per[name][i]['cited_l0@10'] for i in ids]):.1f} | "
                f"{np.mean([per[name][i]['sessions@10'] for i in ids]):.1f} | "
                f"{p50:.1f} | "
                f"{p50 / np.percentile([per[name][i]['base_latency_ms'] for i in ids], 50):.2f} |"
            )
    if args.json:
        projects = {qy["id"]: qy["project"] for qy in queries}
        args.json.write_text(
            json.dumps({"per_query": per, "categories": cats, "projects": projects}) + "\n"
        )


if __name__ == "__main__":
    main()
