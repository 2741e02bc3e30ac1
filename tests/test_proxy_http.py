"""The HTTP service over the PL/Proxy proxy (docs/scaling.md#the-http-service-over-the-proxy),
over real HTTP: the service's app under uvicorn on a port of its own, its database the proxy
database of tests/test_proxy.py's three shard clusters, and beside it a second service over
the reference database holding the same nodes in one place. A query naming a project
answers alike field by field; a query naming none merges every partition's answer; writes,
forget, history and get go to the partition of their project; a key for one project sees
nothing of another; a stopped shard is a typed 503 for its projects and a degraded answer
over all."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn
from starlette.requests import Request

from conftest import free_port
from doubles.opensearch_server import OpenSearchServer, run_opensearch_server
from doubles.rerank_server import RerankServer, run_rerank_server, word_overlap
from poimen_core.optimizer import optimize_query
from poimen_memory import shard
from poimen_memory.api.app import create_app
from poimen_memory.api.auth import KeyRing
from poimen_memory.db.connect import connect, ensure_service_login
from poimen_memory.db.queries import q
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import DatabaseUnavailable, Forbidden
from poimen_memory.ingest.outbox import reindex, sync_outbox
from poimen_memory.settings import Settings
from poimen_memory.upstreams.opensearch import OpenSearchEngine
from service_client import make_key
from test_mcp import _resources, _summaries, over_http
from test_proxy import (  # noqa: F401 (sharded: the module's fixture)
    PARTITIONS,
    QUERIES,
    SERVICE_ROLE,
    Sharded,
    fixture_nodes,
    renamed,
    sharded,
    strip_ids,
    where_is,
)

LEVELS = "L0,L1,L2"


def _as_service(url: str) -> str:
    """The URL as the service's login role (trusted on the test cluster's socket)."""
    return url.replace("postgresql://postgres@", f"postgresql://{SERVICE_ROLE}@")


@contextmanager
def http_service(
    url: str, embedder: LocalEmbedder, env: dict[str, str] | None = None
) -> Iterator[httpx.Client]:
    """The service's app over ``url`` under uvicorn on a free loopback port: real HTTP."""
    app = create_app(
        Settings.from_env(
            {
                "POIMEN_DATABASE_URL": url,
                "POIMEN_AUTH_CACHE_S": "0",
                "POIMEN_HEALTH_CACHE_S": "0",
                **(env or {}),
            }
        ),
        embedder=embedder,
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def services(
    sharded: Sharded,  # noqa: F811
    embedder: LocalEmbedder,
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """(over the proxy, over the reference database), both as the service's role."""
    with connect(sharded.reference_url, autocommit=True) as ref:
        ensure_service_login(ref, SERVICE_ROLE)
    with (
        http_service(_as_service(sharded.proxy_url), embedder) as proxied,
        http_service(_as_service(sharded.reference_url), embedder) as one,
    ):
        yield proxied, one


# What depends on where and when an answer ran, not on what it is.
_VOLATILE = {"metrics", "latency_ms"}


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = strip_ids({k: v for k, v in body.items() if k not in _VOLATILE})
    return out


def test_a_named_project_answers_over_http_as_one_database(
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, one = services
    compared = 0
    for project in ("poimen", "atlas"):
        for query in QUERIES:
            for strategy in (None, "LexicalOnly", "SemanticOnly"):
                params = {"query": query, "project": project, "level": LEVELS, "limit": 8}
                if strategy:
                    params["strategy"] = strategy
                a = proxied.get("/memory/query", params=params)
                b = one.get("/memory/query", params=params)
                assert a.status_code == b.status_code == 200, (a.text, b.text)
                assert comparable(a.json()) == comparable(b.json())
                compared += len(b.json()["results"])
    assert compared > 0
    # One node, and its history, field by field (node ids aside).
    for project, external_id in (("poimen", "poimen:mem:1"), ("atlas", "atlas:mem:2")):
        a = proxied.get(f"/memory/nodes/{external_id}", params={"project": project})
        b = one.get(f"/memory/nodes/{external_id}", params={"project": project})
        assert a.status_code == b.status_code
        if b.status_code == 200:
            # created_at aside: the two databases were written a moment apart.
            assert strip_ids(a.json()) | {"created_at": None} == strip_ids(b.json()) | {
                "created_at": None
            }
            h1 = proxied.get(f"/memory/nodes/{external_id}/history", params={"project": project})
            h2 = one.get(f"/memory/nodes/{external_id}/history", params={"project": project})
            assert h1.status_code == h2.status_code == 200, h1.text
            assert [strip_ids(v) | {"created_at": None} for v in h1.json()["versions"]] == [
                strip_ids(v) | {"created_at": None} for v in h2.json()["versions"]
            ]


def test_a_query_naming_no_project_merges_every_partition(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, _ = services
    r = proxied.get("/memory/query", params={"query": QUERIES[0], "level": LEVELS, "limit": 20})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["rank"] for x in body["results"]] == list(range(1, len(body["results"]) + 1)) or all(
        "rank" not in x for x in body["results"]
    )
    assert 0 < len(body["results"]) <= 20
    projects = {x["project"] for x in body["results"]}
    assert len(projects) > 1 and projects <= set(sharded.projects) | {f"w{i}" for i in range(8)}
    scores = [x["final_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert not [d for d in body["degraded"] if d["stage"] == "shard"]
    health = proxied.get("/healthz").json()
    assert health["checks"]["database"]["ok"] is True
    assert health["checks"]["database"]["partitions"] == {"count": PARTITIONS, "missing": []}
    assert health["checks"]["database"]["nodes"] >= len(sharded.nodes)
    metrics = proxied.get("/metrics")
    assert metrics.status_code == 200
    assert "poimen_database_up 1.0" in metrics.text


def test_writes_forget_and_get_land_on_the_partition_of_their_project(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, _ = services
    names = [f"h{i}" for i in range(6)]
    with psycopg.connect(sharded.proxy_url) as p:
        expected = {
            n: int(p.execute("SELECT memory_proxy.partition_of(%s)", (n,)).fetchone()[0])  # type: ignore[index]
            for n in names
        }
    assert len(set(expected.values())) > 1
    batch = [
        {"project": n, "id": f"{n}:1", "level": "L0", "text": f"note {i} written over http"}
        for i, n in enumerate(names)
    ]
    r = proxied.post("/memory/nodes", json=batch)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["inserted"] == len(names)
    assert [(n["project"], n["id"], n["status"]) for n in out["nodes"]] == [
        (n, f"{n}:1", "created") for n in names
    ]
    for n in names:
        assert where_is(sharded, n, f"{n}:1") == [expected[n]]
    # Again: unchanged, nothing written.
    again = proxied.post("/memory/nodes", json=batch)
    assert again.status_code in (200, 201), again.text
    assert again.json()["inserted"] == 0
    assert {n["status"] for n in again.json()["nodes"]} == {"unchanged"}
    # A child resting on its parent, in another request: the edge is found on the partition.
    child = {"project": "h0", "id": "h0:2", "level": "L1", "text": "a summary", "parents": ["h0:1"]}
    r = proxied.post("/memory/nodes", json=[child])
    assert r.status_code == 201, r.text
    got = proxied.get("/memory/nodes/h0:2", params={"project": "h0"})
    assert got.status_code == 200, got.text
    assert [p["external_id"] for p in got.json()["parents"]] == ["h0:1"]
    # Without a project: found on the one partition that has it.
    assert proxied.get("/memory/nodes/h1:1").json()["project"] == "h1"
    assert proxied.get("/memory/nodes/no-such-node").status_code == 404
    # A page of one project's nodes, and their count, from its partition.
    page = proxied.get("/memory/nodes", params={"project": "h0", "count": "true"})
    assert page.status_code == 200, page.text
    assert [n["external_id"] for n in page.json()["nodes"]] == ["h0:1", "h0:2"]
    assert page.json()["count"] == 2
    # Over several partitions: a page walks them in turn (tested below).
    assert proxied.get("/memory/nodes").status_code == 200
    # Forget one node, then its history says so, on its partition alone.
    r = proxied.delete("/memory/nodes/h2:1", params={"project": "h2", "reason": "test"})
    assert r.status_code == 200, r.text
    assert proxied.get("/memory/nodes/h2:1", params={"project": "h2"}).status_code == 404
    h = proxied.get("/memory/nodes/h2:1/history", params={"project": "h2"})
    assert h.status_code == 200, h.text
    (version,) = h.json()["versions"]
    assert version["end_reason"] is not None and version["end_note"] == "test"
    with psycopg.connect(sharded.proxy_url) as p:
        part_url = shard.partitions(p)[expected["h2"]].admin("postgres")
    with psycopg.connect(part_url) as c:
        row = c.execute(
            "SELECT expired_at IS NOT NULL FROM memory.nodes WHERE external_id = 'h2:1'"
        ).fetchone()
    assert row == (True,)


def test_a_key_for_one_project_sees_nothing_of_another(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, one = services
    reader = make_key(sharded.proxy_url, ["atlas"])
    writer = make_key(sharded.proxy_url, ["atlas"], write=True)
    try:
        bearer = {"Authorization": f"Bearer {reader}"}
        assert proxied.get("/memory/query", params={"query": QUERIES[0]}).status_code == 401
        r = proxied.get(
            "/memory/query", params={"query": QUERIES[0], "level": LEVELS, "limit": 50},
            headers=bearer,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert {x["project"] for x in r.json()["results"]} == {"atlas"}
        assert {e["project"] for e in r.json()["evidence"]} <= {"atlas"}
        r = proxied.get(
            "/memory/query", params={"query": QUERIES[0], "project": "poimen"}, headers=bearer
        )
        assert r.status_code in (403, 404), r.text
        assert proxied.get(
            "/memory/nodes/poimen:mem:1", params={"project": "poimen"}, headers=bearer
        ).status_code in (403, 404)
        assert proxied.get("/memory/nodes/poimen:mem:1", headers=bearer).status_code == 404
        assert proxied.get(
            "/memory/nodes/poimen:mem:1/history", params={"project": "poimen"}, headers=bearer
        ).status_code in (403, 404)
        node = {"project": "poimen", "id": "k:1", "level": "L0", "text": "not mine"}
        assert proxied.post("/memory/nodes", json=[node], headers=bearer).status_code == 403
        w = {"Authorization": f"Bearer {writer}"}
        assert proxied.post("/memory/nodes", json=[node], headers=w).status_code == 403
        assert where_is(sharded, "poimen", "k:1") == []
        mine = {"project": "atlas", "id": "k:2", "level": "L0", "text": "mine, written by key"}
        r = proxied.post("/memory/nodes", json=[mine], headers=w)
        assert r.status_code == 201, r.text
        assert where_is(sharded, "atlas", "k:2") == [sharded.projects["atlas"]]
        # The reference database holds what the partitions hold: later tests compare
        # atlas's answers through the proxy with its answers there, field by field.
        assert one.post("/memory/nodes", json=[mine]).status_code == 201
        with psycopg.connect(sharded.proxy_url) as p:
            (key_id,) = p.execute("SELECT id FROM memory.api_keys WHERE can_write").fetchone()  # type: ignore[misc]
        h = proxied.get("/memory/nodes/k:2/history", params={"project": "atlas"}, headers=w)
        assert h.status_code == 200, h.text
        assert h.json()["versions"][0]["written_by"] == f"api_key:{key_id}"
        r = proxied.delete("/memory/nodes/poimen:mem:1", params={"project": "poimen"}, headers=w)
        assert r.status_code == 403
    finally:
        # Back to anonymous mode for the other tests of the module.
        with psycopg.connect(sharded.proxy_url, autocommit=True) as p:
            p.execute("DELETE FROM memory.api_keys")


def _partition_of(sharded: Sharded, names: list[str]) -> dict[str, int]:  # noqa: F811
    with psycopg.connect(sharded.proxy_url) as p:
        return {
            n: int(p.execute("SELECT memory_proxy.partition_of(%s)", (n,)).fetchone()[0])  # type: ignore[index]
            for n in names
        }


def _walk(client: httpx.Client, params: dict[str, Any], **kw: Any) -> list[list[dict[str, Any]]]:
    """Every page of GET /memory/nodes, following next_cursor."""
    pages: list[list[dict[str, Any]]] = []
    after: str | None = None
    while True:
        r = client.get("/memory/nodes", params=params | ({"after": after} if after else {}), **kw)
        assert r.status_code == 200, r.text
        pages.append(r.json()["nodes"])
        after = r.json()["next_cursor"]
        if after is None:
            return pages
        assert len(pages) < 1000


def test_a_page_of_nodes_over_several_partitions_walks_them_in_turn(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, _ = services
    with connect(sharded.proxy_url, autocommit=True) as p:
        p.execute(f"SET ROLE {SERVICE_ROLE}")
        p.execute("SELECT set_config('poimen.read_projects', '*', false)")
        names = sorted(str(r[0]) for r in p.execute("SELECT name FROM memory.projects"))
    where = _partition_of(sharded, names)
    assert len(set(where.values())) == PARTITIONS
    # What each project's own listing (one partition's pages) holds, together.
    union: dict[tuple[str, str], int] = {}
    for name in names:
        for page in _walk(proxied, {"project": name, "limit": 100}):
            for n in page:
                union[(n["project"], n["external_id"])] = n["node_id"]
    assert len(union) >= len(sharded.nodes)
    for newest in (False, True):
        pages = _walk(proxied, {"limit": 7, "newest_first": str(newest).lower()})
        rows = [n for page in pages for n in page]
        keys = [(n["project"], n["external_id"]) for n in rows]
        assert len(keys) == len(set(keys))  # every node exactly once
        assert {k: n["node_id"] for k, n in zip(keys, rows, strict=True)} == union
        assert all(len(page) == 7 for page in pages[:-1]) and len(pages[-1]) <= 7
        # The partitions in ascending order, each in its own order (node ids).
        parts = [where[n["project"]] for n in rows]
        assert parts == sorted(parts)
        for part in set(parts):
            ids = [n["node_id"] for n in rows if where[n["project"]] == part]
            assert ids == sorted(ids, reverse=newest)
        # Some page is filled from the next partition when one runs out.
        assert any(len({where[n["project"]] for n in page}) > 1 for page in pages)
    counted = proxied.get("/memory/nodes", params={"count": "true", "limit": 3})
    assert counted.status_code == 200 and counted.json()["count"] == len(union)
    # The cursor: opaque, URL-safe base64 of p1:<partition>:<that partition's cursor>.
    first = counted.json()
    raw = base64.urlsafe_b64decode(first["next_cursor"] + "=" * (-len(first["next_cursor"]) % 4))
    tag, part, inner = raw.decode().split(":", 2)
    assert (tag, int(part)) == ("p1", where[first["nodes"][-1]["project"]])
    inner_raw = base64.urlsafe_b64decode(inner + "=" * (-len(inner) % 4)).decode()
    assert inner_raw == f"n1:{first['nodes'][-1]['node_id']}"
    # Round trip: the page after a cursor starts right after its row.
    nxt = proxied.get("/memory/nodes", params={"limit": 3, "after": first["next_cursor"]})
    walked = [
        (n["project"], n["external_id"]) for page in _walk(proxied, {"limit": 7}) for n in page
    ]
    assert [(n["project"], n["external_id"]) for n in first["nodes"] + nxt.json()["nodes"]] == (
        walked[:6]
    )
    # A cursor of something else is a typed 400; so is one project's cursor over several.
    own = proxied.get("/memory/nodes", params={"project": names[0], "limit": 1}).json()
    for bad in (
        "not-a-cursor",
        own["next_cursor"],
        base64.urlsafe_b64encode(b"p1:9:" + inner.encode()).decode(),  # no partition 9
        base64.urlsafe_b64encode(b"p1:1:").decode(),
    ):
        r = proxied.get("/memory/nodes", params={"after": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"] == "invalid_parameter"
        assert "cursor" in r.json()["detail"] and r.json()["hint"]
    # A named project still pages with its partition's own cursors.
    assert base64.urlsafe_b64decode(own["next_cursor"] + "==").startswith(b"n1:")
    # A key for two projects on two partitions: their nodes alone, still in turn.
    two = sorted({where["poimen"]: "poimen", where["atlas"]: "atlas"}.values())
    assert len(two) == 2
    key = make_key(sharded.proxy_url, two)
    try:
        rows = [
            n
            for page in _walk(proxied, {"limit": 5}, headers={"Authorization": f"Bearer {key}"})
            for n in page
        ]
        assert {(n["project"], n["external_id"]) for n in rows} == {k for k in union if k[0] in two}
        assert [where[n["project"]] for n in rows] == sorted(where[n["project"]] for n in rows)
    finally:
        with psycopg.connect(sharded.proxy_url, autocommit=True) as p:
            p.execute("DELETE FROM memory.api_keys")


OAT_MILK = "Mara now drinks her coffee with oat milk"


def _review_nodes(project: str) -> list[dict[str, Any]]:
    """A memory resting on a transcript line, and a profile resting on the memory: a new
    version of the memory puts the profile in doubt (tests/test_review_http.py)."""
    return [
        {"project": project, "id": "t:coffee", "level": "L0",
         "text": f"Mara of {project}: I take my coffee black, always."},
        {"project": project, "id": "m:coffee", "level": "L1",
         "text": "Mara takes her coffee black", "parents": ["t:coffee"]},
        {"project": project, "id": "s:profile", "level": "L2",
         "text": "Mara profile: a black coffee drinker", "parents": ["m:coffee"]},
    ]  # fmt: skip


def test_the_review_queue_over_several_partitions_has_global_item_ids(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, _ = services
    candidates = _partition_of(sharded, [f"rv{i}" for i in range(12)])
    pair: dict[int, str] = {}
    for name, part in candidates.items():
        pair.setdefault(part, name)
    projects = [pair[part] for part in sorted(pair)][:2]
    assert len(projects) == 2
    for project in projects:
        r = proxied.post("/memory/nodes", json=_review_nodes(project))
        assert r.status_code == 201, r.text
        update = {"project": project, "id": "m:coffee", "level": "L1", "revision": 1,
                  "text": OAT_MILK, "parents": ["t:coffee"]}  # fmt: skip
        r = proxied.post("/memory/nodes", json=[update])
        assert r.status_code == 201, r.text
    listed = proxied.get("/memory/review", params={"limit": 100})
    assert listed.status_code == 200, listed.text
    items = [i for i in listed.json()["items"] if i["project"] in projects]
    assert sorted((i["project"], i["external_id"], i["reason"]) for i in items) == sorted(
        (p, "s:profile", "evidence_changed") for p in projects
    )
    ids = [i["item_id"] for i in listed.json()["items"]]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    # Global ids: the partition's own id * 1024 + the partition.
    with psycopg.connect(sharded.proxy_url) as p:
        urls = {pt.number: pt.admin("postgres") for pt in shard.partitions(p)}
    for item in items:
        part, local = (
            item["item_id"] % shard.MAX_PARTITIONS,
            item["item_id"] // shard.MAX_PARTITIONS,
        )
        assert part == candidates[item["project"]]
        with psycopg.connect(urls[part]) as c:
            row = c.execute(
                "SELECT q.external_id, q.node_id FROM memory.review_queue q WHERE q.id = %s",
                (local,),
            ).fetchone()
        assert row == ("s:profile", item["node_id"])  # node_id: the partition's own
        assert item["parents"][0]["current_text"] == OAT_MILK
        # With the project: its partition alone, the same global id.
        own = proxied.get("/memory/review", params={"project": item["project"]}).json()
        assert [i["item_id"] for i in own["items"]] == [item["item_id"]]
    # Keyset paging over global ids: a page at a time, the same items in the same order.
    paged, after = [], None
    while True:
        page = proxied.get(
            "/memory/review", params={"limit": 1} | ({"after": after} if after else {})
        )
        assert page.status_code == 200, page.text
        paged += [i["item_id"] for i in page.json()["items"]]
        after = page.json()["next_after"]
        if after is None:
            break
    assert paged == ids
    # A key for one project sees (and confirms) its items alone.
    mine = projects[0]
    writer = make_key(sharded.proxy_url, [mine], write=True)
    try:
        w = {"Authorization": f"Bearer {writer}"}
        r = proxied.get("/memory/review", headers=w)
        assert r.status_code == 200, r.text
        assert {i["project"] for i in r.json()["items"]} == {mine}
        theirs = next(i for i in items if i["project"] != mine)
        r = proxied.post(f"/memory/review/{theirs['item_id']}/confirm", json={}, headers=w)
        assert r.status_code == 404 and r.json()["error"] == "unknown_review_item", r.text
        r = proxied.post(
            "/memory/review/claim", json={"limit": 10, "visibility_timeout": 60}, headers=w
        )
        assert r.status_code == 200, r.text
        assert {i["project"] for i in r.json()["items"]} == {mine}
    finally:
        with psycopg.connect(sharded.proxy_url, autocommit=True) as p:
            p.execute("DELETE FROM memory.api_keys")
    # Claim over every partition: the other project's item (the first is claimed already),
    # then nothing until the visibility timeout passes.
    r = proxied.post("/memory/review/claim", json={"limit": 10, "visibility_timeout": 60})
    assert r.status_code == 200, r.text
    assert [i["item_id"] for i in r.json()["items"] if i["project"] in projects] == [
        theirs["item_id"]
    ]
    r = proxied.post("/memory/review/claim", json={"limit": 10, "visibility_timeout": 60})
    assert [i for i in r.json()["items"] if i["project"] in projects] == []
    # Confirm by global id, routed to its partition.
    for item in items:
        path = f"/memory/review/{item['item_id']}/confirm"
        r = proxied.post(path, json={"note": "still black coffee"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["item_id"] == item["item_id"] and body["node_id"] == item["node_id"]
        assert (body["outcome"], body["support"], body["external_id"]) == (
            "confirmed", "full", "s:profile",
        )  # fmt: skip
        again = proxied.post(path, json={})
        assert again.status_code == 404 and again.json()["error"] == "unknown_review_item"
        assert str(item["item_id"]) in again.json()["detail"]
        part, local = (
            item["item_id"] % shard.MAX_PARTITIONS,
            item["item_id"] // shard.MAX_PARTITIONS,
        )
        with psycopg.connect(urls[part]) as c:
            row = c.execute(
                "SELECT outcome, note FROM memory.review_queue WHERE id = %s", (local,)
            ).fetchone()
        assert row == ("confirmed", "still black coffee")
    # An id of a partition this proxy does not have: as unknown as one never opened.
    r = proxied.post(f"/memory/review/{7 * shard.MAX_PARTITIONS + PARTITIONS}/confirm", json={})
    assert r.status_code == 404 and r.json()["error"] == "unknown_review_item", r.text
    left = proxied.get("/memory/review", params={"limit": 100}).json()["items"]
    assert [i for i in left if i["project"] in projects] == []
    # A conflict names the parent's item by its global id too.
    mine = projects[1]
    line = {"project": mine, "id": "t:coffee", "level": "L0", "revision": 1,
            "text": f"Mara of {mine}: I take my coffee with oat milk now."}  # fmt: skip
    assert proxied.post("/memory/nodes", json=[line]).status_code == 201
    doubted = {
        i["external_id"]: i["item_id"]
        for i in proxied.get("/memory/review", params={"project": mine}).json()["items"]
    }
    assert set(doubted) == {"m:coffee", "s:profile"}, doubted
    r = proxied.post(f"/memory/review/{doubted['s:profile']}/confirm", json={})
    assert r.status_code == 409 and r.json()["error"] == "review_conflict", r.text
    assert f"Its review item is {doubted['m:coffee']}." in r.text, r.text


def test_a_stopped_shard_is_a_503_for_its_projects_and_degrades_the_rest(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, _ = services
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    down = sharded.shards[0]
    down_parts = sorted(
        pt.number for pt in parts if f"port={down.port}" in pt.conninfo.replace("'", "")
    )
    down_projects = [n for n, pt in sharded.projects.items() if pt in down_parts]
    up_projects = [n for n, pt in sharded.projects.items() if pt not in down_parts]
    assert down_projects and up_projects
    down.stop()
    try:
        for project in down_projects:
            r = proxied.get("/memory/query", params={"query": QUERIES[0], "project": project})
            assert r.status_code == 503, r.text
            # The service's own code for SQLSTATE 08006; the partition is named in its log.
            assert r.json()["error"] == "database_unavailable", r.json()
            assert r.headers["Retry-After"]
            w = proxied.post(
                "/memory/nodes", json=[{"project": project, "level": "L0", "text": "lost?"}]
            )
            assert w.status_code == 503, w.text
        for project in up_projects:
            r = proxied.get("/memory/query", params={"query": QUERIES[0], "project": project})
            assert r.status_code == 200, r.text
        r = proxied.get("/memory/query", params={"query": QUERIES[0], "limit": 20})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d for d in body["degraded"] if d["stage"] == "shard"] == [
            {"stage": "shard", "reason": "unreachable", "partitions": down_parts}
        ]
        assert {x["project"] for x in body["results"]} <= set(up_projects) | {
            f"h{i}" for i in range(6)
        }
        health = proxied.get("/healthz").json()
        assert health["checks"]["database"]["partitions"]["missing"] == down_parts
        # A page over several partitions never skips one: 503, as the review queue's page.
        for path in ("/memory/nodes", "/memory/review"):
            r = proxied.get(path)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"] == "database_unavailable" and r.headers["Retry-After"]
        up = up_projects[0]
        assert proxied.get("/memory/nodes", params={"project": up}).status_code == 200
        assert proxied.get("/memory/review", params={"project": up}).status_code == 200
        r = proxied.get("/memory/review", params={"project": down_projects[0]})
        assert r.status_code == 503 and r.json()["error"] == "database_unavailable", r.text
        # A claim takes what is ready on the others (a WARNING names the missing ones).
        r = proxied.post("/memory/review/claim", json={"limit": 5})
        assert r.status_code == 200, r.text
        assert {i["item_id"] % shard.MAX_PARTITIONS for i in r.json()["items"]}.isdisjoint(
            down_parts
        )
        r = proxied.post(
            f"/memory/review/{5 * shard.MAX_PARTITIONS + down_parts[0]}/confirm", json={}
        )
        assert r.status_code == 503 and r.json()["error"] == "database_unavailable", r.text
    finally:
        down.start(fast=True)
    # Back: a proxy backend that held a connection to the restarted server learns of its end
    # on its next call there (57P01, a typed 503 too), and reconnects on the one after.
    for project in down_projects:
        statuses = []
        for _ in range(10):
            r = proxied.get("/memory/query", params={"query": QUERIES[0], "project": project})
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.json()["error"] == "database_unavailable", r.text
        assert statuses[-1] == 200, statuses


def test_the_partitions_confine_a_key_even_without_the_python_checks(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defence in depth over the proxy: with KeyRing's project checks replaced by bare
    authentication, an atlas key still reads and writes nothing of poimen, because the
    key's projects travel to the partitions and their row-level security applies them."""

    async def any_project(self: KeyRing, request: Request, project: str | None) -> str | None:
        await self.grant(request)
        return project

    async def any_write(self: KeyRing, request: Request, projects: Any) -> None:
        await self.grant(request)

    monkeypatch.setattr(KeyRing, "read_project", any_project)
    monkeypatch.setattr(KeyRing, "write_projects", any_write)
    proxied, _ = services
    reader = {"Authorization": f"Bearer {make_key(sharded.proxy_url, ['atlas'])}"}
    writer = {"Authorization": f"Bearer {make_key(sharded.proxy_url, ['atlas'], write=True)}"}
    try:
        r = proxied.get(
            "/memory/query", params={"query": QUERIES[0], "level": LEVELS, "limit": 50},
            headers=reader,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert {x["project"] for x in r.json()["results"]} == {"atlas"}
        hidden = proxied.get(
            "/memory/query", params={"query": QUERIES[0], "project": "poimen"}, headers=reader
        )
        assert hidden.status_code == 404 and hidden.json()["error"] == "unknown_project"
        node = proxied.get(
            "/memory/nodes/poimen:mem:1", params={"project": "poimen"}, headers=reader
        )
        assert node.status_code in (403, 404), node.text  # read_scope: still checked
        history = proxied.get(
            "/memory/nodes/poimen:mem:1/history", params={"project": "poimen"}, headers=reader
        )
        assert history.status_code in (403, 404) or history.json()["versions"] == []
        plant = {"project": "poimen", "id": "planted", "level": "L0", "text": "not yours"}
        r = proxied.post("/memory/nodes", json=[plant], headers=writer)
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        assert where_is(sharded, "poimen", "planted") == []
        r = proxied.delete(
            "/memory/nodes/poimen:mem:1", params={"project": "poimen"}, headers=writer
        )
        assert r.status_code in (403, 404), r.text
        ok = proxied.get("/memory/nodes/poimen:mem:1", params={"project": "poimen"})
        assert ok.status_code == 401  # keys exist: anonymous is refused
    finally:
        with psycopg.connect(sharded.proxy_url, autocommit=True) as p:
            p.execute("DELETE FROM memory.api_keys")
    assert (
        proxied.get("/memory/nodes/poimen:mem:1", params={"project": "poimen"}).status_code == 200
    )


def test_the_project_names_mcp_lists_come_from_every_partition(sharded: Sharded) -> None:  # noqa: F811
    """The service's project_names statement (MCP's resources/list) on the proxy: the view
    memory.projects over every partition, under the caller's asserted projects."""
    with connect(sharded.proxy_url, autocommit=True) as p:
        p.execute(f"SET ROLE {SERVICE_ROLE}")
        for read, projects, expected in (
            ("*", None, set(sharded.projects)),
            ("atlas", ["atlas"], {"atlas"}),
            ("atlas", None, {"atlas"}),  # row-level security alone
        ):
            p.execute("SELECT set_config('poimen.read_projects', %s, false)", (read,))
            names = {str(r[0]) for r in p.execute(q("project_names"), {"projects": projects})}
            assert expected <= names if read == "*" else names == expected
        p.execute("SELECT set_config('poimen.read_projects', '', false)")
        assert p.execute(q("project_names"), {"projects": None}).fetchall() == []


def test_the_proxy_functions_pin_search_path_and_have_a_comment(sharded: Sharded) -> None:  # noqa: F811
    """As on a partition (tests/test_sql_hygiene.py): every function of the proxy's schemas
    but PL/Proxy's own remote calls (which run nothing locally)."""
    with psycopg.connect(sharded.proxy_url) as p:
        bad = p.execute(
            "SELECT p.oid::regprocedure::text"
            " FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
            " WHERE p.pronamespace IN ('memory'::regnamespace, 'memory_proxy'::regnamespace)"
            " AND (obj_description(p.oid, 'pg_proc') IS NULL OR (l.lanname <> 'plproxy'"
            " AND NOT coalesce(p.proconfig, '{}') @> ARRAY['search_path=pg_catalog, pg_temp']))"
            " ORDER BY 1"
        ).fetchall()
    assert bad == []


# -- a reranker over the proxy -------------------------------------------------------------


@pytest.fixture(scope="module")
def reranked(
    sharded: Sharded,  # noqa: F811
    embedder: LocalEmbedder,
) -> Iterator[tuple[httpx.Client, httpx.Client, RerankServer]]:
    """(over the proxy, over the reference database, the rerank double both call)."""
    with connect(sharded.reference_url, autocommit=True) as ref:
        ensure_service_login(ref, SERVICE_ROLE)
    with run_rerank_server() as rerank:
        env = {"POIMEN_RERANK_URL": rerank.url}
        with (
            http_service(_as_service(sharded.proxy_url), embedder, env) as proxied,
            http_service(_as_service(sharded.reference_url), embedder, env) as one,
        ):
            yield proxied, one, rerank


def _partition_of(sharded: Sharded, projects: set[str]) -> dict[str, int]:  # noqa: F811
    with psycopg.connect(sharded.proxy_url) as p:
        return {
            n: int(p.execute("SELECT memory_proxy.partition_of(%s)", (n,)).fetchone()[0])  # type: ignore[index]
            for n in projects
        }


def _cites_its_own(body: dict[str, Any]) -> int:
    """The evidence citing a result (cited_by: ranks of the merged answer) is of its
    project, so of its partition, and is the result or a turn of its provenance; how many
    citations there were."""
    results = body["results"]
    reached: list[set[str]] = []
    for r in results:
        shas, stack = {r["sha256"]}, list(r["parents"])
        while stack:
            parent = stack.pop()
            shas.add(parent["sha256"])
            stack.extend(parent["parents"])
        reached.append(shas)
    cited = 0
    for e in body["evidence"]:
        for rank in e["cited_by"]:
            assert 1 <= rank <= len(results), e
            assert e["project"] == results[rank - 1]["project"], (rank, e)
            assert e["sha256"] in reached[rank - 1], (rank, e)
            cited += 1
    return cited


def test_a_reranker_orders_a_query_naming_no_project_over_every_partition(
    sharded: Sharded,  # noqa: F811
    reranked: tuple[httpx.Client, httpx.Client, RerankServer],
) -> None:
    proxied, _, rerank = reranked
    limit = 6
    # Scores by candidate: the later the fused candidate, the better (distinct, so each
    # result is known by its score): the reranker's order is the fused order reversed.
    scores = [round(0.05 + 0.9 * i / 63, 6) for i in range(64)]
    rerank.reset(scores=scores)
    params = {"query": QUERIES[0], "level": LEVELS, "limit": limit}
    r = proxied.get("/memory/query", params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    sent = rerank.requests[-1].body
    assert isinstance(sent, dict) and sent["query"] == QUERIES[0]
    docs = sent["documents"]
    n = len(docs)
    assert n == limit * 3  # limit x POIMEN_RERANK_DEPTH_FACTOR candidates over all partitions
    best = list(range(n - 1, n - 1 - limit, -1))
    results = body["results"]
    assert [x["rank"] for x in results] == list(range(1, limit + 1))
    assert [x["rerank_score"] for x in results] == pytest.approx([scores[i] for i in best])
    assert [x["text"] for x in results] == [docs[i] for i in best]
    # The fused order is not the answer's: the reranker's is.
    assert results[0]["final_score"] <= results[-1]["final_score"]
    parts = _partition_of(sharded, {x["project"] for x in results})
    assert len(set(parts.values())) > 1, parts
    assert body["plan"]["engines"]["rerank"] == "remote"
    assert not [d for d in body["degraded"] if d["stage"] in ("rerank", "shard")]
    assert body["metrics"]["final_count"] == limit
    assert f"reranker reduced {n} candidates to {limit}" in body["notes"]
    assert _cites_its_own(body) > 0
    # The double's own scores (word overlap with the query): the answer in their order.
    rerank.reset()
    for query in QUERIES:
        r = proxied.get("/memory/query", params={"query": query, "level": LEVELS, "limit": 8})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert results, query
        got = [x["rerank_score"] for x in results]
        assert got == pytest.approx([word_overlap(query, x["text"]) for x in results])
        assert got == sorted(got, reverse=True)
        sent_docs = rerank.requests[-1].body["documents"]
        overlaps = sorted((word_overlap(query, d) for d in sent_docs), reverse=True)
        assert got == pytest.approx(overlaps[: len(got)])
        _cites_its_own(body)


def test_a_reranker_on_a_named_project_answers_as_one_database(
    reranked: tuple[httpx.Client, httpx.Client, RerankServer],
) -> None:
    proxied, one, rerank = reranked
    rerank.reset()
    compared = 0
    for project in ("poimen", "atlas"):
        for query in QUERIES:
            params = {"query": query, "project": project, "level": LEVELS, "limit": 5}
            a = proxied.get("/memory/query", params=params)
            b = one.get("/memory/query", params=params)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.json()["plan"]["engines"]["rerank"] == "remote"
            assert comparable(a.json()) == comparable(b.json())
            compared += len(b.json()["results"])
    assert compared > 0


def test_a_stopped_shard_degrades_a_reranked_query_naming_no_project(
    sharded: Sharded,  # noqa: F811
    reranked: tuple[httpx.Client, httpx.Client, RerankServer],
) -> None:
    proxied, _, rerank = reranked
    rerank.reset()
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    down = sharded.shards[0]
    down_parts = sorted(
        pt.number for pt in parts if f"port={down.port}" in pt.conninfo.replace("'", "")
    )
    up_parts = sorted(set(range(PARTITIONS)) - set(down_parts))
    assert down_parts and up_parts
    params = {"query": QUERIES[0], "level": LEVELS, "limit": 8}
    down.stop()
    try:
        r = proxied.get("/memory/query", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d for d in body["degraded"] if d["stage"] == "shard"] == [
            {"stage": "shard", "reason": "unreachable", "partitions": down_parts}
        ]
        why = "partitions {%s} are unreachable: answered from the others"
        assert why % ",".join(map(str, down_parts)) in body["plan"]["why"]
        assert body["plan"]["engines"]["rerank"] == "remote"
        results = body["results"]
        assert results
        where = _partition_of(sharded, {x["project"] for x in results})
        assert set(where.values()) <= set(up_parts), where
        got = [x["rerank_score"] for x in results]
        assert got == pytest.approx([word_overlap(QUERIES[0], x["text"]) for x in results])
        assert got == sorted(got, reverse=True)
        _cites_its_own(body)
    finally:
        down.start(fast=True)
    # Back: a proxy backend that held a connection to the restarted server learns of its end
    # on its next call there (degraded meanwhile), then answers from every partition again.
    for _ in range(10):
        r = proxied.get("/memory/query", params=params)
        assert r.status_code == 200, r.text
        if not [d for d in r.json()["degraded"] if d["stage"] == "shard"]:
            break
    assert not [d for d in r.json()["degraded"] if d["stage"] == "shard"], r.json()["degraded"]


# -- OpenSearch over the proxy -------------------------------------------------------------

OS_PROXY_INDEX = "pm-proxy"
OS_REF_INDEX = "pm-ref"
# A project of the module's own for comparisons with the reference database, written to both
# sides alike (the other tests of the module change poimen's and atlas' nodes on the proxy).
OS_PROJECT = "osref"


def _os_env(server: OpenSearchServer, index: str) -> dict[str, str]:
    return {
        "POIMEN_OPENSEARCH_URL": server.url,
        "POIMEN_OPENSEARCH_INDEX": index,
        "POIMEN_OPENSEARCH_DRAIN_INTERVAL_S": "0.2",
        # Batches of two: a drain walks several partitions' queues over several batches.
        "POIMEN_OPENSEARCH_SYNC_BATCH": "2",
    }


def _partition_nodes(sharded: Sharded) -> dict[str, tuple[str, int]]:  # noqa: F811
    """Every node of every partition, as the partitions' owner: sha256 -> (project, part)."""
    out: dict[str, tuple[str, int]] = {}
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    for pt in parts:
        with psycopg.connect(pt.admin("postgres")) as c:
            for sha, project in c.execute(
                "SELECT encode(n.sha256, 'hex'), p.name FROM memory.nodes n"
                " JOIN memory.projects p ON p.id = n.project_id"
            ):
                assert sha not in out, (sha, project, pt.number)  # never on two partitions
                out[sha] = (project, pt.number)
    return out


def _outbox_depths(sharded: Sharded) -> list[int]:  # noqa: F811
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    depths = []
    for pt in parts:
        with psycopg.connect(pt.admin("postgres")) as c:
            depths.append(
                int(c.execute("SELECT count(*) FROM memory.opensearch_outbox").fetchone()[0])
            )  # type: ignore[index]
    return depths


def _wait_for(check: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def searched(
    sharded: Sharded,  # noqa: F811
    embedder: LocalEmbedder,
) -> Iterator[tuple[httpx.Client, httpx.Client, OpenSearchServer]]:
    """(over the proxy, over the reference database, the OpenSearch double both use): each
    service its own index, rebuilt first by `opensearch reindex`'s code (the proxy's over
    its partitions), then fed by the service's own drain of the outboxes."""
    nodes = renamed(fixture_nodes(), "poimen", OS_PROJECT)
    with connect(sharded.reference_url, autocommit=True) as ref:
        ensure_service_login(ref, SERVICE_ROLE)
        ref.execute("SELECT set_config('poimen.api_key', '41', false)")
        ref.execute("SELECT memory.add_nodes(%s)", (json.dumps(nodes),))
    with psycopg.connect(sharded.proxy_url, autocommit=True) as p:
        p.execute("SELECT set_config('poimen.write_projects', '*', false)")
        p.execute("SELECT set_config('poimen.read_projects', '*', false)")
        p.execute("SELECT set_config('poimen.api_key', '41', false)")
        p.execute("SELECT memory.add_nodes(%s)", (json.dumps(nodes),))
    with run_opensearch_server() as server:
        for url, index in (
            (sharded.proxy_url, OS_PROXY_INDEX),
            (sharded.reference_url, OS_REF_INDEX),
        ):
            with (
                connect(url, autocommit=True) as conn,
                OpenSearchEngine(server.url, index) as engine,
            ):
                assert reindex(conn, engine, batch_size=50, progress=False) > 0
        with (
            http_service(
                _as_service(sharded.proxy_url), embedder, _os_env(server, OS_PROXY_INDEX)
            ) as proxied,
            http_service(
                _as_service(sharded.reference_url), embedder, _os_env(server, OS_REF_INDEX)
            ) as one,
        ):
            yield proxied, one, server


def test_every_partition_reindexes_into_one_index_without_collisions(
    sharded: Sharded,  # noqa: F811
    searched: tuple[httpx.Client, httpx.Client, OpenSearchServer],
) -> None:
    _, _, server = searched
    nodes = _partition_nodes(sharded)
    docs = server.docs(OS_PROXY_INDEX)
    # One document a node of every partition, under its content hash, with its project: the
    # same text in a project of each partition is a document of each.
    assert set(docs) == set(nodes)
    assert {d["project_id"] for d in docs.values()} == {p for p, _ in nodes.values()}
    for sha, doc in docs.items():
        assert doc["project_id"] == nodes[sha][0] and doc["sha256"] == sha
    copies = {sha for sha, (project, _) in nodes.items() if project in sharded.projects}
    assert len({nodes[s][1] for s in copies}) == PARTITIONS  # on every partition
    poimen = sorted(d["content"] for d in docs.values() if d["project_id"] == "poimen")
    for project in sharded.projects:
        if project not in ("poimen", "atlas"):
            # the copy of poimen's nodes: its texts, documents of their own
            same = sorted(d["content"] for d in docs.values() if d["project_id"] == project)
            assert same == poimen
    # The reference's documents of the module's project are the proxy's, field by field.
    ref = {k: v for k, v in server.docs(OS_REF_INDEX).items() if v["project_id"] == OS_PROJECT}
    mine = {k: v for k, v in docs.items() if v["project_id"] == OS_PROJECT}
    assert ref == mine and len(mine) == len(renamed(fixture_nodes(), "poimen", OS_PROJECT))


def test_a_reindex_that_would_miss_documents_leaves_the_index_as_it_is(
    sharded: Sharded,  # noqa: F811
    searched: tuple[httpx.Client, httpx.Client, OpenSearchServer],
) -> None:
    _, _, server = searched
    before = server.docs(OS_PROXY_INDEX)
    assert before
    # A role the proxy forwards no projects for sees no partition's nodes: refused before
    # the index is dropped (not "reindexed 0 nodes" over an empty index).
    with psycopg.connect(sharded.proxy_url, autocommit=True) as p:
        p.execute("DROP ROLE IF EXISTS reindexer")
        p.execute("CREATE ROLE reindexer")
    with (
        connect(sharded.proxy_url, autocommit=True) as conn,
        OpenSearchEngine(server.url, OS_PROXY_INDEX) as engine,
        pytest.raises(Forbidden, match="cannot drain or reindex through the proxy"),
    ):
        conn.execute("SET ROLE reindexer")
        reindex(conn, engine, batch_size=50, progress=False)
    assert server.docs(OS_PROXY_INDEX) == before
    # A partition out of reach: refused before the drop too, naming the partitions.
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    down = sharded.shards[0]
    down_parts = sorted(
        pt.number for pt in parts if f"port={down.port}" in pt.conninfo.replace("'", "")
    )
    down.stop()
    try:
        with (
            connect(sharded.proxy_url, autocommit=True) as conn,
            OpenSearchEngine(server.url, OS_PROXY_INDEX) as engine,
            pytest.raises(DatabaseUnavailable) as err,
        ):
            reindex(conn, engine, batch_size=50, progress=False)
        assert str(down_parts) in str(err.value)
        assert server.docs(OS_PROXY_INDEX) == before
        # A drain meanwhile takes the others' rows and says whose it could not.
        with (
            connect(sharded.proxy_url, autocommit=True) as conn,
            OpenSearchEngine(server.url, OS_PROXY_INDEX) as engine,
        ):
            report = sync_outbox(conn, engine, progress=False)
        assert report.unreached == tuple(down_parts) and not report.complete, report
        assert str(down_parts) in report.summary()
    finally:
        down.start(fast=True)


def test_writes_through_the_proxy_reach_opensearch_through_its_drain(
    sharded: Sharded,  # noqa: F811
    searched: tuple[httpx.Client, httpx.Client, OpenSearchServer],
) -> None:
    proxied, _, server = searched
    names = [f"os{i}" for i in range(6)]
    where = _partition_of(sharded, names)
    assert len(set(where.values())) > 1
    batch = [
        {"project": n, "id": f"{n}:1", "level": "L0", "text": f"zebra crossing number {i}"}
        for i, n in enumerate(names)
    ]
    r = proxied.post("/memory/nodes", json=batch)
    assert r.status_code == 201, r.text
    shas = {}
    for n in names:
        got = proxied.get(f"/memory/nodes/{n}:1", params={"project": n})
        assert got.status_code == 200, got.text
        shas[n] = got.json()["sha256"]
    docs = server.docs(OS_PROXY_INDEX)
    _wait_for(lambda: set(shas.values()) <= set(docs), "the drain to index the writes")
    for i, n in enumerate(names):
        doc = docs[shas[n]]
        assert (doc["project_id"], doc["content"], doc["level"]) == (
            n,
            f"zebra crossing number {i}",
            "L0",
        )
    # Nothing of it went to the reference's index.
    assert not set(shas.values()) & set(server.docs(OS_REF_INDEX))
    # A new version replaces the document; a forgotten node's goes.
    r = proxied.post(
        "/memory/nodes",
        json=[{"project": "os0", "id": "os0:1", "level": "L0", "text": "zebra crossing, moved"}],
    )
    assert r.status_code == 201, r.text
    new = proxied.get("/memory/nodes/os0:1", params={"project": "os0"}).json()["sha256"]
    assert new != shas["os0"]
    r = proxied.delete("/memory/nodes/os1:1", params={"project": "os1", "reason": "test"})
    assert r.status_code == 200, r.text
    _wait_for(
        lambda: new in docs and shas["os0"] not in docs and shas["os1"] not in docs,
        "the drain to replace and delete documents",
    )
    assert docs[new]["content"] == "zebra crossing, moved"
    # Every partition's outbox drained, and /healthz and /metrics say so over the proxy.
    _wait_for(lambda: _outbox_depths(sharded) == [0] * PARTITIONS, "empty outboxes")
    db = proxied.get("/healthz").json()["checks"]["database"]
    assert db["outbox"] == {"depth": 0, "lag_s": 0.0}
    assert "poimen_opensearch_outbox_backlog 0.0" in proxied.get("/metrics").text


def test_a_named_project_with_opensearch_answers_as_one_database(
    searched: tuple[httpx.Client, httpx.Client, OpenSearchServer],
) -> None:
    proxied, one, server = searched
    compared = 0
    for query in QUERIES:
        for strategy in (None, "LexicalOnly"):
            params = {"query": query, "project": OS_PROJECT, "level": LEVELS, "limit": 8}
            if strategy:
                params["strategy"] = strategy
            server.requests.clear()
            a = proxied.get("/memory/query", params=params)
            b = one.get("/memory/query", params=params)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.json()["plan"]["engines"]["lexical"] == "opensearch"
            assert comparable(a.json()) == comparable(b.json())
            # Each asked its own index, filtered to the project.
            searches = server.requests_to("/_search")
            assert sorted(s.path for s in searches) == [
                f"/{OS_PROXY_INDEX}/_search",
                f"/{OS_REF_INDEX}/_search",
            ]
            for s in searches:
                assert {"term": {"project_id": OS_PROJECT}} in s.body["query"]["bool"]["filter"]
            compared += sum(1 for x in a.json()["results"] if x["lexical_rank"])
    assert compared > 0


def test_a_query_naming_no_project_gives_each_partition_its_own_opensearch_hits(
    sharded: Sharded,  # noqa: F811
    searched: tuple[httpx.Client, httpx.Client, OpenSearchServer],
) -> None:
    proxied, _, server = searched
    nodes = _partition_nodes(sharded)
    for strategy in ("LexicalOnly", None):
        params = {"query": QUERIES[1], "level": LEVELS, "limit": 20}
        if strategy:
            params["strategy"] = strategy
        server.requests.clear()
        r = proxied.get("/memory/query", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["plan"]["engines"]["lexical"] == "opensearch"
        assert not [d for d in body["degraded"] if d["stage"] in ("lexical", "shard")]
        (sent,) = server.requests_to("/_search")
        assert not [f for f in sent.body["query"]["bool"]["filter"] if "term" in f]
        hits = server.search(OS_PROXY_INDEX, sent.body, source=False)["hits"]["hits"]
        # A partition's lexical leg is its own hits, in OpenSearch's order: a result's
        # lexical rank is its place among the hits on its partition, its score the hit's.
        by_part: dict[int, list[str]] = {}
        for h in hits:
            by_part.setdefault(nodes[h["_id"]][1], []).append(h["_id"])
        score = {h["_id"]: h["_score"] for h in hits}
        results = body["results"]
        assert results
        lexical = [x for x in results if x["lexical_rank"]]
        assert len({nodes[x["sha256"]][1] for x in lexical}) > 1
        for x in lexical:
            part = nodes[x["sha256"]][1]
            assert x["lexical_rank"] == by_part[part].index(x["sha256"]) + 1, x
            assert x["lexical_score"] == score[x["sha256"]]
        if strategy == "LexicalOnly":
            assert lexical == results
        finals = [x["final_score"] for x in results]
        assert finals == sorted(finals, reverse=True)


def test_mcp_reads_a_project_over_the_proxy_from_its_partition(
    sharded: Sharded,  # noqa: F811
    services: tuple[httpx.Client, httpx.Client],
) -> None:
    proxied, _ = services
    base = str(proxied.base_url).rstrip("/")
    uris = [f"poimen://projects/{p}" for p in ("atlas", "poimen")] + ["poimen://projects/nope"]
    got = over_http(base, None, _resources(uris))
    listed = {r.name for r in got["listed"]}
    assert {"atlas", "poimen"} <= listed
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    for project in ("atlas", "poimen"):
        url = parts[sharded.projects[project]].admin("postgres")
        expected = _summaries(url)[project]
        assert got["read"][f"poimen://projects/{project}"] == expected
        assert expected["nodes"]["L0"] > 0
    code, status, data = got["read"]["poimen://projects/nope"]
    assert (code, status) == ("error", -32602)
    assert (data["error"], data["status"], data["sqlstate"]) == ("unknown_project", 404, "PM404")


def test_a_query_naming_no_project_gives_each_partition_its_own_prefetched_semantic_leg(
    sharded: Sharded,  # noqa: F811
    embedder: LocalEmbedder,
) -> None:
    """memory._serve through => 'semantic' naming no project (what the service runs while
    OpenSearch answers) runs every partition's semantic leg, by partition; the query
    statement gives each partition its own back, and the answer is the one without them."""
    text = QUERIES[1]
    req = json.dumps({"query": text, "k": 12, "routing": optimize_query(text).to_dict()})
    caps = json.dumps(
        {"vector": True, "lexical": ["postgres"], "read_projects": "*", "write_projects": ""}
    )
    emb = embedder.embed_query(text)
    serve = "SELECT memory._serve(%s::jsonb, %s::jsonb, %s, NULL, %s, %s::jsonb)"
    with connect(sharded.proxy_url, autocommit=True) as p:
        p.execute(f"SET ROLE {SERVICE_ROLE}")

        def run(through: str, prefetched: dict[str, Any] | None) -> dict[str, Any]:
            row = p.execute(
                serve, (req, caps, emb, through, json.dumps(prefetched) if prefetched else None)
            ).fetchone()
            assert row is not None
            doc: dict[str, Any] = row[0]
            return doc

        ahead = run("semantic", None)
        assert set(ahead) == {"partitions"}
        assert sorted(map(int, ahead["partitions"])) == list(range(PARTITIONS))
        for leg in ahead["partitions"].values():
            assert leg["semantic"]["ids"], leg
        plain = run("answer", None)
        taken = run("answer", {"calls": {}, "stages": {}, **ahead})
        assert plain["results"] and strip_ids(taken["results"]) == strip_ids(plain["results"])
        assert {x["project"] for x in plain["results"]} > {"poimen"}
        # Each partition takes its own: poimen's, emptied, leaves poimen's results without a
        # semantic rank, and the others' keep theirs.
        part = str(sharded.projects["poimen"])
        emptied = {**ahead["partitions"][part], "semantic": {"ids": [], "scores": []}}
        changed = run(
            "answer",
            {"calls": {}, "stages": {}, "partitions": {**ahead["partitions"], part: emptied}},
        )
        where = _partition_of(sharded, [x["project"] for x in changed["results"]])
        mine = [x for x in changed["results"] if where[x["project"]] == int(part)]
        others = [x for x in changed["results"] if where[x["project"]] != int(part)]
        assert mine and others
        assert all(x["semantic_rank"] is None for x in mine)
        assert any(x["semantic_rank"] is not None for x in others)
        assert all(x["semantic_rank"] is not None for x in plain["results"])
