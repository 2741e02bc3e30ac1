"""The HTTP surface around retrieval: parameter validation and clamping, error bodies,
POST /memory/nodes, GET /healthz and GET /openapi.json, through the real app."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
import pytest
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient

from doubles.embedding_server import EmbeddingServer, run_embedding_server
from doubles.opensearch_server import run_opensearch_server
from doubles.rerank_server import run_rerank_server
from poimen_memory.api.app import create_app
from poimen_memory.api.body import read_body
from poimen_memory.api.openapi import openapi_spec
from poimen_memory.embedders.base import Embedder
from poimen_memory.embedders.local import LOCAL_MODEL_NAME, LocalEmbedder
from poimen_memory.errors import ConfigError, PayloadTooLarge
from poimen_memory.settings import Settings
from service_client import LoopbackClient

KONG = "how do I fix uploads over 10KB failing through the kong gateway"  # routes Hybrid
ERROR_KEYS = {"error", "detail", "context", "hint"}  # the Error schema's properties


def make_app(env: Mapping[str, str], embedder: Embedder | None = None) -> Any:
    return create_app(Settings.from_env(env), embedder=embedder)


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with LoopbackClient(make_app({"POIMEN_DATABASE_URL": fixture_url}, embedder)) as c:
        yield c


def error(response: Any, status: int, code: str) -> dict[str, Any]:
    """Assert an error response has the documented shape and return its body."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == code
    assert isinstance(body["detail"], str) and body["detail"]
    assert set(body) <= ERROR_KEYS and all(isinstance(v, str) for v in body.values())
    return body


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("params", [{}, {"query": ""}, {"query": "   \t "}, {"level": "L0"}])
def test_missing_or_empty_query_is_400(client: TestClient, params: dict[str, str]) -> None:
    body = error(client.get("/memory/query", params=params), 400, "invalid_parameter")
    assert body["detail"] == "query is required and must not be empty"


def test_overlong_query_is_400(fixture_url: str, embedder: LocalEmbedder) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_MAX_QUERY_CHARS": "20"}
    with LoopbackClient(make_app(env, embedder)) as client:
        body = error(
            client.get("/memory/query", params={"query": "x" * 21}), 400, "invalid_parameter"
        )
        assert client.get("/memory/query", params={"query": "kong body buffer"}).status_code == 200
    assert "longer than 20 characters" in body["detail"]
    assert "POIMEN_MAX_QUERY_CHARS" in body["hint"]


def test_unknown_project_is_404(client: TestClient) -> None:
    response = client.get("/memory/query", params={"query": KONG, "project": "nope"})
    body = error(response, 404, "unknown_project")
    # The database's own error (PM404), as SQL users get it.
    assert body["detail"] == 'unknown project "nope"'
    assert "SELECT name FROM memory.projects" in body["hint"]


@pytest.mark.parametrize("level", ["L9", "L0,L3", "l1", ",", "", "L1;L2"])
def test_bad_level_is_400(client: TestClient, level: str) -> None:
    response = client.get("/memory/query", params={"query": KONG, "level": level})
    body = error(response, 400, "invalid_parameter")
    assert "level must be a comma-separated subset of L0,L1,L2" in body["detail"]


def test_level_list_is_trimmed_and_deduplicated(client: TestClient) -> None:
    body = client.get("/memory/query", params={"query": KONG, "level": " L0 , L0,"}).json()
    assert body["level_filter"] == ["L0"] and {r["level"] for r in body["results"]} == {"L0"}


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("limit", "many", "limit must be a whole number, got 'many'"),
        ("limit", "2.5", "limit must be a whole number, got '2.5'"),
        # Python's int() reads other scripts' digits; a query string's number is ASCII.
        ("limit", "\u0661\u0660", "limit must be a whole number"),
        ("timeout_seconds", "soon", "timeout_seconds must be a number"),
        ("fusion", "borda", "fusion must be one of rrf, convex, got 'borda'"),
        ("strategy", "Magic", "strategy must be one of LexicalOnly, LexicalFirst, Hybrid"),
        ("unsupported", "hide", "unsupported must be one of demote, exclude, keep"),
        ("as_of", "", "as_of must be an ISO 8601 timestamp, got ''"),
        ("valid_at", "soon", "valid_at must be an ISO 8601 timestamp"),
        ("dense_weight", "1.5", "dense_weight must be within 0..1, got 1.5"),
        ("candidates", "0", "candidates must be within 1..1000, got 0"),
        ("rrf_k", "-1", "rrf_k must be within 0..999999, got -1"),
        # A typo is not ignored in silence.
        ("recency_half_life_days", "5", "unknown parameter 'recency_half_life_days'"),
    ],
)
def test_bad_parameters_are_400(client: TestClient, name: str, value: str, message: str) -> None:
    response = client.get("/memory/query", params={"query": KONG, name: value})
    assert message in error(response, 400, "invalid_parameter")["detail"]


