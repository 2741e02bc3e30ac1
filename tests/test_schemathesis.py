"""schemathesis, every check, against the real server and its own /openapi.json: bounded
examples per operation, seeded, and zero failures (no 5xx, responses match the schema,
invalid input is rejected, valid input accepted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from poimen_lab.live_server import live_server
from poimen_memory.embedders.local import LocalEmbedder

EXAMPLES = int(os.environ.get("POIMEN_SCHEMATHESIS_EXAMPLES", "25"))


@pytest.mark.skipif(shutil.which("st", path=str(Path(sys.executable).parent)) is None,
                    reason="schemathesis is installed by make setup-dev")  # fmt: skip
def test_schemathesis_finds_nothing(
    fixture_url: str, embedder: LocalEmbedder, tmp_path: Path
) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HEALTH_CACHE_S": "30"}
    with live_server(env, tmp_path / "server.log") as url:
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "st"),
             "--config-file", str(Path(__file__).with_name("schemathesis.toml")),
             "run", f"{url}/openapi.json",
             "--checks", "all", "--max-examples", str(EXAMPLES), "--seed", "1",
             "--workers", "1", "--request-timeout", "30", "--max-time", "90",
             # `--checks all` includes max_response_time (10 s by default): a loaded CI
             # machine is slow, not wrong.
             "--max-response-time", "30",
             "--exclude-path", "/ui", "--exclude-path", "/metrics",
             # JSON-RPC under one path: tests/test_mcp.py drives it with the MCP client.
             "--exclude-path", "/mcp",
             # The spec says strings are UTF-8 without NUL (PostgreSQL cannot store either);
             # tests/test_write_safety.py sends both and checks the 400s.
             "--generation-allow-x00", "false", "--generation-codec", "utf-8"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    Path(os.environ.get("POIMEN_SCHEMATHESIS_OUT", tmp_path / "st.out")).write_text(proc.stdout)
    server_log = (tmp_path / "server.log").read_text()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Traceback" not in server_log, server_log[-4000:]
