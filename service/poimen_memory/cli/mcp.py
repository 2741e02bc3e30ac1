"""`poimen-memory mcp`: the MCP server for agents on stdin/stdout (docs/mcp.md)."""

from __future__ import annotations

import argparse

from poimen_memory.cli.common import load_settings, service_settings


def cmd_mcp(args: argparse.Namespace) -> int:
    import asyncio

    from poimen_memory.api.mcp_server import serve_stdio

    # As `serve`: the service's role under row-level security, the key from the environment
    # (stdout is the protocol's: nothing else may print there).
    s = service_settings(load_settings())
    asyncio.run(serve_stdio(s, api_key=s.api_key))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    mc = sub.add_parser(
        "mcp",
        help="the MCP server for agents on stdin/stdout (docs/mcp.md; the service also "
        "serves it at POST /mcp); POIMEN_API_KEY is its key",
    )
    mc.set_defaults(func=cmd_mcp)