def test_strategy_override(client: TestClient) -> None:
    body = client.get("/memory/query", params={"query": KONG, "strategy": "LexicalOnly"}).json()
    assert body["plan"]["optimizer_strategy"] == "Hybrid"
    assert body["search_strategy"] == "LexicalOnly"
    assert "strategy LexicalOnly forced by the request" in body["notes"]
    assert all(r["semantic_rank"] is None for r in body["results"])


# -- bounds: out of range is refused by name, never clamped ---------------------------------


@pytest.mark.parametrize(
    ("limit", "status"), [("0", 400), ("-7", 400), ("1", 200), ("4", 200), ("5", 400)]
)
def test_limit_beyond_the_deployments_bound_is_400(
    fixture_url: str, embedder: LocalEmbedder, limit: str, status: int
) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_MAX_LIMIT": "4"}
    with LoopbackClient(make_app(env, embedder)) as client:
        params = {"query": KONG, "level": "L0,L1,L2", "limit": limit}
        response = client.get("/memory/query", params=params)
    if status == 200:
        body = response.json()
        assert len(body["results"]) == body["metrics"]["final_count"] == int(limit)
    else:
        body = error(response, 400, "invalid_parameter")
        assert body["detail"] == f"limit must be within 1..4, got {limit}"
        assert "POIMEN_MAX_LIMIT" in body["hint"]


def test_a_parameter_given_twice_is_400(client: TestClient) -> None:
    response = client.get("/memory/query?query=kong&limit=2&limit=3")
    body = error(response, 400, "invalid_parameter")
    assert body["detail"] == "limit given more than once"


ONE = "poimen:chat:1"


@pytest.mark.parametrize(
    ("method", "url", "twice"),
    [
        # Starlette keeps the last value: this one forgot for real (a helper's attack)
        ("DELETE", f"/memory/nodes?project=poimen&id={ONE}&dry_run=true&dry_run=false", "dry_run"),
        ("DELETE", f"/memory/nodes/{ONE}?project=poimen&erase=false&erase=true", "erase"),
        ("DELETE", "/memory/nodes?project=poimen&source=&source=x", "source"),
        ("GET", "/memory/nodes?project=atlas&project=poimen", "project"),
        ("GET", f"/memory/nodes/{ONE}?project=atlas&project=poimen", "project"),
        ("GET", f"/memory/nodes/{ONE}/history?project=atlas&project=poimen", "project"),
        ("GET", "/memory/review?project=atlas&project=poimen", "project"),
        ("POST", "/memory/nodes?skip_invalid=false&skip_invalid=true", "skip_invalid"),
    ],
)
def test_every_route_refuses_a_parameter_given_twice(
    client: TestClient, fixture_url: str, method: str, url: str, twice: str
) -> None:
    body = b'[{"id": "t:1", "level": "L0", "project": "poimen", "text": "x"}]'
    kw: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}}
    response = client.request(method, url, **(kw if method == "POST" else {}))
    assert error(response, 400, "invalid_parameter")["detail"] == f"{twice} given more than once"
    with psycopg.connect(fixture_url) as conn:  # nothing was forgotten or written
        rows = conn.execute(
            "SELECT external_id FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
            " WHERE p.name = 'poimen' AND n.expired_at IS NULL AND external_id IN (%s, 't:1')",
            (ONE,),
        ).fetchall()
    assert rows == [(ONE,)]


BIG = "9" * 5000  # int() refuses to read past 4,300 digits: that was a 500


