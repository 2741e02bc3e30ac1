"""The memory-node JSONL format (see docs/ingest.md) and its content-addressed key.

The rules live in poimen_core.nodes (stdlib only), which memory.add_nodes also runs inside
PostgreSQL: one definition of a valid node for every way of writing one.
"""

from __future__ import annotations

from poimen_core.nodes import (
    HASH_VERSION,
    LEVELS,
    MAX_JSON_DEPTH,
    MAX_TEXT_CHARS,
    Key,
    LineError,
    NodeRecord,
    RepeatedKey,
    Stored,
    adopt_stored_hashes,
    loads,
    new_records,
    node_sha256,
    parse_line,
    parse_lines,
    reference_keys,
    stale_revisions,
    timestamp_text,
    unique_object,
    validate,
    write_row,
)

__all__ = [
    "HASH_VERSION",
    "LEVELS",
    "MAX_JSON_DEPTH",
    "MAX_TEXT_CHARS",
    "Key",
    "LineError",
    "NodeRecord",
    "RepeatedKey",
    "Stored",
    "adopt_stored_hashes",
    "loads",
    "new_records",
    "node_sha256",
    "parse_line",
    "parse_lines",
    "reference_keys",
    "stale_revisions",
    "timestamp_text",
    "unique_object",
    "validate",
    "write_row",
]
