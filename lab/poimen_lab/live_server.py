"""The real server in its own process, for the tests and the HTTP benchmark: ``poimen-memory
serve`` on a free loopback port, its
output captured to a file (a file, not a pipe: a chatty server must never block on a full
pipe)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(env: Mapping[str, str], output: Path, *, drop: Sequence[str] = ()) -> Iterator[str]:
    """Yields the base URL once GET /healthz answers 200; stops the process on exit. The
    server inherits this process's environment, less the variables in ``drop``, plus
    ``env``."""
    with live_server_process(env, output, drop=drop) as (url, _):
        yield url


@contextmanager
def live_server_process(
    env: Mapping[str, str], output: Path, *, drop: Sequence[str] = ()
) -> Iterator[tuple[str, int]]:
    """``live_server``, yielding the server's process id beside its URL (the benchmark
    reads the process's CPU time)."""
    port = free_port()
    # `poimen-memory serve` itself, so its uvicorn settings (limits, the first-request
    # deadline) are what the tests and the benchmark meet.
    cmd = [
        sys.executable, "-m", "poimen_memory.cli.main", "serve",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with output.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            env={**{k: v for k, v in os.environ.items() if k not in drop}, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            # One client for every poll: httpx.get() makes a client, and with it an SSL
            # context (the CA bundle parsed), at each call: about 3 s of this process's CPU
            # over a server's start, on every test that starts one.
            with httpx.Client(timeout=2.0) as client:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"server exited ({proc.returncode}):\n{output.read_text()}"
                        )
                    try:
                        if client.get(f"{url}/healthz").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"server did not start:\n{output.read_text()}")
                    time.sleep(0.1)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
