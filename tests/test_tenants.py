"""Tenants apart in Postgres (sql/085_tenants.sql): a role granted one project sees and
changes only that project, through every function and every table; top-k is computed
after the filter; the service's per-transaction project setting counts only for members
of poimen_memory_service. Roles are switched with SET ROLE, so RLS applies as it would to a
login of that role."""

from __future__ import annotations

import subprocess
from typing import Any

import psycopg
import pytest

from conftest import db_roles, make_role
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import ensure_service_login
from poimen_memory.embedders.local import LocalEmbedder

Conn = psycopg.Connection[Any]

KONG = "kong client body buffer size"
ALL = "ARRAY['L0','L1','L2']"


def _ids(conn: Conn, query: str, params: tuple[Any, ...] = ()) -> list[Any]:
    return [r[0] for r in conn.execute(query, params).fetchall()]


def _project_ids(conn: Conn) -> dict[str, int]:
    return dict(conn.execute("SELECT name, id FROM memory.projects").fetchall())  # type: ignore[arg-type]


@pytest.fixture
def reader(conn: Conn) -> Conn:
    make_role(conn, "tenant_reader", "reader")
    conn.execute("SELECT memory.grant_project('tenant_reader', 'poimen')")
    return conn


def _plant_atlas(conn: Conn, n: int) -> list[int]:
    """Atlas nodes that out-rank every poimen node for KONG (as the owner)."""
    pid = _project_ids(conn)["atlas"]
    return _ids(
        conn,
        "INSERT INTO memory.nodes (sha256, project_id, level, text)"
        " SELECT sha256(('plant' || i)::bytea), %s, 'L1',"
        "        repeat('kong client body buffer size ', 3) || i"
        " FROM generate_series(1, %s) i RETURNING id",
        (pid, n),
    )


def test_a_role_without_grants_sees_nothing(conn: Conn) -> None:
    make_role(conn, "tenant_nobody", "reader")
    conn.execute("SET ROLE tenant_nobody")
    for table in ("projects", "nodes", "edges", "postings", "term_stats", "corpus_stats",
                  "opensearch_outbox", "project_grants"):  # fmt: skip
        assert _ids(conn, f"SELECT count(*) FROM memory.{table}") == [0], table
    assert _ids(conn, "SELECT node_id FROM public.memory_query(%s)", (KONG,)) == []
    # A hidden project is indistinguishable from one that does not exist.
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT * FROM public.memory_query(%s, project => 'poimen')", (KONG,))
    assert exc.value.sqlstate == "PM404"


def test_every_function_and_table_shows_only_the_granted_project(
    reader: Conn, embedder: LocalEmbedder
) -> None:
    conn = reader
    pids = _project_ids(conn)
    atlas = _ids(conn, "SELECT id FROM memory.nodes WHERE project_id = %s", (pids["atlas"],))
    assert atlas
    vec = embedder.embed_query(KONG)
    conn.execute("SET ROLE tenant_reader")
    mine = pids["poimen"]
    assert _ids(conn, "SELECT name FROM memory.projects") == ["poimen"]
    for table in ("nodes", "postings", "term_stats", "corpus_stats"):
        assert set(_ids(conn, f"SELECT DISTINCT project_id FROM memory.{table}")) == {mine}
    edges = _ids(
        conn, "SELECT n.project_id FROM memory.edges e JOIN memory.nodes n ON n.id = e.child_id"
    )
    assert edges and set(edges) == {mine}
    assert _ids(conn, "SELECT count(*) FROM memory.edges WHERE child_id = ANY(%s)", (atlas,)) == [0]
    in_project = _ids(conn, "SELECT id FROM memory.nodes")
    calls: list[tuple[str, tuple[Any, ...]]] = [
        (f"SELECT node_id FROM public.memory_query(%s, levels => {ALL}, k => 50)", (KONG,)),
        ("SELECT node_id FROM memory.query(%s, %s, strategy => 'Hybrid', k => 50)", (KONG, vec)),
        ("SELECT node_id FROM memory.lexical_search(%s, k => 1000)", (KONG,)),
        ("SELECT node_id FROM memory.lexical_search(%s, k => 1000, exhaustive => true)", (KONG,)),
        ("SELECT node_id FROM memory.semantic_search(%s, k => 1000)", (vec,)),
        ("SELECT node_id FROM memory.exact_search(%s, k => 1000)", (vec,)),
        ("SELECT node_id FROM memory.search_by_ids(%s, %s, k => 1000)", (vec, atlas + in_project)),
        ("SELECT node_id FROM memory.hydrate(%s)", (atlas + in_project,)),
        ("SELECT parent_id FROM memory.provenance_walk(%s)", (atlas + in_project,)),
    ]
    for sql, params in calls:
        got = _ids(conn, sql, params)
        assert got and set(got) <= set(in_project), sql
    for nid in atlas:
        assert _ids(conn, "SELECT memory.provenance_tree(%s)", (nid,)) == [[]]
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT * FROM memory.lexical_search(%s, 'atlas')", (KONG,))
    assert exc.value.sqlstate == "PM404"


