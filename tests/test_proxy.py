"""PL/Proxy sharding (docs/scaling.md#pl-proxy): three shard clusters of their own (ports
and sockets of their own), four partition databases over them made and migrated by
`poimen-memory shard init`'s code, and a proxy database in the session's cluster. A
reference database holds the same nodes in one place: a query naming a project answers
alike field by field through the proxy; a query naming none is every partition's top k
merged as documented; writes land on the partition of their project; a key for one project
sees nothing of another; a stopped shard gives 08006 (503) for its projects and a degraded
answer over all; a partition moved under a write load loses no write."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conftest import FIXTURE, free_port
from poimen_memory import shard
from poimen_memory.cli.main import main
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate

PARTITIONS = 4
SHARDS = 3
PROXY_ROLE = "poimen_proxy"
SERVICE_ROLE = "poimen_service"  # the proxy's trusted caller (POIMEN_SERVICE_ROLE)


def server_conninfo(c: Cluster) -> str:
    return make_conninfo(host=str(c.socket_dir), port=str(c.port))


@dataclass
class Sharded:
    shards: list[Cluster]
    proxy_url: str
    reference_url: str
    projects: dict[str, int]  # project -> partition
    nodes: list[dict[str, Any]]

    def partition_url(self, part: int, proxy: psycopg.Connection[Any]) -> str:
        return shard.partitions(proxy)[part].admin("postgres")


def fixture_nodes() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def renamed(nodes: list[dict[str, Any]], source: str, project: str) -> list[dict[str, Any]]:
    """One project's nodes as another project's (ids and parents kept: unique per project)."""
    return [dict(n, project=project) for n in nodes if n["project"] == source]


@pytest.fixture(scope="module")
def sharded(
    cluster: Cluster, admin: psycopg.Connection[Any], plpython_root: Path
) -> Iterator[Sharded]:
    base = cluster.data_dir.parent / "shards"
    # The proxy logs in to each shard as poimen_proxy: peer-mapped from the server's OS user.
    shards = [
        Cluster(base / f"data{i}", base / f"run{i}", free_port(), cluster.bin_dir, PROXY_ROLE)
        for i in range(SHARDS)
    ]
    for s in shards:
        s.start(fast=True)
    admin.execute("DROP DATABASE IF EXISTS proxy_t WITH (FORCE)")
    admin.execute("CREATE DATABASE proxy_t")
    admin.execute("DROP DATABASE IF EXISTS proxy_ref WITH (FORCE)")
    admin.execute("CREATE DATABASE proxy_ref")
    proxy_url = cluster.url("proxy_t")
    try:
        shard.init(
            proxy_url,
            [server_conninfo(s) for s in shards],
            PARTITIONS,
            prefix="pm",
            service_role=SERVICE_ROLE,
            plpython_root=plpython_root,
        )
        with psycopg.connect(proxy_url, autocommit=True) as p:
            hashed = {
                name: int(part)
                for name, part in p.execute(
                    "SELECT n, memory_proxy.partition_of(n)"
                    " FROM unnest(ARRAY['poimen', 'atlas'] || ARRAY(SELECT 't' || i"
                    " FROM generate_series(0, 40) i)) n"
                )
            }
        # poimen and atlas, and one copy of poimen's nodes on every other partition.
        projects = {"poimen": hashed["poimen"], "atlas": hashed["atlas"]}
        for name, part in hashed.items():
            if part not in projects.values():
                projects[name] = part
        nodes = fixture_nodes()
        for name in projects:
            if name not in ("poimen", "atlas"):
                nodes += renamed(fixture_nodes(), "poimen", name)
        with connect(cluster.url("proxy_ref"), autocommit=True) as ref:
            migrate(ref, plpython_root, role_prefix="proxy_ref")
            # Written for API key 41 on both sides: the key travels through the proxy, and
            # every version records it (written_by).
            ref.execute("SELECT set_config('poimen.api_key', '41', false)")
            ref.execute("SELECT memory.add_nodes(%s)", (json.dumps(nodes),))
        with psycopg.connect(proxy_url, autocommit=True) as p:
            p.execute("SELECT set_config('poimen.write_projects', '*', false)")
            p.execute("SELECT set_config('poimen.read_projects', '*', false)")
            p.execute("SELECT set_config('poimen.api_key', '41', false)")
            p.execute("SELECT memory.add_nodes(%s)", (json.dumps(nodes),))
        yield Sharded(shards, proxy_url, cluster.url("proxy_ref"), projects, nodes)
    finally:
        for s in shards:
            s.destroy()
        admin.execute("DROP DATABASE IF EXISTS proxy_t WITH (FORCE)")
        admin.execute("DROP DATABASE IF EXISTS proxy_ref WITH (FORCE)")


def as_service(url: str, read: str = "*", write: str = "*") -> psycopg.Connection[Any]:
    conn = connect(url, autocommit=True)
    conn.execute("SELECT set_config('poimen.read_projects', %s, false)", (read,))
    conn.execute("SELECT set_config('poimen.write_projects', %s, false)", (write,))
    return conn


QUERIES = (
    "why did requests over 10KB fail",
    "kong body size limit",
    "what did we decide about uploads",
)


def strip_ids(value: Any) -> Any:
    """A row without its node ids: identities of the database that holds it, which differ
    between a partition and the reference (external_id and project name a node anywhere)."""
    if isinstance(value, dict):
        return {k: strip_ids(v) for k, v in value.items() if k != "node_id"}
    if isinstance(value, list):
        return [strip_ids(v) for v in value]
    return value


def rows(conn: psycopg.Connection[Any], sql: str, *args: Any) -> list[dict[str, Any]]:
    cur = conn.execute(sql, args)
    names = [d.name for d in cur.description or ()]
    return [strip_ids(dict(zip(names, r, strict=True))) for r in cur.fetchall()]


QUERY = "SELECT * FROM memory_query(%s, project => %s, k => 8, strategy => %s)"


@pytest.mark.parametrize("strategy", [None, "LexicalOnly", "SemanticOnly"])
def test_a_named_project_answers_as_one_database(sharded: Sharded, strategy: str | None) -> None:
    answered = 0
    with as_service(sharded.proxy_url) as p, connect(sharded.reference_url) as ref:
        for project in sharded.projects:
            for text in QUERIES:
                got = rows(p, QUERY, text, project, strategy)
                want = rows(ref, QUERY, text, project, strategy)
                assert got == want, (project, text)
                answered += bool(got)
        assert answered >= len(sharded.projects) * 2
        for project in ("poimen", "atlas"):
            ext = "poimen:mem:1" if project == "poimen" else "atlas:mem:1"
            for sql in (
                "SELECT * FROM memory.get_node(%s, %s)",
                "SELECT * FROM memory.history(%s, %s)",
            ):
                a, b = (ext, project) if "get_node" in sql else (project, ext)
                got = [unwritten(r) for r in rows(p, sql, a, b)]
                assert len(got) == 1
                assert "written_by" not in got[0] or got[0]["written_by"] == "api_key:41"
                assert got == [unwritten(r) for r in rows(ref, sql, a, b)]


def unwritten(row: dict[str, Any]) -> dict[str, Any]:
    """A node without the instants of its write (each database wrote its own copy)."""
    return {k: v for k, v in row.items() if k not in ("created_at", "valid_from")}


def test_a_query_naming_no_project_merges_every_partitions_top_k(sharded: Sharded) -> None:
    """The documented rule, computed here from each partition database directly: every
    partition's top k, the k best by final_score (ties: query_score, project, rank)."""
    k = 6
    with as_service(sharded.proxy_url) as p:
        direct = [connect(part.admin("postgres")) for part in shard.partitions(p)]
        for text in QUERIES:
            got = rows(p, "SELECT * FROM memory_query(%s, k => %s)", text, k)
            union: list[dict[str, Any]] = []
            for c in direct:
                union += rows(c, "SELECT * FROM memory_query(%s, k => %s)", text, k)
            union.sort(
                key=lambda r: (-r["final_score"], -(r["query_score"] or 0), r["project"], r["rank"])
            )
            want = [dict(r, rank=i) for i, r in enumerate(union[:k], 1)]
            assert got == want, text
            assert len({r["project"] for r in got}) > 1, "the answer spans partitions"
        for c in direct:
            c.close()


