"""Every tunable in one place, read from the environment (documented in docs/configuration.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


def _default_home() -> Path:
    # The embedded cluster runs as the postgres user, which cannot read /root.
    if os.geteuid() == 0:
        return Path("/var/lib/poimen-memory")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "poimen-memory"


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{key} must be an integer, got {raw!r}") from exc


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{key} must be a number, got {raw!r}") from exc


def _bool(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, got {raw!r}")


QUESTION_TYPES = ("Factual", "Procedural", "Comparative", "Troubleshooting", "Navigational", "Open")


def _fusion(value: str, key: str) -> str:
    if value not in ("rrf", "convex"):
        raise ValueError(f"{key} must be rrf or convex, got {value!r}")
    return value


def _unit(value: float, key: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{key} must be within [0, 1], got {value}")
    return value


def _fusion_by_type(raw: str) -> dict[str, str]:
    """Parse "Factual:convex,Open:rrf" into {question type: fusion method}."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        qtype, _, method = item.partition(":")
        if qtype not in QUESTION_TYPES:
            raise ValueError(f"POIMEN_FUSION_BY_TYPE: unknown question type {qtype!r}")
        out[qtype] = _fusion(method, "POIMEN_FUSION_BY_TYPE")
    return out


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
    opensearch_url: str | None = None
    opensearch_index: str = "poimen-memory"
    opensearch_timeout_s: float = 2.0
    opensearch_bulk_timeout_s: float = 30.0
    opensearch_verify_certs: bool = True
    opensearch_ca_certs: Path | None = None
    opensearch_sync_batch: int = 500
    opensearch_max_attempts: int = 5
    opensearch_backoff_s: float = 0.5
    max_query_chars: int = 2000
    default_limit: int = 5
    max_limit: int = 50
    default_timeout_s: float = 5.0
    max_timeout_s: float = 30.0
    candidates: int = 50
    cascade_candidates: int = 200
    rrf_k: int = 10
    rerank_depth_factor: int = 3
    rerank_min_remaining_s: float = 0.25
    ingest_batch: int = 64
    pg_lexical: bool = True
    default_fusion: str = "convex"
    dense_weight: float = 0.4
    fusion_by_type: dict[str, str] = field(default_factory=dict)

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
        e = os.environ if env is None else env
        home = Path(e["POIMEN_HOME"]) if e.get("POIMEN_HOME") else _default_home()

        def path(key: str) -> Path | None:
            return Path(e[key]) if e.get(key) else None

        return cls(
            database_url=e.get("POIMEN_DATABASE_URL") or None,
            home=home,
            pg_port=_int(e, "POIMEN_PG_PORT", 54329),
            pg_data_dir=path("POIMEN_PG_DATA_DIR"),
            pg_socket_dir=path("POIMEN_PG_SOCKET_DIR"),
            pg_bin_dir=path("POIMEN_PG_BIN_DIR"),
            pool_min=_int(e, "POIMEN_POOL_MIN", 1),
            pool_max=_int(e, "POIMEN_POOL_MAX", 8),
            opensearch_url=e.get("POIMEN_OPENSEARCH_URL") or None,
            opensearch_index=e.get("POIMEN_OPENSEARCH_INDEX", "poimen-memory"),
            opensearch_timeout_s=_float(e, "POIMEN_OPENSEARCH_TIMEOUT_S", 2.0),
            opensearch_bulk_timeout_s=_float(e, "POIMEN_OPENSEARCH_BULK_TIMEOUT_S", 30.0),
            opensearch_verify_certs=_bool(e, "POIMEN_OPENSEARCH_VERIFY_CERTS", True),
            opensearch_ca_certs=path("POIMEN_OPENSEARCH_CA_CERTS"),
            opensearch_sync_batch=_int(e, "POIMEN_OPENSEARCH_SYNC_BATCH", 500),
            opensearch_max_attempts=_int(e, "POIMEN_OPENSEARCH_MAX_ATTEMPTS", 5),
            opensearch_backoff_s=_float(e, "POIMEN_OPENSEARCH_BACKOFF_S", 0.5),
            max_query_chars=_int(e, "POIMEN_MAX_QUERY_CHARS", 2000),
            default_limit=_int(e, "POIMEN_DEFAULT_LIMIT", 5),
            max_limit=_int(e, "POIMEN_MAX_LIMIT", 50),
            default_timeout_s=_float(e, "POIMEN_DEFAULT_TIMEOUT_S", 5.0),
            max_timeout_s=_float(e, "POIMEN_MAX_TIMEOUT_S", 30.0),
            candidates=_int(e, "POIMEN_CANDIDATES", 50),
            cascade_candidates=_int(e, "POIMEN_CASCADE_CANDIDATES", 200),
            rrf_k=_int(e, "POIMEN_RRF_K", 10),
            rerank_depth_factor=_int(e, "POIMEN_RERANK_DEPTH_FACTOR", 3),
            rerank_min_remaining_s=_float(e, "POIMEN_RERANK_MIN_REMAINING_S", 0.25),
            ingest_batch=_int(e, "POIMEN_INGEST_BATCH", 64),
            pg_lexical=e.get("POIMEN_PG_LEXICAL", "on").lower() not in ("off", "0", "false", "no"),
            default_fusion=_fusion(e.get("POIMEN_FUSION", "convex"), "POIMEN_FUSION"),
            dense_weight=_unit(_float(e, "POIMEN_DENSE_WEIGHT", 0.4), "POIMEN_DENSE_WEIGHT"),
            fusion_by_type=_fusion_by_type(e.get("POIMEN_FUSION_BY_TYPE", "")),
        )