def test_top_k_is_computed_after_the_filter(reader: Conn, embedder: LocalEmbedder) -> None:
    """Hidden rows that would rank first take no slot: k rows of the visible project come
    back, with the scores of a query confined to that project (its own BM25 statistics)."""
    conn = reader
    planted = _plant_atlas(conn, 30)
    vec = embedder.embed_query(KONG)
    top_all = _ids(conn, "SELECT node_id FROM memory.lexical_search(%s, k => 3)", (KONG,))
    assert set(top_all) <= set(planted)  # the plants do out-rank everything
    want = {
        "lex": conn.execute(
            "SELECT node_id, lexical_score FROM memory.lexical_search(%s, 'poimen', k => 3)",
            (KONG,),
        ).fetchall(),
        "sem": conn.execute(
            "SELECT node_id, query_score FROM memory.semantic_search(%s, 'poimen', k => 3)", (vec,)
        ).fetchall(),
        "query": conn.execute(
            "SELECT node_id, final_score FROM public.memory_query(%s, project => 'poimen',"
            f" levels => {ALL}, k => 3)",
            (KONG,),
        ).fetchall(),
    }
    assert len(want["lex"]) == len(want["sem"]) == len(want["query"]) == 3
    conn.execute("SET ROLE tenant_reader")
    got = {
        "lex": conn.execute(
            "SELECT node_id, lexical_score FROM memory.lexical_search(%s, k => 3)", (KONG,)
        ).fetchall(),
        "sem": conn.execute(
            "SELECT node_id, query_score FROM memory.semantic_search(%s, k => 3)", (vec,)
        ).fetchall(),
        "query": conn.execute(
            f"SELECT node_id, final_score FROM public.memory_query(%s, levels => {ALL}, k => 3)",
            (KONG,),
        ).fetchall(),
    }
    assert got == want


