-- Reading nodes by id, and listing a project's nodes (issue 24): memory.get_node and
-- memory.list_nodes, what GET /memory/nodes/{id} and GET /memory/nodes call. SECURITY
-- INVOKER (the default): row-level security decides what a caller sees, so a node of a
-- project the caller may not read is as unknown as one that never existed.

-- A node's links, bounded: at most this many parents or children are listed (the counts
-- say how many there are).
CREATE OR REPLACE FUNCTION memory._links_max()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN 100;
COMMENT ON FUNCTION memory._links_max() IS
    'The most parents or children memory.get_node lists (100); parents_total and children_total count them all.';

-- The rows they return, declared once (memory._declare_row) for the public function and
-- the implementation it calls: memory.node_row, one node with its links and support
-- (memory.get_node), and memory.node_list_row, a node of a page (memory.list_nodes).
SELECT memory._declare_row('node_row',
    'node_id bigint, external_id text, project text, level text, sha256 text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, metadata jsonb, created_at timestamptz, parents jsonb, parents_total integer, children jsonb, children_total integer, parents_declared integer, support text, versions jsonb, valid_from timestamptz, valid_to timestamptz, revision integer');
SELECT memory._declare_row('node_list_row',
    'node_id bigint, external_id text, project text, level text, sha256 text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, metadata jsonb, created_at timestamptz, support text, cursor text, valid_from timestamptz, valid_to timestamptz, expires_at timestamptz, revision integer');

-- p_projects: a filter the service passes, the API key's projects, so a key never reaches
-- beyond them, even over a pool whose role skips row-level security.
CREATE OR REPLACE FUNCTION memory._get_node(p_id text, p_project text, p_projects text[])
RETURNS SETOF memory.node_row
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer := memory.project_id(p_project);
    found_in text[];
    n record;
    -- the node is its current version, unless its expiry has passed (memory._visible)
    vis memory.visibility := memory._visibility(project_id => pid, live_at => now());
BEGIN
    IF p_id IS NULL OR p_id = '' THEN
        RAISE EXCEPTION 'id must not be empty'
            USING ERRCODE = '22023', HINT = 'Pass the node''s id as ingested (its external_id).';
    END IF;
    -- The projects (visible to the caller) holding a current version of this id: ids are
    -- unique per project, not across projects. A node's ended versions (superseded, retired,
    -- erased: docs/lifecycle.md) are its history (memory.history), not the node: a retired
    -- or erased node is unknown here, and an updated one is its current version.
    -- A node whose expiry has passed (expires_at, migration 0021) has left answers: it is
    -- unknown here too, though current until poimen-memory expire ends it.
    found_in := ARRAY(SELECT p.name FROM memory.nodes x JOIN memory.projects p ON p.id = x.project_id
                      WHERE x.external_id = p_id AND memory._visible(x, vis)
                        AND (p_projects IS NULL OR p.name = ANY (p_projects))
                      ORDER BY p.name);
    IF cardinality(found_in) = 0 THEN
        RAISE EXCEPTION 'no node with id "%"%', p_id,
                        CASE WHEN pid IS NULL THEN '' ELSE format(' in project "%s"', p_project) END
            USING ERRCODE = @vocabulary.sqlstate_unknown_node@,
                  HINT = 'Ids are the ones given at ingest (external_id), unique per project.';
    END IF;
    IF cardinality(found_in) > 1 THEN
        RAISE EXCEPTION 'id "%" names nodes in % projects', p_id, cardinality(found_in)
            USING ERRCODE = @vocabulary.sqlstate_ambiguous_node@,
                  DETAIL = format('Projects: %s.', array_to_string(found_in, ', ')),
                  HINT = 'Name the project (project => ...): ids are unique per project.';
    END IF;
    SELECT x.* INTO n FROM memory.nodes x JOIN memory.projects p ON p.id = x.project_id
    WHERE x.external_id = p_id AND p.name = found_in[1] AND memory._visible(x, vis);
    RETURN QUERY
    SELECT n.id, n.external_id, found_in[1], n.level, encode(n.sha256, 'hex'), n.title, n.text,
           n.source, n.breadcrumb, n.ts, n.metadata, n.created_at,
           -- Each parent once, by external id: the version this node rests on (the newest
           -- version of the id it has an edge to, as memory._rested_parents reads it: a new
           -- version of a parent leaves it on the old one, stale, until it is rewritten or
           -- confirmed), with the parent's current revision (NULL: retired or erased).
           (SELECT coalesce(jsonb_agg(jsonb_build_object(
                       'node_id', l.id, 'external_id', l.external_id, 'level', l.level,
                       'precedence', l.precedence, 'revision', l.revision,
                       'current_revision', l.current_revision) ORDER BY l.precedence, l.id), '[]')
            FROM (SELECT d.*,
                         (SELECT c.revision FROM memory.nodes c
                          WHERE c.external_id = d.external_id AND c.project_id = d.project_id
                            AND c.expired_at IS NULL) AS current_revision
                  FROM (SELECT DISTINCT ON (coalesce(q.external_id, q.id::text))
                               q.id, q.external_id, q.level, q.revision, q.project_id,
                               e.precedence
                        FROM memory.edges e
                        JOIN memory.nodes q ON q.id = e.parent_id AND q.project_id = e.project_id
                        WHERE e.child_id = n.id AND e.project_id = n.project_id
                        ORDER BY coalesce(q.external_id, q.id::text), q.revision DESC) d
                  ORDER BY d.precedence, d.id LIMIT memory._links_max()) l),
           (SELECT count(DISTINCT coalesce(q.external_id, q.id::text))::integer
            FROM memory.edges e
            JOIN memory.nodes q ON q.id = e.parent_id AND q.project_id = e.project_id
            WHERE e.child_id = n.id AND e.project_id = n.project_id),
           (SELECT coalesce(jsonb_agg(jsonb_build_object(
                       'node_id', l.id, 'external_id', l.external_id, 'level', l.level)
                       ORDER BY l.id), '[]')
            FROM (SELECT q.id, q.external_id, q.level
                  FROM memory.edges e
                  JOIN memory.nodes q ON q.id = e.child_id AND q.project_id = e.project_id
                  WHERE e.parent_id = n.id AND e.project_id = n.project_id
                  ORDER BY q.id LIMIT memory._links_max()) l),
           (SELECT count(*)::integer FROM memory.edges e
            WHERE e.parent_id = n.id AND e.project_id = n.project_id),
           n.parents_declared,
           (SELECT s.support FROM memory._support_at(ARRAY[n.id]) s),
           -- Versions: memory.history lists them (GET /memory/nodes/{id}/history).
           NULL::jsonb,
           n.valid_from, n.valid_to, n.revision;
