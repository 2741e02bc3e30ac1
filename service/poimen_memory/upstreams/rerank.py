"""A client for cross-encoder rerank servers, with scores normalised into [0, 1].

Two request dialects cover the servers in use:

- ``tei`` (Hugging Face text-embeddings-inference): ``{query, texts, raw_scores: false,
  truncate: true}``
- ``cohere`` (Cohere, Jina, vLLM, Infinity, llama.cpp, …): ``{model, query, documents,
  top_n}``

Responses may be a bare array or wrap it in ``results`` or ``data``; each item
carries ``index`` and ``score`` or ``relevance_score``, and ``document`` (a
string, ``{"text": …}`` or absent) is ignored: results are joined back to the
caller's documents by ``index``. Servers disagree on score scale, so every
batch is mapped into [0, 1] (see `normalise_scores`). When no rerank URL is
configured `reranker_from_env` returns None and the service must report
rerank as ``not_configured`` rather than invent scores.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from poimen_core.openai_embed import shown_url
from poimen_memory.errors import ConfigError, RerankUnavailable
from poimen_memory.settings import RerankSettings
from poimen_memory.upstreams.clients import (
    UpstreamClients,
    endpoint_candidates,
    fallback_endpoint,
    raise_for_status,
)

__all__ = [
    "Dialect",
    "RerankClient",
    "RerankResult",
    "RerankUnavailable",
    "ScoreScale",
    "build_reranker",
    "detect_scale",
    "normalise_scores",
]

Dialect = Literal["tei", "cohere"]
ScoreScale = Literal["auto", "unit", "percent", "logit"]
ResolvedScale = Literal["unit", "percent", "logit"]

_DIALECTS: dict[str, Dialect] = {"tei": "tei", "cohere": "cohere"}
_SCALES: dict[str, ScoreScale] = {
    "auto": "auto",
    "unit": "unit",
    "percent": "percent",
    "logit": "logit",
}


@dataclass(frozen=True, slots=True)
class RerankResult:
    index: int
    """Position of the document in the caller's ``documents``."""
    score: float
    """Normalised into [0, 1]; higher is more relevant."""
    raw_score: float
    """What the server said, for logs and debugging."""


def detect_scale(raw_scores: Sequence[float]) -> ResolvedScale:
    """Guess a batch's scale: all in [0, 1] → unit; all in [0, 100] → percent; else logit.

    Ambiguous by nature: a logit batch that happens to fall inside [0, 1] reads
    as unit, a logit batch of positives up to 100 reads as percent, and a
    percent batch whose best score is <= 1 (nothing relevant) reads as unit and
    is inflated a hundredfold. Set ``POIMEN_RERANK_SCORE_SCALE`` when the
    server is known.
    """
    if all(0.0 <= s <= 1.0 for s in raw_scores):
        return "unit"
    if all(0.0 <= s <= 100.0 for s in raw_scores):
        return "percent"
    return "logit"


def _sigmoid(x: float) -> float:
    # Split by sign so exp never overflows for large-magnitude logits.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def normalise_scores(
    raw_scores: Sequence[float], scale: ScoreScale = "auto"
) -> tuple[list[float], ResolvedScale]:
    """Map raw scores into [0, 1] and say which scale was applied.

    ``unit`` scores are clamped (servers emit 1.0000001), ``percent`` ones divided
    by 100 and clamped, ``logit`` ones passed through a sigmoid; ``auto`` picks
    with `detect_scale`, once for the whole batch so scores stay comparable.
    """
    resolved: ResolvedScale = detect_scale(raw_scores) if scale == "auto" else scale
    if resolved == "unit":
        return [min(1.0, max(0.0, s)) for s in raw_scores], resolved
    if resolved == "percent":
        return [min(1.0, max(0.0, s / 100.0)) for s in raw_scores], resolved
    return [_sigmoid(s) for s in raw_scores], resolved


