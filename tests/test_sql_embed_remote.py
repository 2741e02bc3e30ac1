"""memory.embed with a remote OpenAI-compatible server named in the database
(memory.configure_embedding_server), against the HTTP double the service's RemoteEmbedder
is tested with (tests/doubles/embedding_server.py): the backend POSTs to it on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pytest

from doubles.embedding_server import EmbeddingServer, run_embedding_server
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.embedders.remote import RemoteEmbedder

Conn = psycopg.Connection[Any]

LOCAL = "all-MiniLM-L6-v2-onnx-int8"  # the fixture database's model (384 dims)
TEXT = "why did requests over 10KB fail"


@pytest.fixture(scope="module")
def double() -> Iterator[EmbeddingServer]:
    with run_embedding_server(dim=384) as server:
        yield server


@pytest.fixture
def server(double: EmbeddingServer) -> EmbeddingServer:
    double.reset(dim=384)
    return double


def _vector(conn: Conn, text: str) -> np.ndarray[Any, Any]:
    row = conn.execute("SELECT memory.embed(%s)", (text,)).fetchone()
    assert row is not None
    return np.asarray(row[0].to_numpy(), dtype=np.float32)


def _service_vector(url: str, model: str, text: str) -> np.ndarray[Any, Any]:
    embedder = RemoteEmbedder(url, model, dim=384)
    try:
        return np.asarray(embedder.embed_query(text), dtype=np.float32)
    finally:
        embedder.close()


def _cosine(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _sql_error(conn: Conn, sql: str, params: tuple[Any, ...] = ()) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(sql, params)
    return exc.value


def _unused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed at once: nothing listens there


def test_a_configured_server_embeds_as_the_service_does(
    conn: Conn, server: EmbeddingServer, embedder: LocalEmbedder
) -> None:
    conn.execute("SELECT memory.configure_embedding_server(%s)", (server.url,))
    sql_vec = _vector(conn, TEXT)
    assert [(r.path, r.body) for r in server.embedding_requests] == [
        ("/v1/embeddings", {"input": [TEXT], "model": LOCAL})
    ]
    assert sql_vec.shape == (384,)
    assert _cosine(sql_vec, _service_vector(server.url, LOCAL, TEXT)) >= 0.9999
    np.testing.assert_allclose(sql_vec, server.vector_for(TEXT), atol=1e-6)
    # The double's hashed words are not MiniLM: the answer did come from the server.
    assert _cosine(sql_vec, embedder.embed_query(TEXT)) < 0.5

    seen = len(server.embedding_requests)  # the backend's and RemoteEmbedder's
    conn.execute("SELECT memory.clear_embedding_server()")
    assert _cosine(_vector(conn, TEXT), embedder.embed_query(TEXT)) >= 0.9999
    assert len(server.embedding_requests) == seen  # the local model answered


def test_the_model_query_prefix_is_the_services(conn: Conn, server: EmbeddingServer) -> None:
    """A nomic database: memory.embed sends the model's query prefix, as embed_query does."""
    nomic = "nomic-ai/nomic-embed-text-v1.5"
    conn.execute("SELECT memory.reset_embedding(%s, 384)", (nomic,))
    conn.execute("SELECT memory.configure_embedding_server(%s, %s)", (server.url, nomic))
    sql_vec = _vector(conn, TEXT)
    assert server.embedding_requests[0].body == {"input": ["search_query: " + TEXT], "model": nomic}
    assert _cosine(sql_vec, _service_vector(server.url, nomic, TEXT)) >= 0.9999


def test_a_root_only_server_is_found_and_kept(conn: Conn, server: EmbeddingServer) -> None:
    """Infinity's layout: /v1/embeddings answers 404, /embeddings answers; the backend then
    keeps /embeddings (one request per call), as the service does."""
    server.reset(dim=384, root_only=True)
    conn.execute("SELECT memory.configure_embedding_server(%s)", (server.url + "/",))
    first = _vector(conn, TEXT)
    _vector(conn, "Kong body buffer")
    assert [r.path for r in server.embedding_requests] == [
        "/v1/embeddings",
        "/embeddings",
        "/embeddings",
    ]
    assert _cosine(first, _service_vector(server.url, LOCAL, TEXT)) >= 0.9999


def test_a_full_endpoint_is_used_as_given_and_base64_is_read(
    conn: Conn, server: EmbeddingServer
) -> None:
    server.reset(dim=384, force_base64=True)
    conn.execute("SELECT memory.configure_embedding_server(%s)", (server.url + "/embeddings",))
    sql_vec = _vector(conn, TEXT)
    assert [r.path for r in server.embedding_requests] == ["/embeddings"]
    np.testing.assert_allclose(sql_vec, server.vector_for(TEXT), atol=1e-6)


