"""Reads the retrieval policy the database defines (memory.policy()); nothing here sets a
default of its own, so there is exactly one place the defaults live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row

from poimen_memory.db.queries import q
from poimen_memory.db.wrap import wrap_exceptions


@dataclass(frozen=True)
class Policy:
    fusion: str
    rrf_k: int
    dense_weight: float
    candidates: int
    cascade_candidates: int
    fusion_by_type: dict[str, str]
    extracted_dates: str
    evidence_budget: int
    evidence_candidates: int
    evidence_weight: float
    evidence_neighbours: float
    # The relevance floor: fused candidates below this cosine are withheld unless the
    # query's words vouch for them (None: the database's model's, MODEL_FLOORS; -1: off).
    min_cosine: float | None


def read_policy(conn: psycopg.Connection[Any]) -> Policy:
    with wrap_exceptions("policy"), conn.cursor(row_factory=class_row(Policy)) as cur:
        row = cur.execute(q("policy")).fetchone()
    assert row is not None  # memory.policy() always returns one row
    return row


async def aread_policy(conn: psycopg.AsyncConnection[Any]) -> Policy:
    with wrap_exceptions("policy"):
        async with conn.cursor(row_factory=class_row(Policy)) as cur:
            await cur.execute(q("policy"))
            row = await cur.fetchone()
    assert row is not None
    return row
