"""RerankClient against a real HTTP double (tests/doubles/rerank_server.py)."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from doubles.rerank_server import RerankServer, run_rerank_server, word_overlap
from poimen_memory.errors import ConfigError
from poimen_memory.settings import Settings
from poimen_memory.upstreams.clients import endpoint_candidates
from poimen_memory.upstreams.rerank import (
    RerankClient,
    RerankResult,
    RerankUnavailable,
    build_reranker,
    detect_scale,
    normalise_scores,
)

QUERY = "red apple pie recipe"
DOCS = [
    "a recipe for blueberry muffins",  # 1/4 of the query's words
    "red apple pie recipe with cinnamon",  # 4/4
    "stock market news",  # 0/4
    "apple pie recipe",  # 3/4
    "red cars",  # 1/4
]
EXPECTED_ORDER = [1, 3, 0, 4, 2]  # ties (0 and 4) keep document order


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def shared_server() -> Iterator[RerankServer]:
    with run_rerank_server() as server:
        yield server


@pytest.fixture
def server(shared_server: RerankServer) -> RerankServer:
    """The module's rerank double with default knobs and an empty request log."""
    shared_server.reset()
    return shared_server


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def rerank(url: str, top_n: int | None = None, **client: Any) -> list[RerankResult]:
    reranker = RerankClient(url, **client)
    try:
        return await reranker.arerank(QUERY, DOCS, top_n=top_n, timeout=5)
    finally:
        await reranker.aclose()


@pytest.mark.anyio
async def test_cohere_dialect_request_and_result(server: RerankServer) -> None:
    results = await rerank(server.url, top_n=3, model="bge-reranker-v2-m3", api_key="k")
    request = server.requests[0]
    assert request.path == "/v1/rerank"
    assert request.body == {
        "model": "bge-reranker-v2-m3",
        "query": QUERY,
        "documents": DOCS,
        "top_n": 3,
    }
    assert request.headers["authorization"] == "Bearer k"
    assert [r.index for r in results] == EXPECTED_ORDER[:3]
    assert [r.score for r in results] == [1.0, 0.75, 0.25]


@pytest.mark.anyio
async def test_tei_dialect_request_and_client_side_top_n(server: RerankServer) -> None:
    server.reset(response_shape="array", score_field="score")
    results = await rerank(server.url + "/rerank", top_n=2, dialect="tei")
    request = server.requests[0]
    assert request.path == "/rerank"
    assert server.dialect_of(request) == "tei"
    assert request.body == {"query": QUERY, "texts": DOCS, "raw_scores": False, "truncate": True}
    assert [r.index for r in results] == EXPECTED_ORDER[:2]


@pytest.mark.anyio
@pytest.mark.parametrize("shape", ["results", "data", "array"])
@pytest.mark.parametrize("score_field", ["relevance_score", "score"])
@pytest.mark.parametrize("document_mode", ["absent", "string", "object"])
@pytest.mark.parametrize("order", ["desc", "input", "shuffled"])
async def test_every_response_shape_joins_back_by_index(
    server: RerankServer, shape: str, score_field: str, document_mode: str, order: str
) -> None:
    server.reset(
        response_shape=shape, score_field=score_field, document_mode=document_mode, order=order
    )
    results = await rerank(server.url)
    assert [r.index for r in results] == EXPECTED_ORDER
    for r in results:
        assert r.score == pytest.approx(word_overlap(QUERY, DOCS[r.index]))


@pytest.mark.anyio
@pytest.mark.parametrize("configured", ["auto", "unit", "percent", "logit"])
@pytest.mark.parametrize("served", ["unit", "percent", "logit"])
async def test_score_scales(server: RerankServer, configured: str, served: str) -> None:
    server.reset(score_scale=served)
    reranker = RerankClient(server.url, score_scale=configured)  # type: ignore[arg-type]
    try:
        results = await reranker.arerank(QUERY, DOCS, timeout=5)
    finally:
        await reranker.aclose()
    applied = served if configured == "auto" else configured
    assert reranker.last_scale == applied
    for r in results:
        assert 0.0 <= r.score <= 1.0
        assert r.raw_score == pytest.approx(server.raw_score(QUERY, DOCS[r.index]))
        if applied == served:  # the right scale recovers the server's meaning
            relevance = word_overlap(QUERY, DOCS[r.index])
            expected = sigmoid(10 * (relevance - 0.5)) if served == "logit" else relevance
            assert r.score == pytest.approx(expected)
    scores = [r.score for r in results]
    assert scores == sorted(scores, reverse=True)
    if applied == served:
        assert [r.index for r in results] == EXPECTED_ORDER


@pytest.mark.parametrize(
    ("raw", "scale"),
    [
        ([0.0, 0.5, 1.0], "unit"),
        ([0.9], "unit"),
        ([0.5, 42.0, 100.0], "percent"),
        ([1.5, 3.0], "percent"),  # positive logits read as percent: documented ambiguity
        ([-2.0, 0.3, 1.5], "logit"),
        ([12.0, 150.0], "logit"),
    ],
)
def test_scale_auto_detection(raw: list[float], scale: str) -> None:
    assert detect_scale(raw) == scale