def test_a_writer_changes_only_its_writable_project(conn: Conn) -> None:
    make_role(conn, "tenant_writer", "writer")
    conn.execute("SELECT memory.grant_project('tenant_writer', 'poimen', write => true)")
    conn.execute("SELECT memory.grant_project('tenant_writer', 'atlas')")  # read-only
    pids = _project_ids(conn)
    first = "SELECT min(id) FROM memory.nodes WHERE project_id = %s AND level = 'L1'"
    atlas_node = _ids(conn, first, (pids["atlas"],))[0]
    poimen_node = _ids(conn, first, (pids["poimen"],))[0]
    zebra = "SELECT df FROM memory.term_stats WHERE project_id = %s AND lexeme = 'zebra'"
    df_before = _ids(conn, zebra, (pids["poimen"],))
    conn.execute("SET ROLE tenant_writer")
    insert = ("INSERT INTO memory.nodes (sha256, project_id, level, text)"
              " VALUES (sha256(%s::bytea), %s, 'L1', 'zebra crossing')")  # fmt: skip
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # new row violates RLS
        conn.execute(insert, (b"a", pids["atlas"]))
    update = conn.execute("UPDATE memory.nodes SET text = 'x' WHERE id = %s", (atlas_node,))
    assert update.rowcount == 0
    delete = conn.execute("DELETE FROM memory.nodes WHERE id = %s", (atlas_node,))
    assert delete.rowcount == 0
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # moving a node out
        conn.execute(
            "UPDATE memory.nodes SET project_id = %s WHERE id = %s", (pids["atlas"], poimen_node)
        )
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # an edge into a read-only project
        conn.execute(
            "INSERT INTO memory.edges (child_id, parent_id, project_id) VALUES (%s, %s, %s)",
            (atlas_node, atlas_node + 1, pids["atlas"]),
        )
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("INSERT INTO memory.projects (name) VALUES ('elsewhere')")
    # Its own project it writes, and the statistics triggers (SECURITY DEFINER) follow.
    conn.execute(insert, (b"b", pids["poimen"]))
    conn.execute("RESET ROLE")
    df_after = _ids(conn, zebra, (pids["poimen"],))
    assert df_after == [(df_before or [0])[0] + 1]
    assert _ids(conn, "SELECT text FROM memory.nodes WHERE id = %s", (atlas_node,)) != ["x"]


def test_a_writer_is_recorded_as_who_it_is(conn: Conn) -> None:
    """written_by and ended_by are the database's record (memory._writer()): a SQL writer
    that sets them to an API key's id is refused, one that leaves written_by out is filled
    in; the writer and forget, which set them themselves, pass; the owner (a restore)
    writes history as it was."""
    make_role(conn, "tenant_scribe", "writer")
    conn.execute("SELECT memory.grant_project('tenant_scribe', 'poimen', write => true)")
    pid = _project_ids(conn)["poimen"]
    insert = ("INSERT INTO memory.nodes (sha256, project_id, level, external_id, text{})"
              " VALUES (sha256(%s::bytea), %s, 'L0', %s, 'a turn'{}) RETURNING id")  # fmt: skip
    conn.execute("SET ROLE tenant_scribe")
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as exc:
        conn.execute(insert.format(", written_by", ", 'api_key:1'"), (b"f1", pid, "forged:1"))
    assert (
        "written_by is recorded by the database: this session writes as role:tenant_scribe"
        in str(exc.value)
    )
    assert exc.value.diag.message_detail == "written_by was set to 'api_key:1'"
    own = conn.execute(insert.format("", ""), (b"f2", pid, "plain:1")).fetchone()
    assert own is not None
    named = conn.execute(
        insert.format(", written_by", ", 'role:tenant_scribe'"), (b"f3", pid, "plain:2")
    ).fetchone()
    assert named is not None
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(
            "UPDATE memory.nodes SET expired_at = now(), ended_by = 'api_key:1' WHERE id = %s", own
        )
    # forget sets ended_by itself, and erasing again keeps it
    conn.execute("SELECT memory.forget('poimen', ARRAY['plain:1'])")
    conn.execute("SELECT memory.forget('poimen', ARRAY['plain:1'], erase => true)")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # nor cleared
        conn.execute("UPDATE memory.nodes SET ended_by = NULL WHERE id = %s", own)
    # a version ended by hand, naming nobody: this session ended it
    conn.execute(
        "UPDATE memory.nodes SET expired_at = now(), end_reason = 'retired' WHERE id = %s", named
    )
    conn.execute("RESET ROLE")
    # who ended a version is not rewritten, even to the writer's own name
    make_role(conn, "tenant_other", "writer")
    conn.execute("SELECT memory.grant_project('tenant_other', 'poimen', write => true)")
    conn.execute("SET ROLE tenant_other")
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as exc:
        conn.execute("UPDATE memory.nodes SET ended_by = 'role:tenant_other' WHERE id = %s", own)
    assert exc.value.diag.message_detail == (
        "ended_by was set to 'role:tenant_other' (it was 'role:tenant_scribe')"
    )
    conn.execute("RESET ROLE")
    rows = conn.execute(
        "SELECT external_id, written_by, ended_by FROM memory.nodes"
        " WHERE id = ANY (%s) ORDER BY id",
        ([own[0], named[0]],),
    ).fetchall()
    assert rows == [("plain:1", "role:tenant_scribe", "role:tenant_scribe"),
                    ("plain:2", "role:tenant_scribe", "role:tenant_scribe")]  # fmt: skip
    # the owner writes history as it was (pg_restore runs as the owner)
    kept = conn.execute(
        insert.format(", written_by", ", 'api_key:1'"), (b"f4", pid, "restored:1")
    ).fetchone()
    assert kept is not None
    assert _ids(conn, "SELECT written_by FROM memory.nodes WHERE id = %s", kept) == ["api_key:1"]