def where_is(sharded: Sharded, project: str, external_id: str) -> list[int]:
    found = []
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    for part in parts:
        with psycopg.connect(part.admin("postgres")) as c:
            if c.execute(
                "SELECT 1 FROM memory.nodes n JOIN memory.projects pr ON pr.id = n.project_id"
                " WHERE pr.name = %s AND n.external_id = %s",
                (project, external_id),
            ).fetchone():
                found.append(part.number)
    return found


def test_writes_land_on_the_partition_of_their_project(sharded: Sharded) -> None:
    names = [f"w{i}" for i in range(8)]
    with connect(sharded.reference_url) as ref:
        # PostgreSQL's own hashtext, masked as PL/Proxy masks it (not the proxy's function).
        expected = {
            n: int(ref.execute("SELECT hashtext(%s) & %s", (n, PARTITIONS - 1)).fetchone()[0])  # type: ignore[index]
            for n in names
        }
    assert len(set(expected.values())) > 1
    batch = [
        {"project": n, "id": f"{n}:1", "level": "L0", "text": f"note {i} about the write path"}
        for i, n in enumerate(names)
    ]
    with as_service(sharded.proxy_url) as p:
        (out,) = p.execute("SELECT memory.add_nodes(%s)", (json.dumps(batch),)).fetchone()  # type: ignore[misc]
    assert [(n["project"], n["id"], n["status"]) for n in out["nodes"]] == [
        (n, f"{n}:1", "created") for n in names
    ]
    assert out["inserted"] == len(names)
    for n in names:
        assert where_is(sharded, n, f"{n}:1") == [expected[n]]


