"""Attacks on the write path (issue 11), each a regression test: a rejected POST answers
4xx with a typed body and writes nothing, not even a project row."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder
from service_client import serve


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_MAX_BODY_BYTES": "200000"}
    with serve(env, embedder) as c:
        yield c


def _counts(url: str) -> tuple[int, int, int]:
    with connect(url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM memory.nodes), (SELECT count(*) FROM memory.edges),"
            " (SELECT count(*) FROM memory.projects)"
        ).fetchone()
    assert row is not None
    return row


def _nodes(n: int, project: str = "attack") -> list[dict[str, Any]]:
    return [
        {"id": f"t{i}", "level": "L0", "project": project, "text": f"turn {i} about kong"}
        for i in range(n)
    ]


def _post(client: TestClient, body: str | list[dict[str, Any]]) -> Any:
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post("/memory/nodes", content=data.encode("utf-8", "surrogatepass"))


def _rejected(client: TestClient, url: str, body: Any, status: int = 400) -> dict[str, Any]:
    before = _counts(url)
    r = _post(client, body)
    assert r.status_code == status, r.text
    assert _counts(url) == before  # nothing written, no project row either
    out: dict[str, Any] = r.json()
    assert out["error"] and out["detail"]
    return out


def test_a_repeated_id_with_other_text_rejects_the_whole_request(
    client: TestClient, fixture_url: str
) -> None:
    nodes = _nodes(101)
    nodes[-1] = {**nodes[-1], "id": "t0", "text": "other text"}
    body = _rejected(client, fixture_url, nodes)
    assert body["error"] == "invalid_node" and "already used on line 1" in body["context"]


def test_an_id_stored_with_other_content_is_refused(client: TestClient, fixture_url: str) -> None:
    assert _post(client, _nodes(2)).status_code == 201
    _rejected(client, fixture_url, [{**_nodes(1)[0], "text": "rewritten"}])


def test_nan_in_metadata_rejects_the_whole_request(client: TestClient, fixture_url: str) -> None:
    nodes = [json.dumps(n) for n in _nodes(80)]
    nodes[70] = nodes[70][:-1] + ', "metadata": {"x": NaN}}'
    _rejected(client, fixture_url, "\n".join(nodes))


@pytest.mark.parametrize(
    ("text", "why"),
    [("a\x00b", "NUL"), ("a\ud800b", "surrogate")],
)
def test_text_postgres_cannot_store(
    client: TestClient, fixture_url: str, text: str, why: str
) -> None:
    body = _rejected(client, fixture_url, [{**_nodes(1)[0], "text": text}])
    assert why in body["context"]


def test_a_long_id_is_refused_before_anything_is_written(
    client: TestClient, fixture_url: str
) -> None:
    """A 3,000-character id once reached the btree and came back as a 500 naming the index."""
    nodes = _nodes(200)
    nodes[150]["id"] = "t" * 3000
    body = _rejected(client, fixture_url, nodes)
    assert "longer than 512 characters" in body["context"] and "index" not in body["detail"]


def test_deep_nesting_and_far_timestamps(client: TestClient, fixture_url: str) -> None:
    deep = json.dumps(_nodes(1)[0])[:-1] + ', "metadata": ' + "[" * 1000 + "]" * 1000 + "}"
    _rejected(client, fixture_url, deep)
    _rejected(client, fixture_url, "[" * 1000 + "]" * 1000)
    far = {**_nodes(1)[0], "timestamp": "9999-12-31T23:59:59-14:00"}
    assert "out of range" in _rejected(client, fixture_url, [far])["context"]


@pytest.mark.parametrize(
    ("child_level", "parent_level"),
    [("L0", "L0"), ("L1", "L1"), ("L1", "L2"), ("L2", "L0")],
)
def test_provenance_must_go_exactly_one_level_down(
    client: TestClient, fixture_url: str, child_level: str, parent_level: str
) -> None:
    nodes = [
        {"id": "p", "level": parent_level, "project": "attack", "text": "parent"},
        {"id": "c", "level": child_level, "project": "attack", "text": "child", "parents": ["p"]},
    ]
    _rejected(client, fixture_url, nodes)


def test_a_cycle_is_refused(client: TestClient, fixture_url: str) -> None:
    nodes = [
        {"id": "a", "level": "L1", "project": "attack", "text": "a", "parents": ["b"]},
        {"id": "b", "level": "L1", "project": "attack", "text": "b", "parents": ["a"]},
    ]
    _rejected(client, fixture_url, nodes)


def test_a_body_over_the_limit_is_413_and_not_parsed(client: TestClient, fixture_url: str) -> None:
    big = json.dumps(_nodes(1)[0]) + "\n" + " " * 300_000
    body = _rejected(client, fixture_url, big, status=413)
    assert body["error"] == "payload_too_large"


def test_nul_in_query_parameters_is_400(client: TestClient) -> None:
    for params in ({"query": "kong\x00"}, {"query": "kong", "project": "po\x00imen"}):
        r = client.get("/memory/query", params=params)
        assert r.status_code == 400 and r.json()["error"] == "invalid_parameter"


def test_a_valid_request_writes_nodes_and_edges_in_one_go(
    client: TestClient, fixture_url: str
) -> None:
    before = _counts(fixture_url)
    nodes = [
        {"id": "m1", "level": "L1", "project": "fresh", "text": "a memory", "parents": ["e1"]},
        {"id": "e1", "level": "L0", "project": "fresh", "text": "the evidence"},
    ]
    r = _post(client, nodes)
    assert r.status_code == 201, r.text
    assert r.json()["inserted"] == 2 and r.json()["edges"] == 1
    assert _counts(fixture_url) == (before[0] + 2, before[1] + 1, before[2] + 1)


def test_ndjson_lines_end_only_at_newlines(client: TestClient, fixture_url: str) -> None:
    """U+2028, U+0085 and form feeds are legal inside JSON strings: they must not split a
    line, as Python's str.splitlines would."""
    node = {**_nodes(1)[0], "text": "one\u2028two\x85three\x0cfour"}
    r = _post(client, json.dumps(node, ensure_ascii=False) + "\r\n")
    assert r.status_code == 201, r.text
    assert r.json()["inserted"] == 1


def test_numbers_beyond_a_double_are_rejected(client: TestClient, fixture_url: str) -> None:
    line = json.dumps(_nodes(1)[0])[:-1] + ', "metadata": {"x": 1e400}}'
    assert "out of the range" in _rejected(client, fixture_url, line)["context"]