def test_edges_stay_within_one_project_and_follow_its_grants(conn: Conn) -> None:
    """An edge carries its project (migration 0009): one joining two projects is refused by
    its foreign keys, whichever project it names, so no edge can leak a hidden node's id;
    an edge is seen and changed exactly like its project's nodes."""
    make_role(conn, "tenant_reader", "reader")
    conn.execute("SELECT memory.grant_project('tenant_reader', 'poimen')")
    make_role(conn, "tenant_edger", "writer")
    conn.execute("SELECT memory.grant_project('tenant_edger', 'poimen', write => true)")
    conn.execute("SELECT memory.grant_project('tenant_edger', 'atlas')")  # read-only
    pids = _project_ids(conn)
    first = "SELECT min(id) FROM memory.nodes WHERE project_id = %s"
    child = _ids(conn, first, (pids["poimen"],))[0]
    parent = _ids(conn, first, (pids["atlas"],))[0]
    for project in ("poimen", "atlas"):
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute(
                "INSERT INTO memory.edges (child_id, parent_id, project_id) VALUES (%s, %s, %s)",
                (child, parent, pids[project]),
            )
    count = "SELECT count(*) FROM memory.edges WHERE project_id = %s"
    atlas_edges = _ids(conn, count, (pids["atlas"],))[0]
    assert atlas_edges > 0 and _ids(conn, count, (pids["poimen"],))[0] > 0
    conn.execute("SET ROLE tenant_reader")
    assert _ids(conn, "SELECT DISTINCT project_id FROM memory.edges") == [pids["poimen"]]
    conn.execute("RESET ROLE")
    conn.execute("SET ROLE tenant_edger")  # reads atlas, writes only poimen
    assert _ids(conn, count, (pids["atlas"],)) == [atlas_edges]
    update = "UPDATE memory.edges SET precedence = precedence + 7 WHERE project_id = %s"
    assert conn.execute(update, (pids["atlas"],)).rowcount == 0
    assert (
        conn.execute("DELETE FROM memory.edges WHERE project_id = %s", (pids["atlas"],)).rowcount
        == 0
    )
    assert conn.execute(update, (pids["poimen"],)).rowcount > 0  # the control
    conn.execute("RESET ROLE")
    assert _ids(conn, count, (pids["atlas"],)) == [atlas_edges]


def test_the_project_setting_counts_only_for_the_service_role(conn: Conn) -> None:
    make_role(conn, "tenant_plain", "writer")
    make_role(conn, "tenant_service", "service")
    conn.execute("SELECT memory.grant_project('tenant_plain', 'poimen')")
    pids = _project_ids(conn)
    for who in ("tenant_plain", "tenant_service"):
        conn.execute(f"SET ROLE {who}")
        with conn.transaction():
            conn.execute("SELECT set_config('poimen.read_projects', 'atlas', true)")
            seen = set(_ids(conn, "SELECT DISTINCT project_id FROM memory.nodes"))
            hits = _ids(conn, "SELECT project FROM public.memory_query(%s)", (KONG,))
        with conn.transaction(force_rollback=True):
            conn.execute("SELECT set_config('poimen.read_projects', '*', true)")
            conn.execute("SELECT set_config('poimen.write_projects', '*', true)")
            star = set(_ids(conn, "SELECT DISTINCT project_id FROM memory.nodes"))
            deleted = conn.execute("DELETE FROM memory.edges").rowcount
        conn.execute("RESET ROLE")
        if who == "tenant_plain":
            assert seen == {pids["poimen"]} and set(hits) <= {"poimen"}
            assert star == {pids["poimen"]} and deleted == 0
        else:
            assert seen == {pids["atlas"]} and hits and set(hits) == {"atlas"}
            assert star == set(pids.values()) and deleted > 0
    # Outside a transaction that asserts projects, the service role sees nothing.
    conn.execute("SET ROLE tenant_service")
    assert _ids(conn, "SELECT count(*) FROM memory.nodes") == [0]


