"""memory.embed: the service's model inside PostgreSQL (PL/Python, packages installed by
`make setup` for the server's own Python), and memory_query() embedding text by itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import psycopg
import pytest

from conftest import prepare_conn
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder

Conn = psycopg.Connection[Any]

TEXTS = [
    "why did requests over 10KB fail",
    "Kong body buffer",
    "a longer passage " * 200,  # truncated at 256 tokens on both sides
    "émigré naïve café — 東京",
]


def _vector(conn: Conn, text: str) -> np.ndarray[Any, Any]:
    row = conn.execute("SELECT memory.embed(%s)", (text,)).fetchone()
    assert row is not None
    return np.asarray(row[0].to_numpy(), dtype=np.float32)


def test_sql_and_the_service_embed_alike(conn: Conn, embedder: LocalEmbedder) -> None:
    for text in TEXTS:
        sql_vec = _vector(conn, text)
        svc_vec = embedder.embed_query(text)
        assert sql_vec.shape == (384,)
        cosine = float(sql_vec @ svc_vec / np.linalg.norm(sql_vec) / np.linalg.norm(svc_vec))
        assert cosine >= 0.9999, (text, cosine)
    assert conn.execute("SELECT memory.embed(NULL)").fetchone() == (None,)


def test_the_model_is_loaded_once_per_backend(conn: Conn) -> None:
    """The first call stores the loaded model in PL/Python's GD; later calls reuse it (the
    object's id stays the same) instead of loading the model again."""
    probe = """
        CREATE FUNCTION pg_temp.poimen_model_id() RETURNS text LANGUAGE plpython3u AS $$
        m = GD.get("poimen_minilm")
        return None if m is None else str(id(m[1]))
        $$"""
    conn.execute(probe)
    assert conn.execute("SELECT pg_temp.poimen_model_id()").fetchone() == (None,)
    _vector(conn, "first")
    first = conn.execute("SELECT pg_temp.poimen_model_id()").fetchone()
    _vector(conn, "second")
    assert first is not None and first[0] is not None
    assert conn.execute("SELECT pg_temp.poimen_model_id()").fetchone() == first


@pytest.mark.parametrize("deps", ["missing", "empty"])
def test_a_host_without_the_packages_gets_a_sqlstate_and_a_hint(
    fixture_url: str, tmp_path: Any, deps: str
) -> None:
    with connect(fixture_url, autocommit=True) as conn:
        if deps == "missing":
            conn.execute("DELETE FROM memory.config WHERE key = 'plpython_deps'")
        else:  # installed for another host: the directory has no packages for this Python
            tmp_path.chmod(0o755)
            conn.execute(
                "UPDATE memory.config SET value = %s WHERE key = 'plpython_deps'", (str(tmp_path),)
            )
    with connect(fixture_url, autocommit=True) as conn:
        prepare_conn(conn)
        with pytest.raises(psycopg.Error) as exc:
            conn.execute("SELECT memory.embed('kong')")
        assert exc.value.sqlstate == "PM503"
        assert "make setup" in (exc.value.diag.message_hint or "")
        assert exc.value.diag.message_detail
        # memory_query still answers, lexically, and says why in a NOTICE.
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        rows = conn.execute(
            "SELECT search_strategy, query_score FROM public.memory_query("
            "'why did requests over 10KB fail', project => 'poimen')"
        ).fetchall()
        assert rows and {r[0] for r in rows} == {"LexicalOnly"}
        assert {r[1] for r in rows} == {None}
        assert any("no query embedding" in n for n in notices), notices


def test_memory_query_embeds_text_in_the_database(conn: Conn) -> None:
    """The issue's acceptance query: no vector from the client, a hybrid answer back."""
    rows = conn.execute(
        "SELECT search_strategy, query_score, semantic_rank"
        " FROM public.memory_query('why did requests over 10KB fail', project => 'poimen')"
    ).fetchall()
    assert rows
    assert {r[0] for r in rows} <= {"Hybrid", "LexicalFirst"}
    assert all(r[1] is not None for r in rows)
    assert any(r[2] is not None for r in rows)


def test_a_forced_lexical_query_does_not_embed(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT search_strategy, query_score FROM public.memory_query("
        "'why did requests over 10KB fail', project => 'poimen', strategy => 'LexicalOnly')"
    ).fetchall()
    assert rows and {(r[0], r[1]) for r in rows} == {("LexicalOnly", None)}


def _backend(conn: Conn) -> dict[str, str]:
    """/proc/<pid>/status of the connection's backend (the cluster runs on this host)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    with open(f"/proc/{row[0]}/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def test_a_backend_embeds_on_one_thread_unless_the_dba_says_otherwise(conn: Conn) -> None:
    """Each backend that embeds holds its own model: at max_connections 100 its threads and
    memory multiply (docs/embeddings.md). One intra-op thread by default, and no tokenizer
    thread pool; poimen.embed_threads raises it per database or role."""
    _vector(conn, "first")
    assert int(_backend(conn)["Threads"]) == 1
    probe = """
        CREATE FUNCTION pg_temp.poimen_intra_op() RETURNS int LANGUAGE plpython3u AS $$
        return GD["poimen_minilm"][1].session.get_session_options().intra_op_num_threads
        $$"""
    conn.execute(probe)
    assert conn.execute("SELECT pg_temp.poimen_intra_op()").fetchone() == (1,)
    conn.execute("SET poimen.embed_threads = 2")
    _vector(conn, "second")
    assert conn.execute("SELECT pg_temp.poimen_intra_op()").fetchone() == (2,)
    # and a short text runs on them too: a backend holds one session, not the service's
    # second one-thread session for short runs (another 100 MB per connection)
    conn.execute("""
        CREATE FUNCTION pg_temp.poimen_sessions() RETURNS boolean LANGUAGE plpython3u AS $$
        m = GD["poimen_minilm"][1]
        return m.session_for(1) is m.session
        $$""")
    assert conn.execute("SELECT pg_temp.poimen_sessions()").fetchone() == (True,)
    for bad in ("0", "lots", "100000"):
        conn.execute(psycopg.sql.SQL("SET poimen.embed_threads = {}").format(bad))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"poimen\.embed_threads"):
            _vector(conn, "third")
        conn.rollback()


def test_a_huge_argument_is_read_only_as_far_as_the_model_reads(conn: Conn) -> None:
    """repeat('adoption ', 1200000) once tokenized 10.8 MB for 39 s, past any
    statement_timeout: the model reads 256 tokens, so the tokenizer reads 100,000 characters."""
    huge = _vector(conn, "adoption " * 1_200_000)
    assert np.array_equal(huge, _vector(conn, ("adoption " * 1_200_000)[:100_000]))
    assert np.array_equal(huge, _vector(conn, "adoption " * 300))  # past 256 tokens either way


def test_loading_the_model_writes_nothing_to_the_server_log(conn: Conn, cluster: Cluster) -> None:
    """onnxruntime's telemetry logged an ANSI-coloured warning from every new backend whose
    home directory is not writable (the postgres user's, on the embedded cluster)."""
    row = conn.execute("SELECT pg_current_logfile()").fetchone()
    assert row is not None and row[0]
    log = cluster.data_dir / row[0]
    size = log.stat().st_size
    with connect(conn.info.dsn) as fresh:
        _vector(fresh, "a new backend loads the model")
    with log.open("rb") as fh:
        fh.seek(size)
        assert b"onnxruntime" not in fh.read()
