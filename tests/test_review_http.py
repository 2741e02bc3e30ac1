"""The review queue and the support of answers over real HTTP (the app, the service's own
role under row-level security, API keys) and over MCP with the official client (issue 40)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.testclient import TestClient

from poimen_memory.db.connect import connect
from service_client import make_key, serve
from test_api_keys import _as

# The app as the service's own role, under row-level security (test_lifecycle's fixture).
from test_lifecycle import client  # noqa: F401 (a fixture)
from test_mcp import _ok, _session, _tool_error, server  # noqa: F401 (a fixture)

P = "review"


def _nodes(project: str) -> list[dict[str, Any]]:
    return [
        {"project": project, "id": "t:coffee", "level": "L0",
         "text": "Mara: I take my coffee black, always."},
        {"project": project, "id": "m:coffee", "level": "L1",
         "text": "Mara takes her coffee black", "parents": ["t:coffee"]},
        {"project": project, "id": "t:office", "level": "L0",
         "text": "Mara: the office has an espresso machine."},
        {"project": project, "id": "m:office", "level": "L1",
         "text": "The office has an espresso machine", "parents": ["t:office"]},
        {"project": project, "id": "s:profile", "level": "L2",
         "text": "Mara profile: a black coffee drinker, coffee coffee black",
         "parents": ["m:coffee"]},
        {"project": project, "id": "s:office", "level": "L2",
         "text": "Office profile: coffee from the espresso machine", "parents": ["m:office"]},
    ]  # fmt: skip


def _post(app: TestClient, key: str, nodes: list[dict[str, Any]]) -> None:
    r = app.post("/memory/nodes", content="\n".join(map(json.dumps, nodes)), headers=_as(key))
    assert r.status_code == 201, r.text


UPDATE = {"project": P, "id": "m:coffee", "level": "L1", "revision": 1,
          "text": "Mara now drinks her coffee with oat milk", "parents": ["t:coffee"]}  # fmt: skip
QUERY = {"query": "coffee black drinker", "project": P, "level": "L2", "strategy": "LexicalOnly"}


def test_http_answers_demote_what_the_queue_lists_until_a_worker_confirms(
    client: TestClient,  # noqa: F811 (the fixture)
    fixture_url: str,
) -> None:
    writer = make_key(fixture_url, [P], write=True)
    reader = make_key(fixture_url, [P])
    other = make_key(fixture_url, ["elsewhere"], write=True)
    _post(client, writer, _nodes(P))
    _post(client, writer, [UPDATE])
    body = client.get("/memory/query", params=QUERY, headers=_as(reader)).json()
    ranked = [(r["external_id"], r["support"]) for r in body["results"]]
    assert ranked == [("s:office", "full"), ("s:profile", "stale")]
    assert body["demoted"] == 1 and body["excluded"] == 0
    assert body["results"][1]["changed_parents"] == [
        {"external_id": "m:coffee", "revision": 1, "current_revision": 2, "state": "superseded"}
    ]
    assert body["results"][1]["parents"][0]["superseded"] is True
    kept = client.get("/memory/query", params={**QUERY, "unsupported": "keep"}, headers=_as(reader))
    assert [r["external_id"] for r in kept.json()["results"]] == ["s:profile", "s:office"]
    bad = client.get("/memory/query", params={**QUERY, "unsupported": "hide"}, headers=_as(reader))
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_parameter"
    # the queue, as a reader sees it
    page = client.get("/memory/review", params={"project": P}, headers=_as(reader)).json()
    assert [(i["external_id"], i["reason"]) for i in page["items"]] == [
        ("s:profile", "evidence_changed")
    ]
    item = page["items"][0]
    assert item["parents"][0]["text"] == "Mara takes her coffee black"
    assert item["parents"][0]["current_text"] == UPDATE["text"]
    assert (
        client.get("/memory/review", params={"project": P}, headers=_as(other)).status_code == 403
    )
    # claiming needs a writer, and a JSON body (a cross-site form post cannot claim)
    claim = {"project": P, "visibility_timeout": 60}
    r = client.post("/memory/review/claim", json=claim, headers=_as(reader))
    assert r.status_code == 403
    r = client.post(
        "/memory/review/claim", content=json.dumps(claim),
        headers={**_as(writer), "Content-Type": "text/plain"},
    )  # fmt: skip
    assert r.status_code == 400 and "application/json" in r.json()["detail"]
    # and its parameters in the body only: a project in the query string was ignored, and
    # the claim took every project's items (an empty body, a body and a confirm alike)
    for path, body in [("/memory/review/claim", None), ("/memory/review/claim", claim),
                       (f"/memory/review/{item['item_id']}/confirm", {})]:  # fmt: skip
        r = client.post(path, params={"project": P, "limit": "1"}, json=body,
                        headers=_as(writer))  # fmt: skip
        assert r.status_code == 400 and r.json()["error"] == "invalid_parameter", r.text
        assert r.json()["detail"] == (
            "limit, project given in the query string; this route reads its parameters "
            "from the JSON body only"
        )
    r = client.post("/memory/review/claim", json=claim, headers=_as(writer))
    assert r.status_code == 200, r.text
    assert [i["item_id"] for i in r.json()["items"]] == [item["item_id"]]
    r = client.post("/memory/review/claim", json=claim, headers=_as(writer))
    assert r.json()["items"] == []  # claimed: hidden from the next worker
    # another project's key cannot confirm it (as if it did not exist), a writer can
    path = f"/memory/review/{item['item_id']}/confirm"
    r = client.post(path, json={"note": "n"}, headers=_as(other))
    assert r.status_code == 404 and r.json()["error"] == "unknown_review_item"
    r = client.post("/memory/review/x/confirm", json={}, headers=_as(writer))
    assert r.status_code == 400
    r = client.post(path, json={"note": "oat milk, still coffee"}, headers=_as(writer))
    assert r.status_code == 200, r.text
    assert r.json()["support"] == "full" and r.json()["outcome"] == "confirmed"
    assert client.post(path, json={}, headers=_as(writer)).status_code == 404
    body = client.get("/memory/query", params=QUERY, headers=_as(reader)).json()
    assert [(r["support"], r["changed_parents"]) for r in body["results"]] == [
        ("full", None),
        ("full", None),
    ]
    assert body["demoted"] == 0
    assert client.get("/memory/review", headers=_as(reader)).json()["items"] == []


def test_a_key_keeps_to_its_projects_in_the_queue_without_row_level_security(
    fixture_url: str, embedder: Any
) -> None:
    """The service connected as a superuser (which `serve` allows, with a warning), so row-
    level security does not apply: the review functions still keep to the key's projects
    (memory._asserted_ids). Another project's key cannot confirm, claim or list an item;
    a key of several projects lists those projects' items only."""
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_AUTH_CACHE_S": "0"}
    writer = make_key(fixture_url, [P], write=True)
    other = make_key(fixture_url, ["atlas"], write=True)
    both_others = make_key(fixture_url, ["atlas", "poimen"])
    both = make_key(fixture_url, [P, "poimen"])
    with serve(env, embedder) as app:
        _post(app, writer, _nodes(P))
        _post(app, writer, [UPDATE])
        (item,) = app.get("/memory/review", params={"project": P}, headers=_as(writer)).json()[
            "items"
        ]
        r = app.get("/memory/review", headers=_as(both_others))
        assert r.status_code == 200 and r.json()["items"] == [], r.text
        r = app.get("/memory/review", headers=_as(both))
        assert [i["item_id"] for i in r.json()["items"]] == [item["item_id"]], r.text
        r = app.post("/memory/review/claim", json={}, headers=_as(other))
        assert r.status_code == 200 and r.json()["items"] == [], r.text
        path = f"/memory/review/{item['item_id']}/confirm"
        r = app.post(path, json={"note": "not mine"}, headers=_as(other))
        assert r.status_code == 404 and r.json()["error"] == "unknown_review_item", r.text
        r = app.post(path, json={"note": "mine"}, headers=_as(writer))
        assert r.status_code == 200 and r.json()["outcome"] == "confirmed", r.text