def test_asserted_projects_replace_the_service_roles_own_grants(conn: Conn) -> None:
    """A key is the tenant: while the service's role asserts projects it sees those alone,
    so a project granted to the role itself does not reach every key; with nothing asserted
    its own grants count, as any role's do."""
    make_role(conn, "tenant_service_granted", "service")
    conn.execute("SELECT memory.grant_project('tenant_service_granted', 'poimen', true)")
    pids = _project_ids(conn)
    conn.execute("SET ROLE tenant_service_granted")
    try:
        with conn.transaction():
            conn.execute("SELECT set_config('poimen.read_projects', 'atlas', true)")
            seen = set(_ids(conn, "SELECT DISTINCT project_id FROM memory.nodes"))
            names = _ids(conn, "SELECT name FROM memory.projects")
            granted = conn.execute("SELECT memory.granted_projects()").fetchone()
            writable = _ids(conn, "SELECT unnest(memory.granted_project_ids(true))")
        with conn.transaction():
            conn.execute("SELECT set_config('poimen.read_projects', 'atlas,poimen,atlas', true)")
            both = conn.execute("SELECT memory.granted_projects()").fetchone()
        own = set(_ids(conn, "SELECT DISTINCT project_id FROM memory.nodes"))
    finally:
        conn.execute("RESET ROLE")
    assert seen == {pids["atlas"]} and names == ["atlas"] and granted == (["atlas"],)
    assert writable == []  # its own write grant is of poimen, and writing needs reading
    assert both == (["atlas", "poimen"],)  # distinct and sorted
    assert own == {pids["poimen"]}


@pytest.mark.parametrize(
    ("grant", "read", "write", "readable", "writable"),
    [
        (None, "atlas", "", ["atlas"], []),
        (None, "atlas,nowhere,atlas", "", ["atlas"], []),  # a name without a project: no id
        (None, "atlas,*", "", None, []),  # '*' among names is every project
        (None, "*", "atlas", None, ["atlas"]),
        (None, "atlas", "poimen", ["atlas"], []),  # writing needs reading
        (None, "atlas,poimen", "atlas", ["atlas", "poimen"], ["atlas"]),
        (None, "atlas", "*", ["atlas"], ["atlas"]),
        (None, "", "atlas", [], []),  # no read asserted: the role's own grants (none)
        # nothing read asserted: the role's own read grants are what writing may reach
        ("atlas", "", "atlas", ["atlas"], ["atlas"]),
        ("atlas", "", "poimen", ["atlas"], []),
        ("*", "", "poimen", None, ["poimen"]),
        ("*", "atlas", "poimen", ["atlas"], []),  # asserted, its grants do not count
    ],
)
def test_the_service_s_asserted_names_resolve_to_exactly_their_ids(
    conn: Conn,
    grant: str | None,
    read: str,
    write: str,
    readable: list[str] | None,
    writable: list[str],
) -> None:
    """memory._granted_ids resolves the service's names past memory.projects' policy
    (memory._asserted_project_ids, SECURITY DEFINER): the ids are those names' and no
    others', writing stays within reading, and '*' still means every project (NULL)."""
    make_role(conn, "tenant_service_ids", "service")
    if grant is not None:
        conn.execute("SELECT memory.grant_project('tenant_service_ids', %s)", (grant,))
    pids = _project_ids(conn)
    conn.execute("SET ROLE tenant_service_ids")
    try:
        with conn.transaction():
            conn.execute("SELECT set_config('poimen.read_projects', %s, true)", (read,))
            conn.execute("SELECT set_config('poimen.write_projects', %s, true)", (write,))
            got = conn.execute(
                "SELECT memory._granted_ids(false), memory._granted_ids(true)"
            ).fetchone()
    finally:
        conn.execute("RESET ROLE")
    assert got is not None
    assert got[0] == (None if readable is None else sorted(pids[n] for n in readable))
    assert got[1] == sorted(pids[n] for n in writable)


