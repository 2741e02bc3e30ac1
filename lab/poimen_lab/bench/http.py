"""End-to-end GET /memory/query load: the service (create_app under uvicorn) in a child
process on 127.0.0.1, with the local embedder and no reranker; the clients are threads in
this process, each with one keep-alive connection (the standard library's http.client).

Not httpx.AsyncClient: on this machine it spends about 5 ms of its own per request (6.6 ms
p50 for the static /openapi.json where http.client and curl take 1.6-2 ms), which a latency
quoted for the service should not include, and it burns the CPU the service shares with it
on two cores. docs/benchmarks.md has the two side by side."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import psycopg

from poimen_lab.live_server import live_server_process
from poimen_lab.measures import percentile


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """User plus system CPU time of each process still running (Linux /proc): CPU spent,
    which the machine's other work does not inflate as it inflates wall-clock time."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for pid in pids:
        try:
            # The fields after the command name, which may hold spaces: utime, stime are
            # the 14th and 15th of the line.
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


class CPU:
    """The CPU the server process and its database sessions spend over a load."""

    def __init__(self, server_pid: int, database_url: str) -> None:
        self.server_pid = server_pid
        self.url = database_url

    def _backends(self) -> list[int]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_catalog.pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend' AND pid <> pg_catalog.pg_backend_pid()"
            ).fetchall()
        return [int(r[0]) for r in rows]

    def snapshot(self) -> tuple[float, dict[int, float]]:
        return cpu_seconds([self.server_pid]).get(self.server_pid, 0.0), cpu_seconds(
            self._backends()
        )

    @staticmethod
    def spent(
        before: tuple[float, dict[int, float]], after: tuple[float, dict[int, float]]
    ) -> tuple[float, float]:
        """(server, database) CPU seconds between the two snapshots; a session opened in
        between counts from its start."""
        database = sum(t - before[1].get(pid, 0.0) for pid, t in after[1].items())
        return after[0] - before[0], database


def _load(
    base: str,
    texts: Sequence[str],
    clients: int,
    params: dict[str, str],
    headers: dict[str, str] | None = None,
    cpu: CPU | None = None,
) -> dict[str, Any]:
    ms: list[float] = []
    errors = 0
    strategies: dict[str, int] = {}
    todo = list(texts)
    lock = threading.Lock()
    where = urlsplit(base)

    def worker() -> None:
        nonlocal errors
        conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=60)
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    text = todo.pop()
                path = "/memory/query?" + urlencode({"query": text, **params})
                t0 = time.perf_counter()
                conn.request("GET", path, headers=headers or {})
                resp = conn.getresponse()
                body = resp.read()
                took = (time.perf_counter() - t0) * 1000
                with lock:
                    ms.append(took)
                    if resp.status != 200:
                        errors += 1
                        continue
                    s = json.loads(body)["search_strategy"]
                    strategies[s] = strategies.get(s, 0) + 1
        finally:
            conn.close()

    before = cpu.snapshot() if cpu else None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - t0
    spent = cpu.spent(before, cpu.snapshot()) if cpu and before else None
    return {**summary(clients, ms, errors, wall, spent), "strategies": strategies}


def summary(
    clients: int,
    ms: Sequence[float],
    errors: int,
    wall: float,
    spent: tuple[float, float] | None,
) -> dict[str, Any]:
    """One load's row: latency, throughput and, when measured (``CPU.spent``), the CPU a
    request cost the server process (its Python and the embedder's threads) and the
    PostgreSQL sessions serving it."""
    n = len(ms)
    row: dict[str, Any] = {
        "clients": clients,
        "requests": n,
        "errors": errors,
        "p50_ms": round(percentile(ms, 50), 2),
        "p95_ms": round(percentile(ms, 95), 2),
        "req_per_s": round(n / wall, 2),
    }
    if spent is not None:
        row["server_cpu_ms"] = round(spent[0] * 1000 / n, 2)
        row["database_cpu_ms"] = round(spent[1] * 1000 / n, 2)
    return row


@contextlib.contextmanager
def serving(database_url: str) -> Iterator[tuple[str, int]]:
    """The service in a child process on ``database_url``: (base URL, pid)."""
    drop = ("POIMEN_RERANK_URL", "POIMEN_OPENSEARCH_URL")
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server_process(
            {"POIMEN_DATABASE_URL": database_url}, Path(tmp) / "server.log", drop=drop
        ) as served,
    ):
        yield served


def loads(
    served: tuple[str, int],
    database_url: str,
    texts: Sequence[str],
    *,
    concurrency: Sequence[int] = (1, 8),
    requests: int = 200,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The loads of ``run`` against a server already running (``serving``): its texts must
    be unseen by that server (no embedding-cache hits)."""
    # No evidence list: the in-process reference (bench/inprocess.py) runs no L0 legs, and
    # the ratio compares the same pipeline. What the list costs: eval/evidence_latency.py.
    params = params or {"limit": "10", "evidence": "0"}
    need = 5 + requests * len(concurrency)
    if len(texts) < need:
        raise ValueError(f"need {need} distinct query texts, got {len(texts)}")
    base, pid = served
    _load(base, texts[:5], 1, params, headers)  # warm-up
    cpu = CPU(pid, database_url)
    out, start = [], 5
    for c in concurrency:
        out.append(_load(base, texts[start : start + requests], c, params, headers, cpu))
        start += requests
    return out


def run(
    database_url: str,
    texts: Sequence[str],
    *,
    concurrency: Sequence[int] = (1, 8),
    requests: int = 200,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each concurrency level gets its own unseen query texts (no embedding-cache hits); a
    server of its own per call, so another call may send the same texts."""
    with serving(database_url) as served:
        return loads(
            served, database_url, texts, concurrency=concurrency, requests=requests,
            params=params, headers=headers,
        )  # fmt: skip