@pytest.mark.parametrize(
    ("method", "path", "name", "value", "detail"),
    [
        ("GET", "/memory/nodes", "limit", "0", "limit must be within 1..100, got 0"),
        ("GET", "/memory/nodes", "limit", "101", "limit must be within 1..100, got 101"),
        ("GET", "/memory/nodes", "limit", "-3", "limit must be within 1..100, got -3"),
        ("GET", "/memory/nodes", "limit", BIG, f"limit must be within 1..100, got {BIG[:40]}..."),
        ("GET", "/memory/nodes", "limit", "1e2", "limit must be a whole number, got '1e2'"),
        ("GET", "/memory/query", "limit", BIG, "limit must be a whole number"),
        ("GET", "/memory/review", "limit", "101", "limit must be within 1..100, got 101"),
        ("GET", "/memory/review", "after", BIG,
         f"after must be within 0..{2**62}, got {BIG[:40]}..."),
        ("POST", "/memory/review/claim", "visibility_timeout", "0",
         "visibility_timeout must be within 1..86400, got 0"),
        ("DELETE", "/memory/nodes", "max_nodes", BIG,
         f"max_nodes must be within 1..{2**31 - 1}, got {BIG[:40]}..."),
    ],
)  # fmt: skip
def test_a_number_out_of_bounds_is_refused_by_name_on_every_route(
    client: TestClient, method: str, path: str, name: str, value: str, detail: str
) -> None:
    """Every route's whole numbers are read one way (api/operations.whole_number): beyond
    their bounds refused with the bounds, never clamped (GET /memory/nodes clamped its limit
    while memory.list_nodes refused it), and a number of thousands of digits is a 400."""
    if method == "POST":  # the claim's numbers come in its JSON body
        response = client.post(path, json={"project": "poimen", name: int(value)})
    else:
        scope = {"project": "poimen", "source": "nothing"} if method == "DELETE" else {}
        if path == "/memory/query":
            scope = {"query": KONG}
        response = client.request(method, path, params={name: value, **scope})
    got = error(response, 400, "invalid_parameter")["detail"]
    assert got.startswith(detail) if path == "/memory/query" else got == detail, got
    if name == "max_nodes":  # the deployment's default is held to memory.forget's bound too
        with pytest.raises(ConfigError, match="POIMEN_FORGET_MAX_NODES"):
            Settings.from_env({"POIMEN_FORGET_MAX_NODES": str(2**31)})


def test_a_path_or_length_of_thousands_of_digits_is_refused_not_a_500(client: TestClient) -> None:
    """A review item id and a declared Content-Length are numbers the service reads too."""
    r = client.post(f"/memory/review/{BIG}/confirm", json={})
    assert error(r, 400, "invalid_parameter")["detail"].startswith("a review item id is")
    # leading zeros are no digits to read: 0...05 is 5, however many zeros
    padded = "0" * 4301 + "5"
    r = client.get("/memory/nodes", params={"limit": padded, "project": "poimen"})
    assert r.status_code == 200 and 0 < len(r.json()["nodes"]) <= 5, r.text
    r = client.get("/memory/review", params={"after": padded})
    assert r.status_code == 200, r.text
    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", BIG.encode())]}
    with pytest.raises(PayloadTooLarge, match="request body is over 10 bytes"):
        asyncio.run(read_body(Request(scope), 10, 1.0))


@pytest.fixture(scope="module")
def slow_embeddings() -> Iterator[EmbeddingServer]:
    with run_embedding_server(dim=384) as server:
        yield server


def remote_env(url: str, server: EmbeddingServer, **extra: str) -> dict[str, str]:
    return {
        "POIMEN_DATABASE_URL": url,
        "POIMEN_EMBEDDINGS_URL": server.url,
        # The fixture database's model name: another name would be a model_mismatch.
        "POIMEN_EMBEDDINGS_MODEL": LOCAL_MODEL_NAME,
        "POIMEN_EMBEDDINGS_DIM": "384",
        **extra,
    }


@pytest.mark.parametrize("timeout", ["0.01", "0.99", "600"])
def test_a_timeout_out_of_range_is_400(client: TestClient, timeout: str) -> None:
    response = client.get("/memory/query", params={"query": KONG, "timeout_seconds": timeout})
    body = error(response, 400, "invalid_parameter")
    assert body["detail"] == f"timeout_seconds must be within 1..30, got {float(timeout):g}"
    assert "POIMEN_MAX_TIMEOUT_S" in body["hint"]


def test_the_longest_timeout_bounds_the_embedder(
    fixture_url: str, slow_embeddings: EmbeddingServer
) -> None:
    slow_embeddings.reset(dim=384, delay_s=5)
    env = remote_env(fixture_url, slow_embeddings, POIMEN_MAX_TIMEOUT_S="1")
    with LoopbackClient(make_app(env)) as client:
        response = client.get("/memory/query", params={"query": KONG, "timeout_seconds": "1"})
    # 1 s: the embedder gets 1 s less the fallback reserve (0.5 s) and less what came
    # before it since the request arrived (the deadline counts from arrival: auth, parsing),
    # gives up, and the lexical answer comes instead.
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["degraded"][0] == {"stage": "embed", "reason": "timeout"}
    assert body["search_strategy"] == "LexicalOnly" and body["metrics"]["embed_time_ms"] >= 250


# -- POST /memory/nodes ---------------------------------------------------------------------