def test_only_the_service_may_resolve_project_names_past_row_level_security(conn: Conn) -> None:
    """The lookup behind the service's names would tell any caller which project names
    exist: a reader or writer may not run it, the service's role may."""
    make_role(conn, "tenant_peeker", "writer")
    make_role(conn, "tenant_service_lookup", "service")
    pids = _project_ids(conn)
    conn.execute("SET ROLE tenant_peeker")
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
            conn.execute("SELECT memory._asserted_project_ids('{atlas}')")
    finally:
        conn.execute("RESET ROLE")
    conn.execute("SET ROLE tenant_service_lookup")
    try:
        got = conn.execute("SELECT memory._asserted_project_ids('{atlas,poimen}')").fetchone()
    finally:
        conn.execute("RESET ROLE")
    assert got == (sorted([pids["atlas"], pids["poimen"]]),)


def test_grants_follow_roles_by_name_quoted_and_dropped(conn: Conn) -> None:
    """memory.project_grants keeps roles by name; each name is resolved as an identifier
    (a name that needs quoting still grants), and a dropped role's grant grants nothing
    and breaks nobody's queries. In a transaction rolled back: roles are the cluster's."""
    pids = _project_ids(conn)
    with conn.transaction(force_rollback=True):
        conn.execute('CREATE ROLE "Tenant Quoted" NOLOGIN')
        conn.execute("CREATE ROLE tenant_dropped NOLOGIN")
        conn.execute(f'GRANT "{db_roles(conn).reader}" TO "Tenant Quoted"')
        conn.execute("""SELECT memory.grant_project('"Tenant Quoted"', 'atlas')""")
        conn.execute("SELECT memory.grant_project('tenant_dropped', 'poimen')")
        conn.execute("DROP ROLE tenant_dropped")
        assert _ids(conn, "SELECT count(*) FROM memory.project_grants"
                    " WHERE role_name = 'tenant_dropped'") == [1]  # fmt: skip
        assert "poimen" not in conn.execute("SELECT memory.granted_projects()").fetchone()[0]
        conn.execute('SET LOCAL ROLE "Tenant Quoted"')
        seen = set(_ids(conn, "SELECT DISTINCT project_id FROM memory.nodes"))
        assert seen == {pids["atlas"]}


def test_the_policies_work_when_memory_service_does_not_exist(conn: Conn) -> None:
    """A restore without the cluster's roles (pg_restore without pg_dumpall --globals): the
    role is renamed away inside a transaction that is rolled back, so no other test sees it.
    Grants still work, and the project setting counts for nobody."""
    make_role(conn, "tenant_reader", "reader")
    conn.execute("SELECT memory.grant_project('tenant_reader', 'poimen')")
    pids = _project_ids(conn)
    with conn.transaction(force_rollback=True):
        conn.execute("ALTER ROLE poimen_memory_service RENAME TO memory_service_restored_without")
        assert _ids(conn, "SELECT to_regrole('poimen_memory_service')") == [None]
        conn.execute("SET LOCAL ROLE tenant_reader")
        conn.execute("SELECT set_config('poimen.read_projects', 'atlas', true)")
        seen = set(_ids(conn, "SELECT DISTINCT project_id FROM memory.nodes"))
        hits = _ids(conn, "SELECT project FROM public.memory_query(%s)", (KONG,))
    assert seen == {pids["poimen"]} and hits and set(hits) == {"poimen"}
    assert _ids(conn, "SELECT to_regrole('poimen_memory_service') IS NOT NULL") == [True]


