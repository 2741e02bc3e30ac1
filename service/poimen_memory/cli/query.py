"""`poimen-memory query`: one query, printed with its citations."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from poimen_memory.cli.common import load_settings, started_url


def cmd_query(args: argparse.Namespace) -> int:
    import asyncio

    from poimen_memory.cli.render import render_response

    s = load_settings()
    if args.url:
        import httpx

        params = {
            "query": args.text,
            "level": args.level,
            "limit": str(args.limit),
            "timeout_seconds": str(args.timeout),
        }
        if args.project:
            params["project"] = args.project
        if args.fusion:
            params["fusion"] = args.fusion
        r = httpx.get(
            f"{args.url.rstrip('/')}/memory/query", params=params, timeout=args.timeout + 5
        )
        body = r.json()
        if r.status_code != 200:
            print(f"HTTP {r.status_code}: {json.dumps(body)}", file=sys.stderr)
            return 1
        print(json.dumps(body, indent=2) if args.json else render_response(body))
        return 0
    from dataclasses import replace

    from poimen_memory.retrieval.models import QueryRequest
    from poimen_memory.services import open_services

    url = started_url(s)

    async def run() -> dict[str, Any]:
        # The same wiring as the server (reranker and OpenSearch included), on a small pool.
        small = replace(s, pool_min=1, pool_max=4)
        async with open_services(small, url=url, wait=True) as svc:
            req = QueryRequest(
                query=args.text,
                project=args.project,
                levels=tuple(args.level.split(",")),
                limit=max(1, min(args.limit, s.max_limit)),
                timeout_s=args.timeout,
                fusion=args.fusion,
            )
            return await svc.retriever.query(req)

    resp = asyncio.run(run())
    if args.json:
        print(json.dumps(resp, indent=2, default=str))
    else:
        print(render_response(resp))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    qy = sub.add_parser("query", help="query and print results with their citations")
    qy.add_argument("text")
    qy.add_argument("--project")
    qy.add_argument("--level", default="L1,L2")
    qy.add_argument("--limit", type=int, default=5)
    qy.add_argument("--timeout", type=float, default=10.0, help="seconds (server clamps to 1-30)")
    qy.add_argument("--fusion", choices=["rrf", "convex"], default=None)
    qy.add_argument("--json", action="store_true")
    qy.add_argument("--url", help="query a running server (e.g. http://127.0.0.1:8765) instead")
    qy.set_defaults(func=cmd_query)