def test_memory_query_goes_hybrid_with_the_remote_vector(
    conn: Conn, server: EmbeddingServer
) -> None:
    conn.execute("SELECT memory.configure_embedding_server(%s)", (server.url,))
    rows = conn.execute(
        "SELECT search_strategy, node_id, query_score"
        " FROM public.memory_query(%s, project => 'poimen')",
        (TEXT,),
    ).fetchall()
    assert rows and {r[0] for r in rows} == {"Hybrid"}  # the optimizer's route for TEXT
    assert [r.body["input"] for r in server.embedding_requests] == [[TEXT]]
    # query_score is the cosine to the double's vector (clipped to [0, 1], as every answer
    # reports it): the remote embedding ranked them.
    remote = server.vector_for(TEXT)
    for _strategy, node_id, score in rows:
        stored = conn.execute("SELECT embedding FROM memory.nodes WHERE id = %s", (node_id,))
        row = stored.fetchone()
        assert row is not None
        cosine = _cosine(row[0].to_numpy(), remote)
        assert score == pytest.approx(min(1.0, max(0.0, cosine)), abs=1e-5)


def test_a_server_that_is_down_gets_pm503_naming_its_url(
    conn: Conn, server: EmbeddingServer
) -> None:
    url = _unused_url()
    conn.execute("SELECT memory.configure_embedding_server(%s, timeout_s => 2)", (url,))
    err = _sql_error(conn, "SELECT memory.embed('kong')")
    assert err.sqlstate == "PM503"
    assert f"{url}/v1/embeddings" in (err.diag.message_primary or "")
    assert err.diag.message_detail  # the connection error
    assert "memory.clear_embedding_server" in (err.diag.message_hint or "")
    # memory_query still answers lexically, and says why.
    notices: list[tuple[str, str]] = []
    conn.add_notice_handler(
        lambda d: notices.append((d.message_primary or "", d.message_hint or ""))
    )
    rows = conn.execute(
        "SELECT search_strategy FROM public.memory_query(%s, project => 'poimen')",
        (TEXT,),
    ).fetchall()
    assert rows and {r[0] for r in rows} == {"LexicalOnly"}
    # With the embedder's own hint: here the server, not `make setup`, needs a look.
    assert any(url in n and "memory.clear_embedding_server" in h for n, h in notices), notices


@pytest.mark.parametrize(
    ("knobs", "timeout_s", "message"),
    [
        ({"fail_status": 500}, 10, "answered 500"),
        ({"malformed": True}, 10, "malformed"),
        ({"delay_s": 5.0}, 0.3, "did not answer within 0.3s"),
    ],
)
def test_server_failures_get_pm503_naming_the_endpoint(
    conn: Conn, server: EmbeddingServer, knobs: dict[str, Any], timeout_s: float, message: str
) -> None:
    server.reset(dim=384, **knobs)
    conn.execute("SELECT memory.configure_embedding_server(%s, NULL, %s)", (server.url, timeout_s))
    err = _sql_error(conn, "SELECT memory.embed('kong')")
    assert err.sqlstate == "PM503"
    assert f"{server.endpoint} " in (err.diag.message_primary or "")
    assert message in (err.diag.message_primary or "")


def test_another_dimension_or_model_is_pm409(conn: Conn, server: EmbeddingServer) -> None:
    server.reset(dim=768)
    conn.execute("SELECT memory.configure_embedding_server(%s)", (server.url + "/v1",))
    err = _sql_error(conn, "SELECT memory.embed('kong')")
    assert err.sqlstate == "PM409"
    assert "returned 768 dims, the database stores 384" in (err.diag.message_primary or "")
    other = "SELECT memory.configure_embedding_server(%s, 'text-embedding-3-small')"
    err = _sql_error(conn, other, (server.url,))
    assert err.sqlstate == "PM409"
    # A model switched after the server was configured is caught at the call.
    conn.execute("SELECT memory.configure_embedding_server(%s, %s)", (server.url, LOCAL))
    conn.execute("SELECT memory.reset_embedding('other-model', 384)")
    err = _sql_error(conn, "SELECT memory.embed('kong')")
    assert err.sqlstate == "PM409" and "other-model" in (err.diag.message_primary or "")


@pytest.mark.parametrize(
    ("url", "timeout_s"),
    [
        ("http://user:secret@127.0.0.1:9", 10),
        ("http://127.0.0.1:9/v1?api-key=secret", 10),
        ("ftp://127.0.0.1:9", 10),
        (None, 10),
        ("http://127.0.0.1:9", 0),
        ("http://127.0.0.1:9", float("nan")),
        ("http://127.0.0.1:9", 301),
    ],
)
def test_configuration_is_validated(conn: Conn, url: str | None, timeout_s: float) -> None:
    err = _sql_error(
        conn, "SELECT memory.configure_embedding_server(%s, NULL, %s)", (url, timeout_s)
    )
    assert err.sqlstate == "22023"
    assert conn.execute(
        "SELECT count(*) FROM memory.config WHERE key LIKE 'embedding%%server%%'"
    ).fetchone() == (0,)
