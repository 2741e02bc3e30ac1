"""An LRU cache of query embeddings, so a repeated query skips the embedder.

Keyed by ``(model_name, caller, query text)``: the text is the caller's query before
any model prefix, and the model name keeps vectors of different spaces apart. The caller
(the API key, "" without one) keeps tenants apart: shared, the cache told a key, by the
answer's ``embedding_cache_hit`` and by its speed, whether another tenant had just asked
the same question. Only queries are cached; document embeddings are stored in Postgres
anyway.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from poimen_memory.embedders.base import Embedder, Vector

__all__ = ["DEFAULT_CACHE_SIZE", "QueryEmbeddingCache"]

DEFAULT_CACHE_SIZE = 1024


class QueryEmbeddingCache:
    """Bounded in entries; ``max_entries=0`` disables caching but still counts misses.

    A plain lock makes it safe from the event loop and from worker threads
    alike (it is never held across an await). Two concurrent misses on the
    same query both call the embedder; identical queries arriving within one
    embedding latency are too rare here to justify request coalescing.
    Cached vectors are read-only so no caller can corrupt another's result.
    """

    def __init__(self, max_entries: int = DEFAULT_CACHE_SIZE) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str, str], Vector] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def get(self, model_name: str, text: str, caller: str = "") -> Vector | None:
        """The cached vector (counted as a hit) or None (counted as a miss)."""
        key = (model_name, caller, text)
        with self._lock:
            vector = self._entries.get(key)
            if vector is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return vector

    def put(self, model_name: str, text: str, vector: Vector, caller: str = "") -> Vector:
        """Store a read-only copy and return it."""
        frozen = np.array(vector, dtype=np.float32, copy=True)
        frozen.flags.writeable = False
        if self.max_entries == 0:
            return frozen
        key = (model_name, caller, text)
        with self._lock:
            self._entries[key] = frozen
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self._evictions += 1
        return frozen

    async def get_or_embed(
        self, embedder: Embedder, text: str, timeout: float, caller: str = ""
    ) -> tuple[Vector, bool]:
        """``(vector, hit)``; on a miss embeds within ``timeout`` and caches the result.

        Failures (`EmbeddingUnavailable`) propagate and are not cached.
        """
        cached = self.get(embedder.model_name, text, caller)
        if cached is not None:
            return cached, True
        vector = await embedder.aembed_query(text, timeout)
        return self.put(embedder.model_name, text, vector, caller), False

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            lookups = self._hits + self._misses
            return {
                "size": len(self._entries),
                "max_entries": self.max_entries,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "hit_rate": self._hits / lookups if lookups else 0.0,
            }

    def clear(self) -> None:
        """Drop all entries; the counters keep running."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