def test_normalisation_values() -> None:
    assert normalise_scores([0.2, 1.0000001], "unit") == ([0.2, 1.0], "unit")
    assert normalise_scores([87.5, 3.0], "auto") == ([0.875, 0.03], "percent")
    scores, scale = normalise_scores([-1000.0, 0.0, 1000.0])
    assert (scores, scale) == ([0.0, 0.5, 1.0], "logit")


@pytest.mark.anyio
async def test_auto_detects_from_the_whole_batch(server: RerankServer) -> None:
    # Mixed magnitudes: one negative makes the whole batch logits.
    server.reset(scores=[2.0, -1.0, 0.5, 0.0, 4.0])
    results = await rerank(server.url)
    assert [r.index for r in results] == [4, 0, 2, 3, 1]
    assert results[0].score == pytest.approx(sigmoid(4.0))
    assert results[-1].score == pytest.approx(sigmoid(-1.0))


@pytest.mark.anyio
async def test_timeout_raises_quickly(server: RerankServer) -> None:
    server.reset(delay_s=5)
    reranker = RerankClient(server.url, timeout_s=30)
    started = time.monotonic()
    try:
        with pytest.raises(RerankUnavailable) as info:
            await reranker.arerank(QUERY, DOCS, timeout=0.2)
    finally:
        await reranker.aclose()
    elapsed = time.monotonic() - started
    assert info.value.reason == "timeout"
    assert elapsed < 3.0  # the 0.2 s timeout, not the 5 s delay


@pytest.mark.anyio
async def test_configured_timeout_is_the_default(server: RerankServer) -> None:
    server.reset(delay_s=5)
    reranker = RerankClient(server.url, timeout_s=0.2)
    try:
        with pytest.raises(RerankUnavailable, match=r"0\.2s"):
            await reranker.arerank(QUERY, DOCS)
    finally:
        await reranker.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("knobs", "reason"),
    [
        ({"fail_status": 500}, "http_status"),
        ({"fail_status": 429}, "http_status"),
        ({"api_key": "needed"}, "http_status"),
        ({"malformed": True}, "bad_response"),
        ({"index_offset": 10}, "bad_response"),
        ({"scores": [float("nan")] * 5}, "bad_response"),
    ],
)
async def test_failures_raise_rerank_unavailable(
    server: RerankServer, knobs: dict[str, Any], reason: str
) -> None:
    server.reset(**knobs)
    with pytest.raises(RerankUnavailable) as info:
        await rerank(server.url)
    assert info.value.reason == reason
    assert len(server.requests) == 1  # no retries: rerank is on the query path


@pytest.mark.anyio
async def test_unreachable_server() -> None:
    with pytest.raises(RerankUnavailable) as info:
        await rerank(f"http://127.0.0.1:{unused_port()}")
    assert info.value.reason == "transport"


@pytest.mark.anyio
async def test_no_documents_means_no_call(server: RerankServer) -> None:
    reranker = RerankClient(server.url)
    try:
        assert await reranker.arerank(QUERY, [], top_n=3) == []
    finally:
        await reranker.aclose()
    assert server.requests == []


@pytest.mark.anyio
async def test_shared_client_is_left_open(server: RerankServer) -> None:
    async with httpx.AsyncClient() as shared:
        reranker = build_reranker(
            Settings.from_env({"POIMEN_RERANK_URL": server.url}).rerank, client=shared
        )
        assert reranker is not None
        await reranker.arerank(QUERY, DOCS)
        await reranker.aclose()
        assert not shared.is_closed


@pytest.mark.parametrize(
    ("given", "endpoints"),
    [
        ("http://h:7997", ["http://h:7997/v1/rerank", "http://h:7997/rerank"]),
        ("http://h:7997/", ["http://h:7997/v1/rerank", "http://h:7997/rerank"]),
        ("http://h:7997/v1", ["http://h:7997/v1/rerank"]),
        ("http://h:8080/rerank", ["http://h:8080/rerank"]),
        ("http://h/v1/rerank/", ["http://h/v1/rerank"]),
    ],
)
def test_endpoint_rules(given: str, endpoints: list[str]) -> None:
    assert endpoint_candidates(given, "rerank") == endpoints


def test_factory_and_env() -> None:
    assert build_reranker(Settings.from_env({}).rerank) is None
    assert build_reranker(Settings.from_env({"POIMEN_RERANK_URL": "  "}).rerank) is None
    env = {
        "POIMEN_RERANK_URL": "http://h:8080/rerank",
        "POIMEN_RERANK_MODEL": "m",
        "POIMEN_RERANK_DIALECT": "TEI",
        "POIMEN_RERANK_SCORE_SCALE": "percent",
        "POIMEN_RERANK_TIMEOUT_S": "1.5",
    }
    reranker = build_reranker(Settings.from_env(env).rerank)
    assert reranker is not None
    assert (reranker.endpoint, reranker.model, reranker.dialect) == (
        "http://h:8080/rerank",
        "m",
        "tei",
    )
    assert (reranker.score_scale, reranker.timeout_s) == ("percent", 1.5)
    with pytest.raises(ConfigError, match="DIALECT"):
        build_reranker(Settings.from_env({**env, "POIMEN_RERANK_DIALECT": "openai"}).rerank)
    with pytest.raises(ConfigError, match="SCORE_SCALE"):
        build_reranker(Settings.from_env({**env, "POIMEN_RERANK_SCORE_SCALE": "zscore"}).rerank)