NEW_NODES: list[dict[str, Any]] = [
    {
        "id": "zeta:chat:1",
        "level": "L0",
        "title": "zeta standup",
        "text": "Ivan: the zeppelin telemetry exporter drops samples when the queue exceeds 4096.",
        "source": "zeta:chat:1",
        "timestamp": "2025-01-10T09:00:00Z",
    },
    {
        "id": "zeta:chat:2",
        "level": "L0",
        "title": "zeta standup",
        "text": "Judy: raising the zeppelin exporter queue to 16384 stopped the dropped samples.",
        "source": "zeta:chat:2",
        "timestamp": "2025-01-10T09:05:00Z",
    },
    {
        "id": "zeta:mem:1",
        "level": "L1",
        "text": "Zeppelin telemetry samples were dropped by a full exporter queue; 16384 fixed it.",
        "source": "zeta:mem:1",
        "timestamp": "2025-01-10T10:00:00Z",
        "parents": ["zeta:chat:1", "zeta:chat:2"],
    },
]


def ndjson(nodes: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(n) for n in nodes) + "\n"


def counts(url: str) -> tuple[int, int, list[str]]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM memory.nodes), (SELECT count(*) FROM memory.edges), "
            "ARRAY(SELECT name::text FROM memory.projects ORDER BY name)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), list(row[2])


def test_post_nodes_ingests_and_is_idempotent(client: TestClient, fixture_url: str) -> None:
    nodes0, edges0, projects0 = counts(fixture_url)
    created = client.post("/memory/nodes", params={"project": "zeta"}, content=ndjson(NEW_NODES))
    assert created.status_code == 201, created.text
    report = created.json()
    assert report["inserted"] == 3 and report["duplicates"] == 0 and report["edges"] == 2
    assert report["invalid"] == [] and report["unresolved"] == []
    assert counts(fixture_url) == (nodes0 + 3, edges0 + 2, sorted([*projects0, "zeta"]))

    # The new memory is searchable at once, with its evidence.
    body = client.get(
        "/memory/query", params={"query": "zeppelin exporter dropped samples", "project": "zeta"}
    ).json()
    top = body["results"][0]
    assert top["source"] == "zeta:mem:1" and top["project"] == "zeta"
    assert [p["source"] for p in top["parents"]] == ["zeta:chat:1", "zeta:chat:2"]
    assert "16384 stopped the dropped samples" in top["parents"][1]["text"]

    # The same nodes again, this time as a JSON array: nothing new.
    again = client.post("/memory/nodes", params={"project": "zeta"}, content=json.dumps(NEW_NODES))
    assert again.status_code == 201, again.text
    assert again.json()["inserted"] == 0 and again.json()["duplicates"] == 3
    assert again.json()["edges"] == 0
    assert counts(fixture_url) == (nodes0 + 3, edges0 + 2, sorted([*projects0, "zeta"]))


def test_post_invalid_node_writes_nothing(client: TestClient, fixture_url: str) -> None:
    before = counts(fixture_url)
    bad = [NEW_NODES[0], {**NEW_NODES[1], "level": "L7"}, NEW_NODES[2]]
    response = client.post("/memory/nodes", params={"project": "zeta"}, content=ndjson(bad))
    body = error(response, 400, "invalid_node")
    assert "1 invalid line(s); nothing was written" in body["detail"]
    assert body["context"] == "line 2: field 'level': must be one of L0, L1, L2, got 'L7'"
    assert body["hint"] == "fix the lines, or skip them (?skip_invalid=true)"
    assert counts(fixture_url) == before  # not even the project was created


def test_post_nodes_skip_invalid(client: TestClient, fixture_url: str) -> None:
    nodes0, _, _ = counts(fixture_url)
    bad: list[dict[str, Any]] = [NEW_NODES[0], {"level": "L0", "text": ""}]
    response = client.post(
        "/memory/nodes", params={"project": "zeta", "skip_invalid": "true"}, content=ndjson(bad)
    )
    assert response.status_code == 201, response.text
    assert response.json()["inserted"] == 1
    assert response.json()["invalid"] == ["line 2: field 'text': required, a non-empty string"]
    assert counts(fixture_url)[0] == nodes0 + 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no nodes in the request body"),
        ("\n\n", "no nodes in the request body"),
        ("[{", "body is not valid JSON"),
        # in our words, not Python's (which named sys.set_int_max_str_digits())
        (
            '[{"level": "L0", "text": "x", "metadata": {"n": ' + "9" * 5000 + "}}]",
            "body is not valid JSON: a whole number of 5000 digits (at most 4300)",
        ),
    ],
)
def test_post_nodes_empty_or_broken_body(client: TestClient, content: str, message: str) -> None:
    body = error(client.post("/memory/nodes", content=content), 400, "invalid_parameter")
    assert message in body["detail"]
    assert "sys." not in body["detail"]