def test_grant_and_revoke(conn: Conn) -> None:
    make_role(conn, "tenant_granted", "reader")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT memory.grant_project('tenant_granted', 'no spaces')")
    with pytest.raises(psycopg.errors.UndefinedObject):
        conn.execute("SELECT memory.grant_project('no_such_role_here', 'poimen')")
    conn.execute("SELECT memory.grant_project('tenant_granted', '*')")
    conn.execute("SELECT memory.grant_project('poimen_memory_writer', 'atlas', write => true)")
    conn.execute("SET ROLE tenant_granted")
    # '*' is every project; each role sees its own grants only.
    assert sorted(_ids(conn, "SELECT name FROM memory.projects")) == ["atlas", "poimen"]
    assert _ids(conn, "SELECT role_name::text FROM memory.project_grants") == ["tenant_granted"]
    conn.execute("RESET ROLE")
    assert _ids(conn, "SELECT memory.revoke_project('tenant_granted', '*')") == [True]
    assert _ids(conn, "SELECT memory.revoke_project('tenant_granted', '*')") == [False]
    conn.execute("SET ROLE tenant_granted")
    assert _ids(conn, "SELECT count(*) FROM memory.nodes") == [0]


def test_from_psql_the_setting_helps_only_the_service_role(conn: Conn, cluster: Cluster) -> None:
    """The same rule through the real psql client, logged in (peer) as the service's role
    and as the superuser switched to a plain role."""
    ensure_service_login(conn, "poimen_service")
    make_role(conn, "tenant_plain", "writer")
    conn.execute("SELECT memory.grant_project('tenant_plain', 'poimen')")
    seen = (
        "SELECT coalesce(string_agg(DISTINCT p.name, ','), '-') FROM memory.nodes n"
        " JOIN memory.projects p ON p.id = n.project_id"
    )
    claim = "SELECT set_config('poimen.read_projects', 'atlas', false)"

    def psql(user: str, *commands: str) -> str:
        args = [str(cluster.bin_dir / "psql"), "-X", "-qtA", "-v", "ON_ERROR_STOP=1"]
        args += ["-h", str(cluster.socket_dir), "-p", str(cluster.port), "-U", user]
        args += ["-d", str(conn.info.dbname)]
        for c in commands:
            args += ["-c", c]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1]

    assert psql("poimen_service", seen) == "-"
    assert psql("poimen_service", claim, seen) == "atlas"
    assert psql("postgres", "SET ROLE tenant_plain", seen) == "poimen"
    assert psql("postgres", "SET ROLE tenant_plain", claim, seen) == "poimen"


def _grant_set(conn: Conn, role: str) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT read_names, write_names, read_ids, write_ids FROM memory.grant_sets"
        " WHERE role_name = %s",
        (role,),
    ).fetchone()