def test_a_key_for_one_project_sees_nothing_of_another(
    sharded: Sharded, admin: psycopg.Connection[Any]
) -> None:
    admin.execute(
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'proxy_svc_t') THEN "
        "CREATE ROLE proxy_svc_t NOLOGIN; CREATE ROLE proxy_plain_t NOLOGIN; END IF; END $$"
    )
    admin.execute(f"GRANT {SERVICE_ROLE} TO proxy_svc_t")
    with as_service(sharded.proxy_url, read="atlas", write="atlas") as p:
        p.execute("SET ROLE proxy_svc_t")
        # As one database answers a key naming a project it cannot read: unknown (PM404).
        with pytest.raises(psycopg.Error) as err:
            p.execute(QUERY, (QUERIES[0], "poimen", None))
        assert err.value.sqlstate == "PM404"
        every = rows(p, "SELECT * FROM memory_query(%s, k => 20)", QUERIES[0])
        assert every and {r["project"] for r in every} == {"atlas"}
        with pytest.raises(psycopg.Error) as err:
            p.execute("SELECT * FROM memory.get_node('poimen:mem:1', 'poimen')")
        assert err.value.sqlstate in ("PM404", "PM444")
        with pytest.raises(psycopg.Error) as err:
            p.execute(
                "SELECT memory.add_nodes(%s)",
                (json.dumps([{"project": "poimen", "level": "L0", "text": "intruder"}]),),
            )
        assert err.value.sqlstate == "42501"
        with pytest.raises(psycopg.Error) as err:
            p.execute("SELECT memory.forget('poimen', 'poimen:mem:1')")
        assert err.value.sqlstate in ("42501", "PM404", "PM444")
    # A role that is not the proxy's service role asserts nothing, whatever it sets.
    with as_service(sharded.proxy_url) as p:
        p.execute("GRANT USAGE ON SCHEMA memory TO proxy_plain_t")
        p.execute(
            "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA memory, memory_proxy, public TO proxy_plain_t"
        )
        p.execute("GRANT USAGE ON SCHEMA memory_proxy TO proxy_plain_t")
        p.execute("GRANT USAGE ON FOREIGN SERVER memory TO proxy_plain_t")
        p.execute("SET ROLE proxy_plain_t")
        assert rows(p, "SELECT * FROM memory_query(%s, k => 20)", QUERIES[0]) == []
    # On a partition, only the proxy's role (a member of its service role) may call a relay.
    with psycopg.connect(sharded.proxy_url) as p:
        part = shard.partitions(p)[sharded.projects["poimen"]]
    with psycopg.connect(part.admin("postgres"), autocommit=True) as c:
        c.execute(
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'intruder_t') THEN "
            "CREATE ROLE intruder_t NOLOGIN; END IF; END $$"
        )
        c.execute("SET ROLE intruder_t")
        with pytest.raises(psycopg.Error) as err:
            c.execute(
                "SELECT * FROM memory_shard.query('*', '*', '', 'x', NULL, 'poimen',"
                " ARRAY['L1'], 5, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
                " NULL, NULL, NULL, NULL)"
            )
        assert err.value.sqlstate == "42501"