END $$;
COMMENT ON FUNCTION memory._get_node(text, text, text[]) IS
    'Implementation of memory.get_node (positional parameter names: PL/pgSQL forbids a parameter named like a result column); p_projects (NULL: no filter) keeps to those projects: the service passes the API key''s.';

CREATE OR REPLACE FUNCTION memory.get_node(id text, project text DEFAULT NULL)
RETURNS SETOF memory.node_row
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT * FROM memory._get_node(id, project, NULL);
END;
COMMENT ON FUNCTION memory.get_node(text, text) IS
    'One node by its id (the external id given at ingest, or generated for a node written without one; unique per project), its revision, with its parents (each once per external id: the version it rests on, the newest it has an edge to, with node_id, external_id, level, precedence, revision, and current_revision, NULL when that parent has no current version; at most 100, parents_total counts them) and children (node_id, external_id, level; at most 100, children_total), parents_declared (the parents it was written with) and support (memory._support_at: full, stale, partial, none). project names the project; without it the id must be unique among the projects the caller can read (PMA09 lists them otherwise). The node is its current version: no such node, one with no current version (retired or erased; memory.history lists its versions), or one the caller may not read: PM444. versions is NULL (memory.history lists them).';

-- The cursor of memory.list_nodes: opaque to callers, the last node id of a page.
CREATE OR REPLACE FUNCTION memory._node_cursor(node_id bigint)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN translate(encode(convert_to('n1:' || node_id::text, 'UTF8'), 'base64'), '+/=', '-_');
COMMENT ON FUNCTION memory._node_cursor(bigint) IS
    'The opaque cursor memory.list_nodes returns for a row (URL-safe base64 of a versioned node id).';

CREATE OR REPLACE FUNCTION memory._node_after(cursor text)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    raw text;
    padded text := translate(cursor, '-_', '+/');
BEGIN
    IF cursor IS NULL OR cursor = '' THEN
        RETURN NULL;
    END IF;
    BEGIN
        padded := padded || repeat('=', (4 - length(padded) % 4) % 4);
        raw := convert_from(decode(padded, 'base64'), 'UTF8');
    EXCEPTION WHEN OTHERS THEN
        raw := NULL;
    END;
    IF raw IS NULL OR raw !~ '^n1:[0-9]{1,18}$' THEN
        RAISE EXCEPTION 'after is not a cursor of memory.list_nodes: %', left(cursor, 40)
            USING ERRCODE = '22023',
                  HINT = 'Pass the next_cursor (HTTP) or the cursor of the last row (SQL) of the previous page.';
    END IF;
    RETURN substr(raw, 4)::bigint;
