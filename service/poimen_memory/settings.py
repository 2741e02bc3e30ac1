"""Every environment variable the product reads, parsed once (docs/configuration.md).

Each setting is declared exactly once, as ``cfg(key, cast, default)`` in the style of
Starlette's ``Config``: the key, how to read it, and its default. Nothing else in the
product reads ``os.environ``. Retrieval *policy* (fusion, RRF k, dense weight, leg depths)
is not here: it lives in the database (``memory.policy()``), so SQL and HTTP share it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

from poimen_memory.errors import ConfigError

T = TypeVar("T")

# The OpenAI and Infinity limit on inputs per /v1/embeddings request.
MAX_REMOTE_BATCH = 2048


def _default_home() -> Path:
    # The embedded cluster runs as the postgres user, which cannot read /root.
    if os.geteuid() == 0:
        return Path("/var/lib/poimen-memory")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "poimen-memory"


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


class Config:
    """Reads typed values from an environment mapping; blank counts as unset."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @overload
    def __call__(self, key: str, cast: Callable[[str], T], default: T) -> T: ...
    @overload
    def __call__(self, key: str, cast: Callable[[str], T], default: None = None) -> T | None: ...

    def __call__(self, key: str, cast: Callable[[str], Any], default: Any = None) -> Any:
        raw = self.env.get(key)
        if raw is None or raw.strip() == "":
            return default
        try:
            return cast(raw.strip())
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{key}={raw!r}: {exc}") from None

    def raw(self, key: str) -> str | None:
        """The value exactly as given, blanks included (prefixes may be deliberately empty)."""
        return self.env.get(key)


def at_least(lo: float, cast: Callable[[str], T] = int) -> Callable[[str], T]:  # type: ignore[assignment]
    def parse(raw: str) -> T:
        value = cast(raw)
        # `not (value >= lo)` also rejects NaN.
        if not value >= lo:  # type: ignore[operator]
            raise ValueError(f"must be >= {lo:g}")
        return value

    return parse


def within(lo: float, hi: float, cast: Callable[[str], T] = int) -> Callable[[str], T]:  # type: ignore[assignment]
    def parse(raw: str) -> T:
        value = cast(raw)
        if not lo <= value <= hi:  # type: ignore[operator]
            raise ValueError(f"must be within [{lo:g}, {hi:g}]")
        return value

    return parse


def positive(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return value

    return parse


def http_url(raw: str) -> str:
    if not raw.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    return raw


@dataclass(frozen=True)
class EmbeddingSettings:
    """The query/document embedder: remote when ``url`` is set, else the local ONNX model."""

    url: str | None = None
    model: str | None = None
    api_key: str | None = None
    dim: int | None = None
    encoding: str | None = None
    query_prefix: str | None = None
    document_prefix: str | None = None
    timeout_s: float = 10.0
    retries: int = 3
    remote_batch_size: int = 64
    threads: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))
    local_batch_size: int = 16
    cache_size: int = 1024

    @classmethod
    def from_config(cls, cfg: Config) -> EmbeddingSettings:
        d = cls()
        return cls(
            url=cfg("POIMEN_EMBEDDINGS_URL", http_url),
            model=cfg("POIMEN_EMBEDDINGS_MODEL", str),
            api_key=cfg("POIMEN_EMBEDDINGS_API_KEY", str),
            dim=cfg("POIMEN_EMBEDDINGS_DIM", at_least(1)),
            encoding=cfg("POIMEN_EMBEDDINGS_ENCODING", one_of("float", "base64")),
            # Presence, not truthiness: an empty value deliberately turns a prefix off.
            query_prefix=cfg.raw("POIMEN_EMBEDDINGS_QUERY_PREFIX"),
            document_prefix=cfg.raw("POIMEN_EMBEDDINGS_DOCUMENT_PREFIX"),
            timeout_s=cfg("POIMEN_EMBEDDINGS_TIMEOUT_S", positive, d.timeout_s),
            retries=cfg("POIMEN_EMBEDDINGS_RETRIES", at_least(0), d.retries),
            remote_batch_size=cfg(
                "POIMEN_EMBEDDINGS_BATCH_SIZE", within(1, MAX_REMOTE_BATCH), d.remote_batch_size
            ),
            threads=cfg("POIMEN_EMBED_THREADS", at_least(1), d.threads),
            local_batch_size=cfg("POIMEN_EMBED_BATCH_SIZE", at_least(1), d.local_batch_size),
            cache_size=cfg("POIMEN_EMBED_CACHE_SIZE", at_least(0), d.cache_size),
        )


@dataclass(frozen=True)
class RerankSettings:
    url: str | None = None
    model: str | None = None
    api_key: str | None = None
    dialect: str = "cohere"
    score_scale: str = "auto"
    timeout_s: float = 10.0

    @classmethod
    def from_config(cls, cfg: Config) -> RerankSettings:
        d = cls()
        return cls(
            url=cfg("POIMEN_RERANK_URL", http_url),
            model=cfg("POIMEN_RERANK_MODEL", str),
            api_key=cfg("POIMEN_RERANK_API_KEY", str),
            dialect=cfg("POIMEN_RERANK_DIALECT", one_of("tei", "cohere"), d.dialect),
            score_scale=cfg(
                "POIMEN_RERANK_SCORE_SCALE",
                one_of("auto", "unit", "percent", "logit"),
                d.score_scale,
            ),
            timeout_s=cfg("POIMEN_RERANK_TIMEOUT_S", positive, d.timeout_s),
        )