class RerankClient:
    """Async client for one rerank endpoint.

    ``client`` may be a shared `httpx.AsyncClient` owned by the caller (never
    closed here); otherwise one is created on first use and closed by `aclose`.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        dialect: Dialect = "cohere",
        score_scale: ScoreScale = "auto",
        timeout_s: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if dialect not in _DIALECTS:
            raise ConfigError(f"unknown rerank dialect {dialect!r}: use tei or cohere")
        if score_scale not in _SCALES:
            raise ConfigError(
                f"unknown rerank score scale {score_scale!r}: use auto, unit, percent or logit"
            )
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self._endpoints = endpoint_candidates(url, "rerank")
        self.endpoint = self._endpoints[0]
        self.model = model
        self.dialect: Dialect = dialect
        self.score_scale: ScoreScale = score_scale
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients = UpstreamClients(async_client=client)
        self.last_scale: ResolvedScale | None = None
        """The scale applied to the latest batch, for diagnostics."""

    @classmethod
    def from_settings(
        cls, settings: RerankSettings, *, client: httpx.AsyncClient | None = None
    ) -> RerankClient:
        if settings.url is None:
            raise ConfigError("POIMEN_RERANK_URL is not set")
        return cls(
            settings.url,
            model=settings.model,
            api_key=settings.api_key,
            dialect=_DIALECTS[settings.dialect],
            score_scale=_SCALES[settings.score_scale],
            timeout_s=settings.timeout_s,
            client=client,
        )

    async def arerank(
        self,
        query: str,
        documents: Sequence[str],
        top_n: int | None = None,
        timeout: float | None = None,
    ) -> list[RerankResult]:
        """Rerank ``documents`` for ``query``: best first, at most ``top_n`` results.

        ``timeout`` (seconds, default the configured one) bounds the whole call.
        Raises `RerankUnavailable` on any failure; never returns made-up scores.
        """
        if isinstance(documents, str):
            raise TypeError("documents must be a sequence of texts, not one str")
        if top_n is not None and top_n < 1:
            raise ValueError("top_n must be >= 1")
        if not documents:
            return []
        limit = self.timeout_s if timeout is None else timeout
        client = self._clients.async_()
        try:
            # httpx timeouts bound each phase; the outer one bounds the whole call.
            async with asyncio.timeout(limit):
                body = self._payload(query, documents, top_n)
                response = await client.post(
                    self.endpoint, json=body, headers=self._headers, timeout=limit
                )
                following = fallback_endpoint(self._endpoints, self.endpoint, response, "reranker")
                if following is not None:
                    self.endpoint = following
                    response = await client.post(
                        self.endpoint, json=body, headers=self._headers, timeout=limit
                    )
        except (TimeoutError, httpx.TimeoutException):
            raise RerankUnavailable(
                f"reranker {shown_url(self.endpoint)} did not answer within {limit:.3g}s",
                reason="timeout",
            ) from None
        except httpx.HTTPError as exc:
            raise RerankUnavailable(
                f"reranker {shown_url(self.endpoint)} unreachable: {exc!r}", reason="transport"
            ) from exc
        raise_for_status(RerankUnavailable, "reranker", self.endpoint, response)
        try:
            pairs = _parse_items(response.json(), len(documents))
        except (ValueError, KeyError, TypeError) as exc:
            raise RerankUnavailable(
                f"malformed rerank response: {exc}", reason="bad_response"
            ) from exc
        raw = [score for _, score in pairs]
        scores, self.last_scale = normalise_scores(raw, self.score_scale)
        results = [
            RerankResult(index=index, score=score, raw_score=raw_score)
            for (index, raw_score), score in zip(pairs, scores, strict=True)
        ]
        # Ties keep document order so equal scores rank deterministically.
        results.sort(key=lambda r: (-r.score, r.index))
        return results[:top_n] if top_n is not None else results

    async def aclose(self) -> None:
        await self._clients.aclose()

    def _payload(self, query: str, documents: Sequence[str], top_n: int | None) -> dict[str, Any]:
        if self.dialect == "tei":
            # TEI has no top_n (we cut client-side); truncate avoids a 413 on long passages.
            return {"query": query, "texts": list(documents), "raw_scores": False, "truncate": True}
        payload: dict[str, Any] = {"query": query, "documents": list(documents)}
        if self.model is not None:
            payload["model"] = self.model
        payload["top_n"] = top_n if top_n is not None else len(documents)
        return payload


def _parse_items(body: object, n_documents: int) -> list[tuple[int, float]]:
    items: object = body
    if isinstance(body, dict):
        items = body["results"] if "results" in body else body["data"]
    if not isinstance(items, list):
        raise TypeError(f"expected a list of results, got {type(items).__name__}")
    pairs: list[tuple[int, float]] = []
    seen: set[int] = set()
    for item in items:
        if not isinstance(item, dict):
            raise TypeError(f"result is a {type(item).__name__}, not an object")
        index = item["index"]
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index {index!r} is not an integer")
        if not 0 <= index < n_documents or index in seen:
            raise ValueError(f"index {index} out of range or repeated")
        seen.add(index)
        score = item["relevance_score"] if "relevance_score" in item else item["score"]
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise TypeError(f"score {score!r} is not a number")
        if not math.isfinite(score):
            raise ValueError(f"score {score!r} is not finite")
        pairs.append((index, float(score)))
    return pairs


def build_reranker(
    settings: RerankSettings, *, client: httpx.AsyncClient | None = None
) -> RerankClient | None:
    """A `RerankClient` when ``POIMEN_RERANK_URL`` is set, else None (rerank not configured)."""
    if settings.url is None:
        return None
    return RerankClient.from_settings(settings, client=client)