END $$;
COMMENT ON FUNCTION memory._node_after(text) IS
    'The node id a memory.list_nodes cursor stands for (22023 for anything else); NULL or empty: from the start.';

-- What memory.list_nodes and memory.count_nodes list, checked once for both: the current
-- versions whose expiry has not passed, of the project (PM404 when unknown), level, time
-- range (since/until as memory.query's) and metadata filter given.
CREATE OR REPLACE FUNCTION memory._listing_visibility(
    project text, level text, since text, until text, filter jsonb
)
RETURNS memory.visibility
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer := memory.project_id(project);
    flt jsonb := memory.check_filter(filter);
    tr record;
BEGIN
    IF level IS NOT NULL AND NOT level = ANY (@vocabulary.levels@) THEN
        RAISE EXCEPTION 'level must be one of L0, L1, L2, got %', level
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO tr FROM memory.time_range(since, until);
    RETURN memory._visibility(project_id => pid,
                              levels => CASE WHEN level IS NOT NULL THEN ARRAY[level] END,
                              since => tr.since_ts, before => tr.before_ts, filter => flt,
                              live_at => now());
END $$;
COMMENT ON FUNCTION memory._listing_visibility(text, text, text, text, jsonb) IS
    'The visibility (memory.visibility) memory.list_nodes and memory.count_nodes list: current versions whose expiry has not passed, of the project, level, since/until and metadata filter given, each checked (PM404, 22023).';

-- The WHERE clause of memory.list_nodes and memory.count_nodes, one text for both: the
-- listing's visibility ($1, memory._visible) and the other filters given, as $2.. of the
-- parameters both pass in the same order (visibility, after, source, projects). Dynamic, so
-- that the planner sees which filters there are, and the visibility as a constant: a
-- project's nodes by one index range of nodes_project_id_idx (project_id, id) read in id
-- order, a metadata filter by the partial GIN index nodes_metadata_current_gin, whose
-- predicate (expired_at IS NULL) the inlined memory._visible states.
CREATE OR REPLACE FUNCTION memory._nodes_where(
    has_after boolean, has_source boolean, has_projects boolean, newest_first boolean DEFAULT false
)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN ' WHERE memory._visible(n, $1::memory.visibility)'
    || CASE WHEN NOT has_after THEN '' WHEN newest_first THEN ' AND n.id < $2' ELSE ' AND n.id > $2' END
    || CASE WHEN has_source THEN ' AND n.source = $3' ELSE '' END
    || CASE WHEN has_projects THEN
           ' AND n.project_id = ANY (ARRAY(SELECT p.id FROM memory.projects p
                                           WHERE p.name = ANY ($4)))' ELSE '' END;
COMMENT ON FUNCTION memory._nodes_where(boolean, boolean, boolean, boolean) IS
    'The WHERE clause memory.list_nodes and memory.count_nodes run ($1: the listing''s visibility, memory._listing_visibility, tested by memory._visible; after: node ids above $2, or below it newest first; $3 source; $4 projects), so that the two always agree.';

CREATE OR REPLACE FUNCTION memory._list_nodes(
    p_project text, p_level text, p_source text, p_since text, p_until text, p_after text,
    p_limit integer, p_projects text[], p_filter jsonb DEFAULT NULL,
    p_newest_first boolean DEFAULT false
)
RETURNS SETOF memory.node_list_row
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    vis memory.visibility := memory._listing_visibility(p_project, p_level, p_since, p_until, p_filter);
    after_id bigint := memory._node_after(p_after);
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 100 THEN
        RAISE EXCEPTION 'limit must be between 1 and 100, got %', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = '22023', HINT = 'Page with after => the last row''s cursor.';
    END IF;
    RETURN QUERY EXECUTE
        'SELECT n.id, n.external_id,
                (SELECT p.name::text FROM memory.projects p WHERE p.id = n.project_id),
                n.level, encode(n.sha256, ''hex''), n.title, n.text, n.source, n.breadcrumb,
                n.ts, n.metadata, n.created_at,
                (SELECT s.support FROM memory._support_at(ARRAY[n.id]) s),
                memory._node_cursor(n.id), n.valid_from, n.valid_to, n.expires_at, n.revision
         FROM memory.nodes n'
        || memory._nodes_where(after_id IS NOT NULL, p_source IS NOT NULL, p_projects IS NOT NULL,
                               coalesce(p_newest_first, false))
        || CASE WHEN p_newest_first THEN ' ORDER BY n.id DESC LIMIT $5' ELSE ' ORDER BY n.id LIMIT $5' END
        USING vis, after_id, p_source, p_projects, p_limit;