def test_post_node_naming_a_key_twice_is_refused(client: TestClient) -> None:
    """json keeps the last of a repeated key: refused, as a repeated parameter is."""
    twice = '{"level": "L0", "text": "x", "project": "atlas", "project": "poimen"}'
    body = error(client.post("/memory/nodes", content=twice), 400, "invalid_node")
    assert "key 'project' is given more than once in an object" in body["context"], body


def test_post_node_without_project_names_the_field(client: TestClient) -> None:
    response = client.post("/memory/nodes", content=json.dumps({"level": "L0", "text": "orphan"}))
    body = error(response, 400, "invalid_node")
    assert body["context"] == "line 1: field 'project': required (or pass --project)"


# -- GET /healthz ---------------------------------------------------------------------------


def test_healthz_minimal(client: TestClient, embedder: LocalEmbedder) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    checks = body["checks"]
    assert checks["database"] == {
        "ok": True,
        "nodes": 21,
        "embedding_model": embedder.model_name,
        "outbox": {"depth": 0, "lag_s": 0.0},
        "scale_warnings": 0,
    }
    assert body["down"] == []
    assert checks["embedder"] == {"ok": True, "model": embedder.model_name, "dim": 384}
    assert checks["reranker"] == {"ok": None, "status": "not_configured"}
    assert checks["opensearch"] == {"ok": None, "status": "not_configured"}
    assert checks["embedding_cache"]["max_entries"] == 1024
    assert checks["embedding_cache"]["size"] == 0
    assert body["engines"] == {"lexical": "postgres-bm25", "semantic": "hnsw", "rerank": None}


def test_healthz_with_every_dependency(fixture_url: str, embedder: LocalEmbedder) -> None:
    with run_rerank_server() as rerank, run_opensearch_server() as opensearch:
        # A password in the URL (userinfo) is sent, and never shown: /healthz is open to
        # anyone who reaches the port (a helper's attack read it there).
        secret = rerank.url.replace("http://", "http://admin:S3cretRerank@")
        env = {
            "POIMEN_DATABASE_URL": fixture_url,
            "POIMEN_RERANK_URL": secret,
            "POIMEN_OPENSEARCH_URL": opensearch.url,
            "POIMEN_EMBED_CACHE_SIZE": "7",
        }
        env["POIMEN_HEALTH_CACHE_S"] = "0"  # probe on every call
        with LoopbackClient(make_app(env, embedder)) as client:
            up = client.get("/healthz").json()
            opensearch.down = True
            down = client.get("/healthz")
            rerank.knobs.fail_status = 503  # a reranker that answers errors is down too
            no_rerank = client.get("/healthz").json()
    assert "S3cret" not in json.dumps([up, down.json(), no_rerank])
    assert up["checks"]["reranker"] == {"ok": True, "endpoint": rerank.url + "/v1/rerank"}
    assert up["checks"]["opensearch"] == {"ok": True}
    assert up["checks"]["embedding_cache"]["max_entries"] == 7
    assert up["engines"] == {"lexical": "opensearch", "semantic": "hnsw", "rerank": "remote"}
    # OpenSearch down is not the service down: queries fall back to Postgres lexical.
    assert down.status_code == 200 and down.json()["status"] == "degraded"
    assert down.json()["down"] == ["opensearch"]
    assert down.json()["checks"]["opensearch"] == {"ok": False}
    assert down.json()["engines"]["lexical"] == "postgres-bm25"
    assert no_rerank["down"] == ["opensearch", "reranker"]
    assert no_rerank["checks"]["reranker"]["error"] == "http_503"
    assert no_rerank["engines"]["rerank"] is None


def test_healthz_without_lexical_engine(fixture_url: str, embedder: LocalEmbedder) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_PG_LEXICAL": "off"}
    with LoopbackClient(make_app(env, embedder)) as client:
        assert client.get("/healthz").json()["engines"]["lexical"] is None


# -- GET /openapi.json ----------------------------------------------------------------------


def test_every_operation_has_a_unique_operation_id_and_a_tag() -> None:
    """What generated clients name their calls after (openapi-python-client and others)."""
    spec = openapi_spec()
    ops = [op for path in spec["paths"].values() for op in path.values()]
    ids = [op.get("operationId") for op in ops]
    assert all(isinstance(i, str) and re.fullmatch(r"[a-z][A-Za-z]*", i) for i in ids), ids
    assert len(set(ids)) == len(ids), ids
    declared = {t["name"] for t in spec["tags"]}
    for op in ops:
        assert op.get("tags") and set(op["tags"]) <= declared, op["operationId"]
    assert ids[:2] == ["queryMemory", "addNodes"]


