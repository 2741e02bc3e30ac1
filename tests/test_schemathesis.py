"""schemathesis, every check, against the real server and its own /openapi.json: bounded
examples per operation, seeded, and zero failures (no 5xx, responses match the schema,
invalid input is rejected, valid input accepted); once anonymous and once with an API key
that can write and forget, so POST and DELETE run as a tenant's key sends them. The
empty instants and non-ASCII digits a fuzzer may or may not draw are sent explicitly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from poimen_lab.live_server import live_server
from poimen_memory.embedders.local import LocalEmbedder
from service_client import make_key

EXAMPLES = int(os.environ.get("POIMEN_SCHEMATHESIS_EXAMPLES", "25"))
ST = Path(sys.executable).parent / "st"
# The defaults, fair admission included: one client alone is never held by its share.
ENV = {"POIMEN_HEALTH_CACHE_S": "30"}


@pytest.mark.skipif(shutil.which("st", path=str(ST.parent)) is None,
                    reason="schemathesis is installed by make setup-dev")  # fmt: skip
@pytest.mark.parametrize("as_key", [False, True], ids=["anonymous", "write-key"])
def test_schemathesis_finds_nothing(
    fixture_url: str, embedder: LocalEmbedder, tmp_path: Path, as_key: bool
) -> None:
    auth = []
    if as_key:  # a key over the fixture's project that may write and forget
        auth = ["--header", f"Authorization: Bearer {make_key(fixture_url, ['poimen'], True)}"]
    with live_server({"POIMEN_DATABASE_URL": fixture_url, **ENV}, tmp_path / "server.log") as url:
        proc = subprocess.run(
            [str(ST),
             "--config-file", str(Path(__file__).with_name("schemathesis.toml")),
             "run", f"{url}/openapi.json", *auth,
             "--report", "har", "--report-har-path", str(tmp_path / "st.har"),
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
    out = Path(os.environ.get("POIMEN_SCHEMATHESIS_OUT", tmp_path / "st.out"))
    out.with_name(f"{out.stem}-{'key' if as_key else 'anonymous'}{out.suffix}").write_text(
        proc.stdout
    )
    server_log = (tmp_path / "server.log").read_text()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Traceback" not in server_log, server_log[-4000:]
    # What was sent and answered (the HAR): no 5xx anywhere, and POST and DELETE reached
    # their routes; with the key, as the tenant it names (answered, not 401 or 403).
    entries = json.loads((tmp_path / "st.har").read_text())["log"]["entries"]
    seen: Counter[tuple[str, int]] = Counter(
        (e["request"]["method"], e["response"]["status"]) for e in entries
    )
    assert not [k for k in seen if k[1] >= 500], seen
    for method in ("POST", "DELETE"):
        answered = sum(n for (m, status), n in seen.items() if m == method and status < 500)
        assert answered >= 10, (method, seen)
        if as_key:
            served = [st for (m, st), n in seen.items() if m == method and st < 300]
            assert served, (method, seen)  # some POSTs wrote, some DELETEs forgot


# An empty instant and digits that are not ASCII (Arabic-Indic digits, which int() reads), on
# every route that takes them: each a typed 400 naming the parameter, never a 500 or a 200.
EDGES = [
    ("GET", "/memory/query", {"query": "kong", "as_of": ""}, "as_of"),
    ("GET", "/memory/query", {"query": "kong", "valid_at": ""}, "valid_at"),
    ("GET", "/memory/query", {"query": "kong", "reference_time": ""}, "reference_time"),
    ("GET", "/memory/query", {"query": "kong", "limit": "\u0661\u0660\u0660"}, "limit"),
    ("GET", "/memory/query", {"query": "kong", "evidence": "\u0661\u0660"}, "evidence"),
    ("GET", "/memory/query", {"query": "kong", "timeout_seconds": "\u0665"}, "timeout_seconds"),
    ("GET", "/memory/nodes", {"limit": "\u0661\u0660\u0660"}, "limit"),
    ("GET", "/memory/review", {"limit": "\u0661\u0660\u0660"}, "limit"),
    ("DELETE", "/memory/nodes", {"source": "x", "max_nodes": "\u0661\u0660"}, "max_nodes"),
    ("DELETE", "/memory/nodes", {"source": "x", "since": ""}, "since"),
]


def test_empty_instants_and_non_ascii_digits_are_400(fixture_url: str, tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {make_key(fixture_url, ['poimen'], True)}"}
    env = {"POIMEN_DATABASE_URL": fixture_url, **ENV}
    with (
        live_server(env, tmp_path / "server.log") as url,
        httpx.Client(base_url=url, headers=headers, timeout=30) as client,
    ):
        before = client.get("/memory/nodes", params={"count": "true"}).json()
        for method, path, params, name in EDGES:
            r = client.request(method, path, params=params)
            assert r.status_code == 400, (method, path, params, r.status_code, r.text)
            assert name in r.json()["detail"], (params, r.text)
        # The refused DELETEs forgot nothing.
        assert client.get("/memory/nodes", params={"count": "true"}).json() == before
