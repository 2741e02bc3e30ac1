"""`poimen-memory ingest` and `reembed`: writing nodes and their vectors."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from poimen_memory.cli.common import load_settings, notice, started_url
from poimen_memory.db.connect import (
    connect,
)
from poimen_memory.settings import LOCAL_MODELS, Settings


def _embedder(s: Settings) -> Any:
    from poimen_memory.embedders.factory import build_embedder

    return build_embedder(s.embedding)


def cmd_ingest(args: argparse.Namespace) -> int:
    from poimen_memory.db.migrate import migrate
    from poimen_memory.ingest.nodes import parse_lines
    from poimen_memory.ingest.writer import ingest

    s = load_settings()
    path = Path(args.file)
    if not path.exists():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    if path.is_dir():
        print(f"error: {path} is a directory: name a JSONL file of nodes", file=sys.stderr)
        return 2
    # Bytes that are not UTF-8 stay in their line as lone surrogates, which the node rules
    # refuse by line and field ("not valid Unicode"; --skip-invalid skips the line): strict
    # decoding raised at the first one, a traceback for a whole file.
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        records, invalid = parse_lines(f, args.project)
    embedder = _embedder(s)
    with connect(started_url(s), autocommit=True) as conn:
        migrate(conn, s.plpython_root_for_database, role_prefix=s.role_prefix)
        if s.opensearch.url is not None:
            from poimen_memory.ingest.outbox import enable_outbox

            enable_outbox(conn)
        report = ingest(
            conn,
            records,
            embedder,
            invalid=invalid,
            skip_invalid=args.skip_invalid,
            batch_size=args.batch or s.ingest_batch,
            embed_group=s.ingest_embed_group,
            progress=not args.quiet,
            commit_every_batch=args.commit_every_batch,
            report_nodes=args.report is not None,
        )
    if args.report is not None and report.nodes is not None:
        # Ids, revisions and statuses to a file: a terminal gets counts, not 100k ids.
        with Path(args.report).open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(n) + "\n" for n in report.nodes)
    for err in report.invalid[:20]:
        print(f"skipped {err}", file=sys.stderr)
    for line_no, parent in report.unresolved[:20]:
        print(f"unresolved parent on line {line_no}: {parent!r}", file=sys.stderr)
    print(report.summary())
    if args.json:
        print(json.dumps(report.to_json()))
    return 0


def cmd_reembed(args: argparse.Namespace) -> int:
    from poimen_memory.db.migrate import build_project_graphs
    from poimen_memory.db.queries import q
    from poimen_memory.progress import Progress

    s = load_settings()
    if args.local is not None:
        if s.embedding.url is not None:
            print(
                "error: --local names a local model, but POIMEN_EMBEDDINGS_URL is set "
                "(unset it to move the database to a local model)",
                file=sys.stderr,
            )
            return 2
        s = replace(s, embedding=replace(s.embedding, local=args.local))
    embedder = _embedder(s)
    with connect(started_url(s), autocommit=True) as conn:
        total = conn.execute(q("count_nodes")).fetchone()[0]  # type: ignore[index]
        with conn.transaction():
            conn.execute(q("reset_embedding"), {"model": embedder.model_name, "dim": embedder.dim})
        from pgvector.psycopg import register_vector

        register_vector(conn)
        after = 0
        with Progress(total, "reembed", "nodes") as bar:
            while True:
                rows = conn.execute(
                    q("nodes_for_reembed"), {"after": after, "limit": 256}
                ).fetchall()
                if not rows:
                    break
                vecs = embedder.embed_documents([r[1] for r in rows])
                with conn.transaction(), conn.cursor() as cur:
                    cur.executemany(
                        q("update_embedding"),
                        [{"id": r[0], "embedding": v} for r, v in zip(rows, vecs, strict=True)],
                    )
                after = rows[-1][0]
                bar.update(len(rows))
        # reset_embedding dropped the large projects' own graphs: built again now that the
        # vectors are back, after its transaction, so writes go on meanwhile.
        graphs = build_project_graphs(conn, progress=notice)
    print(f"re-embedded {total} nodes with {embedder.model_name} ({embedder.dim} dims)")
    for graph in graphs:
        print(f"project graph built: {graph.line()}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ing = sub.add_parser("ingest", help="load a nodes.jsonl file (idempotent)")
    ing.add_argument("file")
    ing.add_argument("--project", help="project for lines that name none")
    ing.add_argument(
        "--skip-invalid", action="store_true", help="skip bad lines instead of aborting"
    )
    ing.add_argument("--batch", type=int, help="nodes per insert statement (POIMEN_INGEST_BATCH)")
    ing.add_argument(
        "--commit-every-batch",
        action="store_true",
        help="commit each batch on its own (default: the whole file is one transaction, "
        "all or nothing); a failure then says how many nodes were committed",
    )
    ing.add_argument(
        "--report",
        metavar="FILE",
        help="write each node's id, node_id, revision and status to FILE (JSONL, in the "
        "file's order, invalid lines left out)",
    )
    ing.add_argument("--quiet", action="store_true")
    ing.add_argument("--json", action="store_true", help="also print the report as JSON")
    ing.set_defaults(func=cmd_ingest)
    re_ = sub.add_parser(
        "reembed",
        help="re-embed every node with the configured model (a change of model moves the "
        "database to it)",
    )
    re_.add_argument(
        "--local",
        choices=LOCAL_MODELS,
        help="the local model to move to, instead of POIMEN_EMBEDDINGS_LOCAL's; the service "
        "must then run with POIMEN_EMBEDDINGS_LOCAL set to it (docs/embeddings.md)",
    )
    re_.set_defaults(func=cmd_reembed)