def test_openapi_lists_every_route_and_the_error_schema(
    fixture_url: str, embedder: LocalEmbedder
) -> None:
    app = make_app({"POIMEN_DATABASE_URL": fixture_url}, embedder)
    with LoopbackClient(app) as client:
        response = client.get("/openapi.json")
        sample = client.get("/memory/query", params={"query": KONG}).json()
    assert response.status_code == 200
    spec = response.json()
    assert spec["openapi"].startswith("3.1")
    routes = {
        # Starlette's {id:path} (an id may hold "/") is OpenAPI's {id}.
        r.path.replace(":path}", "}"): {m.lower() for m in (r.methods or ()) if m != "HEAD"}
        for r in app.routes
        if isinstance(r, Route)
    }
    assert {path: set(ops) for path, ops in spec["paths"].items()} == routes
    schemas = spec["components"]["schemas"]
    error_schema = schemas["Error"]
    assert error_schema["required"] == ["error", "detail"]
    assert set(error_schema["properties"]) == ERROR_KEYS
    for path, ops in spec["paths"].items():
        for op in ops.values():
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")) and "content" in resp:
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref == "#/components/schemas/Error", (path, status)
    query_errors = spec["paths"]["/memory/query"]["get"]["responses"]
    assert {"400", "404", "503"} <= set(query_errors)
    params = {p["name"] for p in spec["paths"]["/memory/query"]["get"]["parameters"]}
    assert params == {
        "query",
        "project",
        "level",
        "limit",
        "timeout_seconds",
        "fusion",
        "strategy",
        "since",
        "until",
        "reference_time",
        "evidence",
        "filter",
        "min_cosine",
        "as_of",
        "valid_at",
        "unsupported",
        "rrf_k",
        "candidates",
        "dense_weight",
    }
    # The documented response shapes cover what the service really returns.
    assert set(sample) <= set(schemas["QueryResponse"]["properties"])
    assert set(sample["results"][0]) <= set(schemas["Result"]["properties"])
    parent = sample["results"][0]["parents"][0]
    assert set(parent) <= set(schemas["Parent"]["properties"])
    assert sample["evidence"] and set(sample["evidence"][0]) <= set(
        schemas["Evidence"]["properties"]
    )


def test_healthz_flags_an_embedding_model_mismatch(fixture_url: str, embedder: Any) -> None:
    with psycopg.connect(fixture_url, autocommit=True) as conn:
        conn.execute("UPDATE memory.embedding_model SET model = 'another-384-dim-model'")
    env = {"POIMEN_DATABASE_URL": fixture_url}
    with LoopbackClient(create_app(Settings.from_env(env), embedder=embedder)) as client:
        body = client.get("/healthz").json()
    assert body["checks"]["embedder"]["ok"] is False
    assert body["checks"]["embedder"]["error"] == "model_mismatch"
    assert body["checks"]["embedder"]["database_model"] == "another-384-dim-model"


def test_unknown_route_and_method_answer_in_json(client: TestClient) -> None:
    error(client.get("/nope"), 404, "not_found")
    error(client.delete("/memory/query"), 405, "method_not_allowed")


