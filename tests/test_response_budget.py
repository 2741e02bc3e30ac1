"""Bounded answers (issue 26): a provenance tree repeats shared ancestors, so a page of trees
over long texts once weighed 226.5 MB (20,000-character turns, level L2, limit 50). Each tree
node's text is cut at the policy's provenance_text_chars, marked, and a whole answer over
POIMEN_HTTP_MAX_RESPONSE_BYTES is refused with a typed 413 rather than sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from poimen_memory.embedders.local import LocalEmbedder
from service_client import serve

LONG = 20_000


def _fan_out(url: str) -> None:
    """20 L0 turns of 20,000 characters, 16 L1 citing all of them, 50 L2 citing all 16 L1:
    each L2 tree is capped at 256 nodes, nearly all of them long turns."""
    turns = [
        {"id": f"t{i}", "level": "L0", "project": "wide",
         "text": (f"turn {i} about the storage migration " * 600)[:LONG]}
        for i in range(20)
    ]  # fmt: skip
    memories = [
        {"id": f"m{j}", "level": "L1", "project": "wide",
         "text": f"memory {j} of the storage migration", "parents": [t["id"] for t in turns]}
        for j in range(16)
    ]  # fmt: skip
    syntheses = [
        {"id": f"s{k}", "level": "L2", "project": "wide",
         "text": f"synthesis {k} of the storage migration", "parents": [m["id"] for m in memories]}
        for k in range(50)
    ]  # fmt: skip
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(turns + memories + syntheses),))


@pytest.fixture
def wide(fixture_url: str, embedder: LocalEmbedder) -> Iterator[str]:
    del embedder  # loads the model memory.add_nodes embeds with
    _fan_out(fixture_url)
    yield fixture_url


def _tree_nodes(result: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], list(result["parents"])
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.get("parents") or [])
    return out


PARAMS = {"query": "storage migration", "project": "wide", "level": "L2", "limit": "50",
          "timeout_seconds": "30",  # a 15 MB answer, on a loaded machine
          "evidence": "0"}  # fmt: skip


def test_the_fan_out_answers_within_the_budget(wide: str, embedder: LocalEmbedder) -> None:
    with serve({"POIMEN_DATABASE_URL": wide}, embedder) as client:
        r = client.get("/memory/query", params=PARAMS)
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    assert len(body["results"]) == 50
    turns = [n for res in body["results"] for n in _tree_nodes(res) if n["level"] == "L0"]
    assert len(turns) > 50 * 200  # the trees are as wide as their cap allows
    assert all(len(n["text"]) == 1000 and n["text_truncated"] and n["text_chars"] == LONG
               for n in turns)  # fmt: skip
    # 15 MB here; 20,000-character texts in every node would have been about 256 MB
    assert len(r.content) < 32 * 1024 * 1024
    # short texts are whole and carry no marker
    assert all("text_truncated" not in n for res in body["results"] for n in _tree_nodes(res)
               if n["level"] == "L1")  # fmt: skip


def test_the_cut_is_a_policy(wide: str) -> None:
    with psycopg.connect(wide, autocommit=True) as conn:
        conn.execute("SELECT memory.set_policy('provenance_text_chars', '50')")
        row = conn.execute(
            "SELECT provenance FROM memory_query('storage migration', project => 'wide',"
            " levels => ARRAY['L1'], k => 1)"
        ).fetchone()
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="provenance_text_chars"):
            conn.execute("SELECT memory.set_policy('provenance_text_chars', '0')")
    assert row is not None
    assert [(len(p["text"]), p["text_chars"]) for p in row[0]] == [(50, LONG)] * 20


def test_an_answer_over_the_budget_is_a_typed_413(wide: str, embedder: LocalEmbedder) -> None:
    env = {"POIMEN_DATABASE_URL": wide, "POIMEN_HTTP_MAX_RESPONSE_BYTES": str(1024 * 1024)}
    with serve(env, embedder) as client:
        r = client.get("/memory/query", params=PARAMS)
        assert r.status_code == 413, r.text[:500]
        err = r.json()
        assert err["error"] == "response_too_large"
        assert "POIMEN_HTTP_MAX_RESPONSE_BYTES" in err["hint"]
        # the same connection answers a smaller question at once
        small = client.get("/memory/query", params={**PARAMS, "limit": "1"})
        assert small.status_code == 200 and len(small.content) < 1024 * 1024


# The least POIMEN_HTTP_MAX_RESPONSE_BYTES takes: five 20,000-character versions weigh more.
BUDGET = 64 * 1024


def _versions(url: str, node_id: str, count: int) -> None:
    """``count`` versions of one node (each write of new text supersedes the last)."""
    with psycopg.connect(url, autocommit=True) as conn:
        for v in range(count):
            text = (f"revision {v} of the long storage migration note " * 500)[:LONG]
            node = {"id": node_id, "level": "L1", "project": "poimen", "text": text}
            conn.execute("SELECT memory.add_nodes(%s)", (Jsonb([node]),))


def test_a_history_over_the_budget_is_a_typed_413(
    fixture_url: str, embedder: LocalEmbedder
) -> None:
    """GET /memory/nodes/{id}/history holds every version with its text: it is held to the
    same budget as the other reads, counted in the bytes it would have sent."""
    _versions(fixture_url, "long-lived", 5)
    path, params = "/memory/nodes/long-lived", {"project": "poimen"}
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        whole = client.get(f"{path}/history", params=params)
    assert whole.status_code == 200, whole.text[:500]
    assert len(whole.json()["versions"]) == 5 and len(whole.content) > BUDGET
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_MAX_RESPONSE_BYTES": str(BUDGET)}
    with serve(env, embedder) as client:
        r = client.get(f"{path}/history", params=params)
        one = client.get(path, params=params)  # the current version alone fits
    assert one.status_code == 200 and len(one.content) < BUDGET
    assert r.status_code == 413, r.text[:500]
    assert r.json() == {
        "error": "response_too_large",
        "detail": f"the answer is {len(whole.content)} bytes, over the {BUDGET}-byte budget",
        "context": "a node's history is answered whole, every version with its text",
        "hint": "raise POIMEN_HTTP_MAX_RESPONSE_BYTES, or read it in SQL (memory.history)",
    }