def test_grant_sets_follow_grants_and_projects(conn: Conn) -> None:
    """memory.grant_sets, which the policies read (one row per role), is what
    memory.project_grants and memory.projects say after every change: a grant of a project
    not yet made gets its id when it is made, a revoke or a dropped project takes it away,
    and migrate mends a row edited by hand."""
    make_role(conn, "tenant_sets", "writer")
    pids = _project_ids(conn)
    conn.execute("SELECT memory.grant_project('tenant_sets', 'poimen', true)")
    conn.execute("SELECT memory.grant_project('tenant_sets', 'later')")
    assert _grant_set(conn, "tenant_sets") == (
        ["later", "poimen"],
        ["poimen"],
        [pids["poimen"]],
        [pids["poimen"]],
    )
    conn.execute("INSERT INTO memory.projects (name) VALUES ('later')")
    later = _project_ids(conn)["later"]
    assert _grant_set(conn, "tenant_sets") == (
        ["later", "poimen"],
        ["poimen"],
        sorted([pids["poimen"], later]),
        [pids["poimen"]],
    )
    conn.execute("SET ROLE tenant_sets")
    try:
        assert sorted(_ids(conn, "SELECT unnest(memory.granted_project_ids())")) == sorted(
            [pids["poimen"], later]
        )
        assert _ids(conn, "SELECT unnest(memory.granted_project_ids(true))") == [pids["poimen"]]
    finally:
        conn.execute("RESET ROLE")
    conn.execute("DELETE FROM memory.projects WHERE name = 'later'")
    assert _grant_set(conn, "tenant_sets") == (
        ["later", "poimen"],
        ["poimen"],
        [pids["poimen"]],
        [pids["poimen"]],
    )
    conn.execute("SELECT memory.revoke_project('tenant_sets', 'poimen')")
    assert _grant_set(conn, "tenant_sets") == (["later"], [], [], [])
    # A row edited by hand (or restored from an older dump) is rebuilt by migrate's files.
    conn.execute("UPDATE memory.grant_sets SET read_ids = %s WHERE role_name = 'tenant_sets'",
                 ([pids["atlas"]],))  # fmt: skip
    conn.execute("SELECT memory._refresh_grant_sets(NULL, NULL, true)")
    assert _grant_set(conn, "tenant_sets") == (["later"], [], [], [])
    conn.execute("SELECT memory.revoke_project('tenant_sets', 'later')")
    assert _grant_set(conn, "tenant_sets") is None
    conn.execute("SELECT memory.grant_project('tenant_sets', 'atlas')")
    conn.execute("TRUNCATE memory.project_grants")
    assert conn.execute("SELECT count(*) FROM memory.grant_sets").fetchone() == (0,)


def test_a_grant_waits_for_the_project_being_made(conn: Conn, fixture_url: str) -> None:
    """A grant made while another transaction is making the project it names waits for
    that transaction, then records the project's id: without the wait, each would have
    read the other's change as not yet there and the grant would never see the project's
    rows."""
    make_role(conn, "tenant_race", "reader")
    with psycopg.connect(fixture_url) as maker, psycopg.connect(fixture_url) as granter:
        maker.execute("INSERT INTO memory.projects (name) VALUES ('racing')")
        granter.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            granter.execute("SELECT memory.grant_project('tenant_race', 'racing')")
        granter.rollback()
        done: list[BaseException | None] = []

        import threading

        def grant() -> None:
            try:
                granter.execute("SET lock_timeout = '20s'")
                granter.execute("SELECT memory.grant_project('tenant_race', 'racing')")
                granter.commit()
                done.append(None)
            except BaseException as e:  # reported below
                done.append(e)

        t = threading.Thread(target=grant)
        t.start()
        t.join(0.5)
        assert t.is_alive(), "the grant did not wait for the project being made"
        maker.commit()
        t.join(30)
        assert done == [None]
    racing = _project_ids(conn)["racing"]
    assert _grant_set(conn, "tenant_race") == (["racing"], [], [racing], [])


def test_other_roles_grants_are_not_read(conn: Conn) -> None:
    """A role's check reads one row of memory.grant_sets, whatever other roles hold: the
    rows a reader's lookup touches do not grow with another role's 500 grants."""
    make_role(conn, "tenant_small", "reader")
    make_role(conn, "tenant_wide", "reader")
    conn.execute("SELECT memory.grant_project('tenant_small', 'poimen')")
    conn.execute(
        "INSERT INTO memory.project_grants (role_name, project)"
        " SELECT 'tenant_wide', 'p' || i FROM generate_series(1, 500) i"
    )
    # The other role's 500 grants are one row of the table a check reads, and that row is
    # not shown to this role (read through the plan's counts in every SQL mode alike: the
    # owner's count and the role's).
    assert _ids(
        conn,
        "SELECT count(*) FROM memory.grant_sets WHERE role_name IN ('tenant_small', 'tenant_wide')",
    ) == [2]
    conn.execute("SET ROLE tenant_small")
    try:
        assert _ids(conn, "SELECT memory.granted_projects()") == [["poimen"]]
        seen = _ids(conn, "SELECT role_name FROM memory.grant_sets")
    finally:
        conn.execute("RESET ROLE")
    assert seen == ["tenant_small"]