def test_mcp_review_tools_with_the_official_client(
    server: str,  # noqa: F811 (the fixture)
    fixture_url: str,
) -> None:
    project = "poimen"
    writer = make_key(fixture_url, [project], write=True)
    nodes = [dict(n, project=project) for n in _nodes(project)]
    update = dict(UPDATE, project=project)
    added, updated, listed, claimed, again = _session(
        "http", server, fixture_url, writer,
        [
            ("memory_add", {"nodes": nodes}),
            ("memory_add", {"nodes": [update]}),
            ("memory_review_list", {"project": project, "limit": 10}),
            ("memory_review_claim", {"project": project, "limit": 5, "visibility_timeout": 30}),
            ("memory_review_claim", {"project": project}),
        ],
    )  # fmt: skip
    _ok(added), _ok(updated)
    items = _ok(listed)["items"]
    assert [(i["external_id"], i["reason"]) for i in items] == [("s:profile", "evidence_changed")]
    assert [i["item_id"] for i in _ok(claimed)["items"]] == [items[0]["item_id"]]
    assert _ok(again)["items"] == []
    # the worker rewrites the profile (completing the item) after reading the parents
    rewrite = {"project": project, "id": "s:profile", "level": "L2", "parents": ["m:coffee"],
               "text": "Mara profile: a coffee drinker, now with oat milk"}  # fmt: skip
    done, after, confirm_done = _session(
        "http", server, fixture_url, writer,
        [
            ("memory_add", {"nodes": [rewrite]}),
            ("memory_review_list", {"project": project}),
            ("memory_review_confirm", {"item": items[0]["item_id"]}),
        ],
    )  # fmt: skip
    _ok(done)
    assert _ok(after)["items"] == []
    assert _tool_error(confirm_done)["error"] == "unknown_review_item"
    with connect(fixture_url) as conn:
        row = conn.execute(
            "SELECT outcome FROM memory.review_queue WHERE id = %s", (items[0]["item_id"],)
        ).fetchone()
    assert row == ("rewritten",)
    r = httpx.get(
        f"{server}/memory/query",
        params={**QUERY, "project": project},
        headers=_as(writer),
        timeout=30,
    )
    profile = next(x for x in r.json()["results"] if x["external_id"] == "s:profile")
    assert profile["support"] == "full"