@dataclass(frozen=True)
class OpenSearchSettings:
    url: str | None = None
    index: str = "poimen-memory"
    timeout_s: float = 2.0
    bulk_timeout_s: float = 30.0
    verify_certs: bool = True
    ca_certs: Path | None = None
    sync_batch: int = 500
    max_attempts: int = 5
    backoff_s: float = 0.5

    @classmethod
    def from_config(cls, cfg: Config) -> OpenSearchSettings:
        d = cls()
        return cls(
            url=cfg("POIMEN_OPENSEARCH_URL", http_url),
            index=cfg("POIMEN_OPENSEARCH_INDEX", str, d.index),
            timeout_s=cfg("POIMEN_OPENSEARCH_TIMEOUT_S", positive, d.timeout_s),
            bulk_timeout_s=cfg("POIMEN_OPENSEARCH_BULK_TIMEOUT_S", positive, d.bulk_timeout_s),
            verify_certs=cfg("POIMEN_OPENSEARCH_VERIFY_CERTS", _bool, d.verify_certs),
            ca_certs=cfg("POIMEN_OPENSEARCH_CA_CERTS", Path),
            sync_batch=cfg("POIMEN_OPENSEARCH_SYNC_BATCH", at_least(1), d.sync_batch),
            max_attempts=cfg("POIMEN_OPENSEARCH_MAX_ATTEMPTS", at_least(1), d.max_attempts),
            backoff_s=cfg("POIMEN_OPENSEARCH_BACKOFF_S", at_least(0.0, float), d.backoff_s),
        )


@dataclass(frozen=True)
class Settings:
    database_url: str | None = None
    home: Path = field(default_factory=_default_home)
    pg_port: int = 54329
    pg_data_dir: Path | None = None
    pg_socket_dir: Path | None = None
    pg_bin_dir: Path | None = None
    pool_min: int = 1
    pool_max: int = 8
    max_query_chars: int = 2000
    default_limit: int = 5
    max_limit: int = 50
    default_timeout_s: float = 5.0
    max_timeout_s: float = 30.0
    rerank_depth_factor: int = 3
    rerank_min_remaining_s: float = 0.25
    ingest_batch: int = 64
    pg_lexical: bool = True
    embedding: EmbeddingSettings = field(default_factory=EmbeddingSettings)
    rerank: RerankSettings = field(default_factory=RerankSettings)
    opensearch: OpenSearchSettings = field(default_factory=OpenSearchSettings)

    @property
    def data_dir(self) -> Path:
        return self.pg_data_dir or self.home / "pgdata"

    @property
    def socket_dir(self) -> Path:
        return self.pg_socket_dir or self.home / "run"

    @property
    def plpython_root(self) -> Path:
        return self.home / "plpython"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        cfg = Config(os.environ if env is None else env)
        d = cls(home=Path("."))
        return cls(
            database_url=cfg("POIMEN_DATABASE_URL", str),
            home=cfg("POIMEN_HOME", Path, None) or _default_home(),
            pg_port=cfg("POIMEN_PG_PORT", within(1, 65535), d.pg_port),
            pg_data_dir=cfg("POIMEN_PG_DATA_DIR", Path),
            pg_socket_dir=cfg("POIMEN_PG_SOCKET_DIR", Path),
            pg_bin_dir=cfg("POIMEN_PG_BIN_DIR", Path),
            pool_min=cfg("POIMEN_POOL_MIN", at_least(0), d.pool_min),
            pool_max=cfg("POIMEN_POOL_MAX", at_least(1), d.pool_max),
            max_query_chars=cfg("POIMEN_MAX_QUERY_CHARS", at_least(1), d.max_query_chars),
            default_limit=cfg("POIMEN_DEFAULT_LIMIT", at_least(1), d.default_limit),
            max_limit=cfg("POIMEN_MAX_LIMIT", at_least(1), d.max_limit),
            default_timeout_s=cfg("POIMEN_DEFAULT_TIMEOUT_S", positive, d.default_timeout_s),
            max_timeout_s=cfg("POIMEN_MAX_TIMEOUT_S", positive, d.max_timeout_s),
            rerank_depth_factor=cfg(
                "POIMEN_RERANK_DEPTH_FACTOR", at_least(1), d.rerank_depth_factor
            ),
            rerank_min_remaining_s=cfg(
                "POIMEN_RERANK_MIN_REMAINING_S", at_least(0.0, float), d.rerank_min_remaining_s
            ),
            ingest_batch=cfg("POIMEN_INGEST_BATCH", at_least(1), d.ingest_batch),
            pg_lexical=cfg("POIMEN_PG_LEXICAL", _bool, d.pg_lexical),
            embedding=EmbeddingSettings.from_config(cfg),
            rerank=RerankSettings.from_config(cfg),
            opensearch=OpenSearchSettings.from_config(cfg),
        )
