"""OpenAI-compatible ``/v1/embeddings`` rules shared by the service and PostgreSQL.

Stdlib only, because PL/Python imports it inside the database. The service's
RemoteEmbedder (httpx) and memory.embed (urllib, below) take the endpoint rule and the
instruction prefixes from here, so a text embedded by either side reaches the same URL
with the same input and gets the same vector.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

from poimen_core.plentry import PlpyLike
from poimen_core.vocabulary import SQLSTATES

__all__ = [
    "EMBEDDING_MODEL_MISMATCH",
    "EMBEDDING_SERVER_UNAVAILABLE",
    "MODEL_PREFIXES",
    "ModelPrefixes",
    "embed_remote",
    "endpoint_candidates",
    "prefixes_for_model",
]

EMBEDDING_SERVER_UNAVAILABLE = SQLSTATES["component_unavailable"]
EMBEDDING_MODEL_MISMATCH = SQLSTATES["embedding_model_mismatch"]
_HINT = (
    "Check that the server named by memory.configure_embedding_server answers, or go back "
    "to the local model with memory.clear_embedding_server(); or pass query_embedding."
)
# A 2000-dim float list is about 50 KB of JSON: anything far bigger is not an answer.
_MAX_BODY = 8 << 20
_CHUNK = 64 << 10
_ENDPOINT_KEY = "poimen_embedding_endpoint"


def shown_url(url: str) -> str:
    """A URL as messages, /healthz and logs show it: without its user and password and its
    query string, where a token may travel (an error body once carried both to anyone who
    could reach /healthz)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc and not parts.query and not parts.fragment:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def endpoint_candidates(url: str, route: str) -> list[str]:
    """The endpoints to try for a configured URL, for ``route`` ("embeddings", "rerank"): a
    URL ending in ``/<route>`` as given; ``…/v1`` plus ``/<route>``; for a base URL the
    OpenAI-style ``/v1/<route>`` first, then ``/<route>`` at the root, where Infinity and TEI
    answer. The caller keeps the first that does not answer 404. ValueError names the URL
    when it is not http(s)."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"{route} URL {shown_url(url)!r} must start with http:// or https://")
    if base.endswith("/" + route):
        return [base]
    if base.endswith("/v1"):
        return [f"{base}/{route}"]
    return [f"{base}/v1/{route}", f"{base}/{route}"]


@dataclass(frozen=True, slots=True)
class ModelPrefixes:
    query: str
    document: str


_NO_PREFIXES = ModelPrefixes("", "")
_BGE_QUERY = "Represent this sentence for searching relevant passages: "

MODEL_PREFIXES: tuple[tuple[str, ModelPrefixes], ...] = (
    ("*nomic-embed-text*", ModelPrefixes("search_query: ", "search_document: ")),
    ("*multilingual-e5-*instruct*", _NO_PREFIXES),
    ("*e5-*", ModelPrefixes("query: ", "passage: ")),
    ("*bge-*-en-v1.5*", ModelPrefixes(_BGE_QUERY, "")),
    ("*mxbai-embed-large*", ModelPrefixes(_BGE_QUERY, "")),
)
"""Instruction prefixes the model was trained with, matched in order as shell patterns
against the lower-cased model name (so ``nomic-ai/…``, ``nomic-embed-text:latest``
and GGUF file names all match). Models not listed get no prefix. The instruct e5
variants need a task-specific ``Instruct: …\\nQuery: `` prompt, so they get none
here and must be configured by hand."""


def prefixes_for_model(model: str) -> ModelPrefixes:
    name = model.lower()
    for pattern, prefixes in MODEL_PREFIXES:
        if fnmatchcase(name, pattern):
            return prefixes
    return _NO_PREFIXES


def _unavailable(plpy: PlpyLike, msg: str, detail: str) -> NoReturn:
    plpy.error(msg, detail=detail, hint=_HINT, sqlstate=EMBEDDING_SERVER_UNAVAILABLE)


def _post(
    plpy: PlpyLike, endpoint: str, body: bytes, deadline: float, timeout_s: float
) -> tuple[int, bytes]:
    """One POST; returns the HTTP status and the body, or raises PM503 naming ``endpoint``
    when there is no HTTP answer within the time left before ``deadline``."""
    request = urllib.request.Request(
        endpoint, data=body, method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )  # fmt: skip
    server = f"embedding server {shown_url(endpoint)}"
    late = f"{server} did not answer within {timeout_s:.3g}s"
    try:
        # urllib's timeout bounds each socket wait (here: by the time left), not the call;
        # the deadline check between chunks stops a server that trickles bytes, so a call
        # ends within about twice timeout_s. It must: PostgreSQL cannot cancel a backend
        # blocked in a socket call (statement_timeout waits for it).
        with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 1e-3)) as r:
            status, chunks, size = r.status, [], 0
            while chunk := r.read(_CHUNK):
                size += len(chunk)
                if size > _MAX_BODY:
                    _unavailable(plpy, f"{server} answered over 8 MiB",
                                 f"{size} bytes read")  # fmt: skip
                if time.monotonic() > deadline:
                    _unavailable(plpy, late, "the answer was still arriving at the deadline")
                chunks.append(chunk)
            return status, b"".join(chunks)
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the open response
            return exc.code, exc.read(200)
    except TimeoutError as exc:
        _unavailable(plpy, late, repr(exc))
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            _unavailable(plpy, late, repr(reason))
        _unavailable(plpy, f"{server} unreachable", repr(reason))


def decode_embedding(embedding: object) -> list[float]:
    """One item's `embedding`: a list of numbers, or base64 little-endian float32 (as
    `encoding_format=base64` returns); ValueError otherwise. The service decodes with it too."""
    if isinstance(embedding, str):
        try:
            raw = base64.b64decode(embedding, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"bad base64 embedding: {exc}") from exc
        if len(raw) % 4:
            raise ValueError("base64 embedding is not a whole number of float32s")
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if isinstance(embedding, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in embedding
    ):
        return [float(x) for x in embedding]
    raise ValueError(f"embedding is a {type(embedding).__name__}, not a list of numbers")


def _float32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def embed_remote(
    plpy: PlpyLike,
    gd: dict[str, Any],
    text: str,
    *,
    url: str,
    model: str,
    dim: int,
    timeout_s: float,
) -> str:
    """The text's query vector from the OpenAI-compatible server at ``url`` in pgvector's
    input format: the model's query prefix (as RemoteEmbedder.embed_query adds it), float32
    components and L2 normalisation (as the service's l2_normalise), so both sides store
    and compare the same vector."""
    try:
        candidates = endpoint_candidates(url, "embeddings")
    except ValueError as exc:
        _unavailable(plpy, f"embedding server URL {shown_url(url)} is not usable", str(exc))
    # After a 404 from the guessed /v1 path the endpoint that answered is kept for this
    # backend, as the service keeps it, so later calls make one request, not two.
    cached = gd.get(_ENDPOINT_KEY)
    if cached is not None and cached[0] == url and cached[1] in candidates:
        candidates = candidates[candidates.index(cached[1]) :]
    body = json.dumps({"input": [prefixes_for_model(model).query + text], "model": model})
    deadline = time.monotonic() + timeout_s
    for at, endpoint in enumerate(candidates):
        status, raw = _post(plpy, endpoint, body.encode(), deadline, timeout_s)
        if status == 404 and at + 1 < len(candidates):
            continue
        break
    server = f"embedding server {shown_url(endpoint)}"
    if not 200 <= status < 300:
        _unavailable(plpy, f"{server} answered {status}",
                     raw[:200].decode("utf-8", "replace"))  # fmt: skip
    gd[_ENDPOINT_KEY] = (url, endpoint)
    try:
        items = json.loads(raw)["data"]
        if not isinstance(items, list) or len(items) != 1:
            raise ValueError(f"expected 1 embedding, got {len(items)}")
        vector = decode_embedding(items[0]["embedding"])
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        _unavailable(plpy, f"{server} sent a malformed answer", str(exc))
    if len(vector) != dim:
        plpy.error(
            f"{server} returned {len(vector)} dims, the database stores {dim}",
            detail=f"model {model}; memory.embedding_model records {dim} dimensions",
            hint="Configure a server that runs the database's model "
            "(memory.configure_embedding_server), or memory.clear_embedding_server().",
            sqlstate=EMBEDDING_MODEL_MISMATCH,
        )
    vector = [_float32(x) for x in vector]
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if not math.isfinite(norm) or norm == 0.0:
        _unavailable(plpy, f"{server} sent an unusable vector",
                     f"its norm is {norm}")  # fmt: skip
    # repr of each float32 (widened to a Python float) reads back to the same float32.
    return "[" + ",".join(repr(_float32(x / norm)) for x in vector) + "]"
