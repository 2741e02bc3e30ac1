"""`poimen-memory opensearch`: dual-write maintenance."""

from __future__ import annotations

import argparse
import sys

from poimen_memory.cli.common import load_settings, started_url
from poimen_memory.db.connect import (
    connect,
)


def cmd_opensearch(args: argparse.Namespace) -> int:
    from poimen_memory.ingest.outbox import enable_outbox, reindex, sync_outbox
    from poimen_memory.upstreams.opensearch import engine_from_settings

    s = load_settings()
    engine = engine_from_settings(s.opensearch)
    if engine is None:
        print("error: POIMEN_OPENSEARCH_URL is not set", file=sys.stderr)
        return 2
    with connect(started_url(s), autocommit=True) as conn:
        enable_outbox(conn)
        if args.action == "sync":
            report = sync_outbox(
                conn,
                engine,
                batch_size=s.opensearch.sync_batch,
                max_attempts=s.opensearch.max_attempts,
                backoff_base_s=s.opensearch.backoff_s,
            )
            print(report)
            return 0 if report.complete else 4
        n = reindex(conn, engine, batch_size=s.opensearch.sync_batch)
        print(f"reindexed {n} nodes")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    os_ = sub.add_parser("opensearch", help="OpenSearch dual-write maintenance")
    os_.add_argument("action", choices=["sync", "reindex"])
    os_.set_defaults(func=cmd_opensearch)
