"""End-to-end GET /memory/query load: the service (create_app under uvicorn) in a child
process on 127.0.0.1, with the local embedder and no reranker; httpx clients in this one."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

from poimen_lab.measures import percentile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """uvicorn --factory poimen_memory.api.app:create_app; stopped by its own pid on exit."""

    def __init__(self, database_url: str) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("POIMEN_RERANK_URL", "POIMEN_OPENSEARCH_URL")
        }
        env["POIMEN_DATABASE_URL"] = database_url
        # A file, not a pipe: a chatty server must never block on a full pipe.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "poimen_memory.api.app:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")
                raise RuntimeError(f"the service exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                if httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError("the service did not become healthy in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _load(
    base: str, texts: Sequence[str], clients: int, params: dict[str, str]
) -> dict[str, Any]:
    ms: list[float] = []
    errors = 0
    strategies: dict[str, int] = {}
    todo = list(texts)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def worker() -> None:
            nonlocal errors
            while todo:
                text = todo.pop()
                t0 = time.perf_counter()
                resp = await client.get("/memory/query", params={"query": text, **params})
                ms.append((time.perf_counter() - t0) * 1000)
                if resp.status_code != 200:
                    errors += 1
                    continue
                s = resp.json()["search_strategy"]
                strategies[s] = strategies.get(s, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "requests": len(texts),
        "errors": errors,
        "p50_ms": round(percentile(ms, 50), 2),
        "p95_ms": round(percentile(ms, 95), 2),
        "req_per_s": round(len(texts) / wall, 2),
        "strategies": strategies,
    }


def run(
    database_url: str,
    texts: Sequence[str],
    *,
    concurrency: Sequence[int] = (1, 8),
    requests: int = 200,
    params: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each concurrency level gets its own unseen query texts (no embedding-cache hits)."""
    params = params or {"limit": "10"}
    need = 5 + requests * len(concurrency)
    if len(texts) < need:
        raise ValueError(f"need {need} distinct query texts, got {len(texts)}")
    with Server(database_url) as srv:
        asyncio.run(_load(srv.base, texts[:5], 1, params))  # warm-up
        out, start = [], 5
        for c in concurrency:
            out.append(asyncio.run(_load(srv.base, texts[start : start + requests], c, params)))
            start += requests
    return out