def test_the_proxy_functions_have_the_partitions_signatures(sharded: Sharded) -> None:
    sig = (
        "SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid)"
        " FROM pg_proc p WHERE p.pronamespace = 'memory'::regnamespace"
        " AND p.proname IN ('query', 'answer', 'add_nodes', 'get_node', 'history', 'forget',"
        " '_serve_start', '_serve', '_serve_finish', '_get_node', '_write_nodes',"
        " '_stored_hashes', '_stored_nodes', 'configure_embedding', '_list_nodes',"
        " '_count_nodes', 'review_list', 'review_claim', 'review_confirm')"
        " ORDER BY 1, 2"
    )
    with psycopg.connect(sharded.proxy_url) as p, psycopg.connect(sharded.reference_url) as ref:
        assert p.execute(sig).fetchall() == ref.execute(sig).fetchall()


def test_migrate_check_reports_every_partition(
    sharded: Sharded, capsys: pytest.CaptureFixture[str], plpython_root: Path
) -> None:
    # migrate over every partition (and the proxy's SQL again): nothing left to apply.
    done = shard.migrate_all(
        sharded.proxy_url, service_role=SERVICE_ROLE, plpython_root=plpython_root
    )
    assert [r.error for r in done] == [None] * PARTITIONS
    assert all(r.migrate is not None and not r.migrate.applied for r in done)
    reports = shard.migrate_all(sharded.proxy_url, service_role=SERVICE_ROLE, only_check=True)
    assert [r.partition.number for r in reports] == list(range(PARTITIONS))
    for r in reports:
        assert r.error is None and r.drift is not None, r
        assert r.drift.clean, (r.partition, r.drift)
    # The command: one line a partition.
    # (--no-plpython: the partitions' module was installed from the tests' own copy, which
    # this host's settings do not name; the rest is compared.)
    assert main(["shard", "--proxy", sharded.proxy_url, "migrate", "--check", "--no-plpython"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [f"p{i}" for i in range(PARTITIONS)]
    assert all(ln.endswith(": no drift") for ln in lines), lines
    assert main(["shard", "--proxy", sharded.proxy_url, "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == PARTITIONS and all("current nodes" in ln for ln in lines), lines
    states = shard.status(sharded.proxy_url)
    assert all(s.error is None and (s.nodes or 0) > 0 for s in states)
    # init again with another map is refused before it touches a partition.
    with pytest.raises(shard.ShardError, match="different partition map"):
        shard.init(
            sharded.proxy_url,
            [server_conninfo(sharded.shards[0])],
            PARTITIONS,
            prefix="pm",
            service_role=SERVICE_ROLE,
        )


def test_a_stopped_shard_fails_its_projects_and_degrades_the_rest(sharded: Sharded) -> None:
    with psycopg.connect(sharded.proxy_url) as p:
        parts = shard.partitions(p)
    down = sharded.shards[0]
    down_parts = sorted(
        pt.number for pt in parts if f"port={down.port}" in pt.conninfo.replace("'", "")
    )
    assert down_parts and len(down_parts) < PARTITIONS
    down_projects = [n for n, pt in sharded.projects.items() if pt in down_parts]
    up_projects = [n for n, pt in sharded.projects.items() if pt not in down_parts]
    down.stop()
    try:
        with as_service(sharded.proxy_url) as p:
            warnings: list[str] = []
            p.add_notice_handler(lambda d: warnings.append(str(d.message_primary)))
            for project in down_projects:
                with pytest.raises(psycopg.Error) as err:
                    p.execute(QUERY, (QUERIES[0], project, None))
                assert err.value.sqlstate == "08006"
                assert f"partition {sharded.projects[project]}" in str(err.value)
                with pytest.raises(psycopg.Error) as err:
                    p.execute(
                        "SELECT memory.add_nodes(%s)",
                        (json.dumps([{"project": project, "level": "L0", "text": "lost?"}]),),
                    )
                assert err.value.sqlstate == "08006"
            for project in up_projects:
                assert rows(p, QUERY, QUERIES[0], project, None)
            every = rows(p, "SELECT * FROM memory_query(%s, k => 20)", QUERIES[0])
            assert every and {r["project"] for r in every} <= set(up_projects) | {
                f"w{i}" for i in range(8)
            }
            assert any(str(down_parts).replace(" ", "").strip("[]") in w for w in warnings) or any(
                "degraded" in w for w in warnings
            )
            (doc,) = p.execute("SELECT memory.answer(%s, k => 20)", (QUERIES[0],)).fetchone()  # type: ignore[misc]
            shard_entries = [d for d in doc["degraded"] if d["stage"] == "shard"]
            assert shard_entries == [
                {"stage": "shard", "reason": "unreachable", "partitions": down_parts}
            ]
            assert doc["partitions"]["missing"] == down_parts
            assert {r["project"] for r in doc["results"]} <= set(up_projects) | {
                f"w{i}" for i in range(8)
            }
    finally:
        down.start(fast=True)
    # Back: the partitions answer again, on the same connections' next attempt.
    with as_service(sharded.proxy_url) as p:
        for project in down_projects:
            assert rows(p, QUERY, QUERIES[0], project, None)


WRITES = 300


def test_a_partition_moves_under_writes_and_loses_none(sharded: Sharded) -> None:
    project = "poimen"
    part = sharded.projects[project]
    with psycopg.connect(sharded.proxy_url) as p:
        old = shard.partitions(p)[part]
    target = next(
        s for s in sharded.shards if f"port={s.port}" not in old.conninfo.replace("'", "")
    )
    acknowledged: list[str] = []
    retried: list[str] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def write() -> None:
        try:
            with as_service(sharded.proxy_url) as p:
                for i in range(WRITES):
                    node = {
                        "project": project,
                        "id": f"load:{i}",
                        "level": "L0",
                        "text": f"load note {i}: the gateway answered in {i} ms",
                    }
                    for _attempt in range(50):
                        try:
                            p.execute("SELECT memory.add_nodes(%s)", (json.dumps([node]),))
                            break
                        except psycopg.OperationalError as exc:  # 08xxx: a client retries
                            retried.append(f"{i}: {exc.sqlstate}")
                            time.sleep(0.1)
                    else:
                        raise AssertionError(f"write {i} never went through")
                    acknowledged.append(node["id"])
                    if i == 20:
                        started.set()
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)
            started.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert started.wait(120)
    moved = shard.move(sharded.proxy_url, part, server_conninfo(target))
    during = len(acknowledged)
    writer.join(300)
    assert not writer.is_alive() and not errors, errors
    assert 20 < during < WRITES, "the move ran while the writer wrote"
    assert f"port={target.port}" in moved.conninfo.replace("'", "")
    with psycopg.connect(moved.admin("postgres")) as c:
        stored = {
            r[0]
            for r in c.execute(
                "SELECT n.external_id FROM memory.nodes n JOIN memory.projects pr"
                " ON pr.id = n.project_id WHERE pr.name = %s AND n.external_id LIKE 'load:%%'"
                " AND n.expired_at IS NULL",
                (project,),
            )
        }
    assert stored == set(acknowledged) and len(stored) == WRITES, (len(stored), retried)
    # The writes waited for the move rather than failing (docs/scaling.md#moving-a-partition).
    assert retried == []
    with pytest.raises(psycopg.OperationalError):  # the old copy is closed, not written
        psycopg.connect(old.admin("postgres")).close()
    with as_service(sharded.proxy_url) as p:
        for i in (0, WRITES // 2, WRITES - 1):
            assert rows(p, "SELECT external_id FROM memory.get_node(%s, %s)", f"load:{i}", project)


def test_the_bench_splits_a_corpus_by_project_with_its_parents() -> None:
    """bench-proxy loads each partition with its projects' nodes: parents renumbered within
    the subset, still pointing at the same nodes (no clusters needed)."""
    from poimen_lab.bench import synthetic
    from poimen_lab.bench.proxy import subset

    corpus = synthetic.generate(600, 8, 3, seed=1, projects=5)
    keep = set(sorted(set(corpus.projects))[:2])
    sub = subset(corpus, keep)
    idx = [i for i, p in enumerate(corpus.projects) if p in keep]
    assert sub.texts == [corpus.texts[i] for i in idx] and set(sub.projects) == keep
    assert any(sub.parents)
    for new, old in enumerate(idx):
        assert [sub.texts[p] for p in sub.parents[new]] == [
            corpus.texts[p] for p in corpus.parents[old]
        ]
