"""The words SQL and Python share, defined once.

Python imports them; `poimen-memory migrate` writes them into the sql/ files it applies,
where a file says ``@vocabulary.NAME@`` (db/migrate.py renders each as a SQL literal), so
the database's checks and the service's agree by construction. Stdlib only: PL/Python
imports this package on the database host too.
"""

from __future__ import annotations

__all__ = [
    "FUSIONS",
    "LEVELS",
    "LOCAL_DIM",
    "LOCAL_MODEL",
    "PROJECT_NAME",
    "QUESTION_TYPES",
    "REFERENCE_TIME_HINT",
    "REFERENCE_TIME_RULE",
    "REFERENCE_YEARS",
    "SQLSTATES",
    "STRATEGIES",
    "sql_literals",
]

LEVELS = ("L0", "L1", "L2")
FUSIONS = ("rrf", "convex")
# The routes a query may take; the optimizer chooses the first three from the text.
STRATEGIES = ("LexicalOnly", "LexicalFirst", "Hybrid", "SemanticOnly")
QUESTION_TYPES = (
    "Factual",
    "Procedural",
    "Comparative",
    "Troubleshooting",
    "Navigational",
    "Open",
)
# A project's name: the CHECK of the domain memory.project_name (memory.projects.name),
# which migrate keeps equal to it (sql/005_catalog.sql).
PROJECT_NAME = "[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
# The years (UTC) a reference_time may fall in: every relative date it anchors ("last
# year", "this month", "past week") then stays within the years 1..9999 that both Python
# and PostgreSQL dates hold. 'infinity' and year 1 are refused (22023), never a 500.
REFERENCE_YEARS = (2, 9998)
# What a caller is told when a reference_time is outside them, by SQL and Python alike.
REFERENCE_TIME_RULE = (
    f"reference_time must be an ISO timestamp within years "
    f"{REFERENCE_YEARS[0]}..{REFERENCE_YEARS[1]} in UTC"
)
REFERENCE_TIME_HINT = "e.g. reference_time 2023-05-08T13:56:00Z; relative dates count from it"
# The local embedding model's name and dimension, as memory.embedding_model records them
# (no numpy needed to compare them).
LOCAL_MODEL = "all-MiniLM-L6-v2-onnx-int8"
LOCAL_DIM = 384
# The SQLSTATEs our own SQL raises (class PM), by meaning.
SQLSTATES = {
    "unknown_project": "PM404",
    "embedding_model_mismatch": "PM409",
    "embedding_not_configured": "PM412",
    "component_unavailable": "PM503",
    # A write named a revision that is no longer current (HTTP 409).
    "stale_revision": "PM419",
    # No node has this external id in the project (HTTP 404).
    "unknown_node": "PM444",
    # memory.get_node: one id in several projects the caller can read.
    "ambiguous_node": "PMA09",
}


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def sql_literals() -> dict[str, str]:
    """What each ``@vocabulary.NAME@`` marker of the sql/ files becomes."""
    arrays = {
        "levels": LEVELS,
        "fusions": FUSIONS,
        "strategies": STRATEGIES,
        "question_types": QUESTION_TYPES,
    }
    out = {k: "ARRAY[" + ", ".join(_text(v) for v in vs) + "]::text[]" for k, vs in arrays.items()}
    # Anchored, as memory.project_name's CHECK tests it; the bare pattern for messages.
    out["project_name"] = _text("^" + PROJECT_NAME + "$")
    out["project_name_pattern"] = _text(PROJECT_NAME)
    out["reference_first_year"], out["reference_last_year"] = map(str, REFERENCE_YEARS)
    out["reference_time_rule"] = _text(REFERENCE_TIME_RULE)
    out["reference_time_hint"] = _text(REFERENCE_TIME_HINT)
    out |= {f"sqlstate_{k}": _text(v) for k, v in SQLSTATES.items()}
    return out