END $$;
COMMENT ON FUNCTION memory._list_nodes(text, text, text, text, text, text, integer, text[], jsonb, boolean) IS
    'Implementation of memory.list_nodes (positional parameter names: PL/pgSQL forbids a parameter named like a result column); p_projects (NULL: no filter) keeps to those projects: the service passes the API key''s.';

CREATE OR REPLACE FUNCTION memory.list_nodes(
    project text DEFAULT NULL,
    level text DEFAULT NULL,
    source text DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    after text DEFAULT NULL,
    "limit" integer DEFAULT 50,
    filter jsonb DEFAULT NULL,
    newest_first boolean DEFAULT false
)
RETURNS SETOF memory.node_list_row
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT * FROM memory._list_nodes(project, level, source, since, until, after, "limit", NULL,
                                     filter, newest_first);
END;
COMMENT ON FUNCTION memory.list_nodes(text, text, text, text, text, text, integer, jsonb, boolean) IS
    'A page of nodes (current versions, each with its revision) in write order (node id; newest_first => true: the latest writes first), keyset paged: after => the cursor of the last row of the previous page (opaque). Filters: project (PM404 when unknown; NULL: every project the caller can read), level, source (equal), since/until (inclusive ISO dates or timestamps on the node''s timestamp, as memory.query''s), filter (a JSON object the node''s metadata contains, as memory.query''s: memory.check_filter). Current versions whose expiry (expires_at) has not passed. limit 1..100 (default 50). Row-level security applies.';

CREATE OR REPLACE FUNCTION memory._count_nodes(
    p_project text, p_level text, p_source text, p_since text, p_until text,
    p_filter jsonb, p_projects text[]
)
RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    vis memory.visibility := memory._listing_visibility(p_project, p_level, p_since, p_until, p_filter);
    n bigint;
BEGIN
    EXECUTE 'SELECT count(*) FROM memory.nodes n'
        || memory._nodes_where(false, p_source IS NOT NULL, p_projects IS NOT NULL)
        INTO n
        USING vis, NULL::bigint, p_source, p_projects;
    RETURN n;
END $$;
COMMENT ON FUNCTION memory._count_nodes(text, text, text, text, text, jsonb, text[]) IS
    'Implementation of memory.count_nodes; p_projects (NULL: no filter) keeps to those projects: the service passes the API key''s.';

CREATE OR REPLACE FUNCTION memory.count_nodes(
    project text DEFAULT NULL,
    level text DEFAULT NULL,
    source text DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    filter jsonb DEFAULT NULL
)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT memory._count_nodes(project, level, source, since, until, filter, NULL);
END;
COMMENT ON FUNCTION memory.count_nodes(text, text, text, text, text, jsonb) IS
    'How many nodes memory.list_nodes would list with these filters over all its pages (the same visibility and WHERE clause, memory._listing_visibility and memory._nodes_where): current versions whose expiry has not passed, by project, level, source, since/until and filter (metadata containment). Row-level security applies.';

-- MCP's resources/read of a project (api/operations.py project_summary): a function, so that
-- a PL/Proxy proxy answers the same statement from the project's partition
-- (sql/proxy/proxy.sql).
CREATE OR REPLACE FUNCTION memory._project_summary(p_project text)
RETURNS TABLE (current jsonb, ended bigint, latest_write timestamptz)
-- plpgsql, not sql: a SQL body is checked against memory.nodes when it is made, and sql/ is
-- applied between migrations too (before expired_at, 0012), where it would fail.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- memory.project_id runs first, under row-level security: PM404 for a project the
    -- caller cannot see, as for one that does not exist.
    RETURN QUERY
    SELECT (SELECT coalesce(jsonb_object_agg(c.level, c.n), '{}')
            FROM (SELECT n.level, count(*) AS n FROM memory.nodes n
                  WHERE n.project_id = p.id AND n.expired_at IS NULL GROUP BY n.level) c),
           (SELECT count(*) FROM memory.nodes n
            WHERE n.project_id = p.id AND n.expired_at IS NOT NULL),
           (SELECT max(greatest(n.created_at, n.expired_at)) FROM memory.nodes n
            WHERE n.project_id = p.id)
    FROM (SELECT memory.project_id(p_project) AS id) p;
END $$;
COMMENT ON FUNCTION memory._project_summary(text) IS
    'One project''s summary for MCP''s resources/read: its current nodes per level ({"L0": n, ..}), the versions that ended (superseded or forgotten) and the latest write (a version made or ended); PM404 for a project the caller cannot see or that does not exist.';