def test_a_request_for_another_host_is_refused(
    client: TestClient, fixture_url: str, embedder: LocalEmbedder
) -> None:
    """DNS rebinding: a web page that reaches a loopback server sends its own name as Host.
    By default only loopback names are answered (POIMEN_HTTP_ALLOWED_HOSTS), on every route
    (/mcp against POIMEN_MCP_ALLOWED_HOSTS), each name compared whole."""
    for host in ("127.0.0.1", "127.0.0.1:8765", "localhost:80", "[::1]:8000", "LOCALHOST"):
        r = client.get("/memory/query", params={"query": KONG}, headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    for host in ("evil.example", "evil.example:8765", "testserver", "127.0.0.1.evil.example",
                 "localhost:80x", "127.0.0.1:58422@evil.com", "",
                 "127.0.0.1:\u00b2"):  # a superscript two: isdigit() said a port  # fmt: skip
        sent = {"Host": host.encode("latin-1")}  # as the bytes arrive (HTTP is latin-1)
        for path in ("/healthz", "/mcp"):
            if path == "/mcp":
                r = client.post(path, json={}, headers=sent)
            else:
                r = client.get(path, headers=sent)
            body = error(r, 421, "misdirected_request")
            if host.isascii():
                assert body["detail"] == f"this service does not answer to Host {host!r}"
            assert "POIMEN_HTTP_ALLOWED_HOSTS" in body["hint"]
    listed = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_ALLOWED_HOSTS": "memory.internal:*"}
    with LoopbackClient(make_app(listed, embedder), base_url="http://memory.internal:8000") as c:
        assert c.get("/openapi.json").status_code == 200
        error(c.get("/openapi.json", headers={"Host": "127.0.0.1"}), 421, "misdirected_request")
    anyone = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_ALLOWED_HOSTS": "*"}
    with LoopbackClient(make_app(anyone, embedder), base_url="http://testserver") as c:
        assert c.get("/openapi.json").status_code == 200
    with pytest.raises(ConfigError, match="POIMEN_HTTP_ALLOWED_HOSTS"):
        Settings.from_env({"POIMEN_HTTP_ALLOWED_HOSTS": "a,*"})
    # The spec says so for every operation.
    spec = client.get("/openapi.json").json()
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            assert "421" in operation["responses"], (path, method)
            # and a head that gives a header twice (api/asgi.py SINGLE_HEADERS)
            assert "duplicate_header" in operation["responses"]["400"]["description"]


def test_every_response_says_what_it_is_and_may_not_be_framed(client: TestClient) -> None:
    """Every response forbids type sniffing and framing: answers, errors (a route's, a
    middleware's) and the explorer's files, which keep the page's own policy."""
    from poimen_memory.api.ui import CSP

    api = "default-src 'none'; frame-ancestors 'none'"
    for r, policy in (
        (client.get("/memory/query", params={"query": KONG}), api),
        (client.get("/memory/query"), api),  # 400 from the route
        (client.get("/nope"), api),
        (client.get("/healthz", headers={"Host": "evil.example"}), api),  # 421, a middleware's
        (client.get("/openapi.json"), api),
        (client.get("/ui"), CSP),
        (client.get("/ui/static/explorer.js"), CSP),
        (client.get("/ui/static/explorer.css"), CSP),
    ):
        assert r.headers["x-content-type-options"] == "nosniff", r.url
        assert r.headers.get_list("content-security-policy") == [policy], r.url


NODE = {"id": "cross-site", "level": "L1", "project": "poimen", "text": "planted"}


@pytest.mark.parametrize(
    "origin",
    ["http://evil.example", "null", "http://127.0.0.1:8765@evil.example",
     "http://127.0.0.1.evil.example", "*", "http://127.0.0.1:80x"],
)  # fmt: skip
def test_a_page_of_another_origin_is_refused(client: TestClient, origin: str) -> None:
    """A browser names the page's origin: another site's is refused on every route, before
    a body is read (a write included), compared whole."""
    r = client.post("/memory/nodes", json=[NODE], headers={"Origin": origin})
    body = error(r, 403, "cross_origin_refused")
    assert "POIMEN_HTTP_ALLOWED_ORIGINS" in body["hint"]
    error(client.get("/memory/query", params={"query": KONG}, headers={"Origin": origin}), 403,
          "cross_origin_refused")  # fmt: skip
    assert client.get("/memory/nodes/cross-site", params={"project": "poimen"}).status_code == 404


def test_the_pages_own_origin_and_loopback_pages_are_served(client: TestClient) -> None:
    own = client.get(
        "/memory/query", params={"query": KONG}, headers={"Origin": "http://127.0.0.1"}
    )
    assert own.status_code == 200, own.text
    local = {"Origin": "http://localhost:3000"}
    assert client.get("/memory/query", params={"query": KONG}, headers=local).status_code == 200
    # CORS is off: nothing tells a browser another origin may read the answer.
    assert "access-control-allow-origin" not in own.headers
    pre = client.options(
        "/memory/nodes", headers={**local, "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in pre.headers


def test_cors_is_answered_for_the_origins_listed_alone(
    fixture_url: str, embedder: LocalEmbedder
) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_CORS_ORIGINS": "https://app.example"}
    with LoopbackClient(make_app(env, embedder)) as c:
        ask = {"Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type"}  # fmt: skip
        listed = c.options("/memory/nodes", headers={"Origin": "https://app.example", **ask})
        assert listed.headers["access-control-allow-origin"] == "https://app.example"
        other = c.options("/memory/nodes", headers={"Origin": "https://other.example", **ask})
        error(other, 403, "cross_origin_refused")
        read = c.get("/memory/query", params={"query": KONG},
                     headers={"Origin": "https://app.example"})  # fmt: skip
        assert read.status_code == 200
        assert read.headers["access-control-allow-origin"] == "https://app.example"
    with pytest.raises(ConfigError, match="POIMEN_HTTP_CORS_ORIGINS"):
        Settings.from_env({"POIMEN_HTTP_CORS_ORIGINS": "*"})


@pytest.mark.parametrize(
    "kind", ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
             "multipart/form-data; boundary=x"],
)  # fmt: skip
def test_a_write_in_a_form_type_is_415(client: TestClient, kind: str) -> None:
    """The bodies a browser sends across origins without a preflight are no write's."""
    r = client.post("/memory/nodes", content=json.dumps([NODE]), headers={"Content-Type": kind})
    body = error(r, 415, "unsupported_media_type")
    assert "application/json" in body["hint"]
    assert client.get("/memory/nodes/cross-site", params={"project": "poimen"}).status_code == 404


@pytest.mark.parametrize("coding", ["gzip", "GZIP", "deflate", "br", "identity, gzip"])
def test_a_compressed_body_is_415_on_every_route_that_reads_one(
    client: TestClient, coding: str
) -> None:
    """No route decodes a Content-Encoding (api/body.read_body): a compressed body is refused
    unread with 415 and Accept-Encoding: identity (RFC 9110 15.5.16), not parsed as its
    compressed bytes, and nothing is written. Uncompressed, as "identity" or with no header,
    the same write goes through."""
    node = {**NODE, "id": "compressed"}
    packed = gzip.compress(json.dumps([node]).encode())
    posts = {
        "/memory/nodes": packed,
        "/memory/review/claim": gzip.compress(b'{"project": "poimen"}'),
        "/memory/review/1/confirm": gzip.compress(b"{}"),
        "/mcp": gzip.compress(b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'),
    }
    for path, content in posts.items():
        r = client.post(path, content=content, headers={
            "Content-Type": "application/json", "Content-Encoding": coding,
            "Accept": "application/json, text/event-stream",
        })  # fmt: skip
        body = error(r, 415, "unsupported_media_type")
        assert r.headers["accept-encoding"] == "identity", path
        assert body["detail"] == (
            f"a request body with Content-Encoding {coding.split(', ')[-1].lower()!r} is not taken"
        )
        assert "uncompressed" in body["hint"]
    assert client.get("/memory/nodes/compressed", params={"project": "poimen"}).status_code == 404
    written = [
        client.post(
            "/memory/nodes",
            content=json.dumps([node]),
            headers={"Content-Type": "application/json", **plain},
        ).json()
        for plain in ({"Content-Encoding": "identity"}, {})
    ]
    assert [w["nodes"][0]["status"] for w in written] == ["created", "unchanged"], written
    assert client.get("/memory/nodes/compressed", params={"project": "poimen"}).status_code == 200
    # The spec says so for every operation that takes a body.
    for item in client.get("/openapi.json").json()["paths"].values():
        for operation in item.values():
            if "requestBody" in operation:
                assert "Content-Encoding" in operation["responses"]["415"]["description"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_rejected(client: TestClient, value: str) -> None:
    body = error(client.get("/memory/query", params={"query": "kong", "timeout_seconds": value}),
                 400, "invalid_parameter")  # fmt: skip
    assert "finite" in body["detail"]


@pytest.mark.parametrize(
    ("node", "field"),
    [
        ({"level": "L0", "project": "bad name!", "text": "t"}, "project"),
        ({"level": "L0", "project": "poimen", "text": "nul \u0000 inside"}, "<json>"),
        ({"level": "L0", "project": "poimen", "text": "t", "id": True}, "id"),
    ],
)
def test_post_nodes_rejects_what_postgres_cannot_store(
    client: TestClient, node: dict[str, Any], field: str
) -> None:
    body = error(client.post("/memory/nodes", content=json.dumps([node])), 400, "invalid_node")
    assert f"field '{field}'" in body.get("context", "")


def test_an_unmigrated_database_says_so(empty_url: str, embedder: LocalEmbedder) -> None:
    with LoopbackClient(make_app({"POIMEN_DATABASE_URL": empty_url}, embedder)) as client:
        response = client.get("/memory/query", params={"query": KONG})
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error"] == "not_migrated" and "poimen-memory migrate" in body["hint"]


def test_healthz_names_an_unmigrated_database(
    cluster: Any, admin: psycopg.Connection[Any], embedder: LocalEmbedder
) -> None:
    """A database without the memory schema: /healthz says not_migrated with the command
    that fixes it, as a query does (the SQLSTATE table), not the driver's class name."""
    admin.execute("DROP DATABASE IF EXISTS t_unmigrated WITH (FORCE)")
    admin.execute("CREATE DATABASE t_unmigrated")
    try:
        env = {"POIMEN_DATABASE_URL": cluster.url("t_unmigrated")}
        with LoopbackClient(make_app(env, embedder)) as c:
            r = c.get("/healthz")
            assert r.status_code == 503 and r.json()["down"] == ["database"], r.text
            assert r.json()["checks"]["database"] == {
                "ok": False,
                "error": "not_migrated",
                "sqlstate": "42P01",
                "hint": "run `poimen-memory migrate` against this database",
            }
            error(c.get("/memory/query", params={"query": KONG}), 503, "not_migrated")
    finally:
        admin.execute("DROP DATABASE IF EXISTS t_unmigrated WITH (FORCE)")
