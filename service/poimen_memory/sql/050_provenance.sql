-- Provenance: from any node down its derivation edges to L0 evidence.

-- The arguments of a walk (memory.provenance_walk, memory._provenance_reach), checked in one
-- place: a NULL walked nothing in silence; an empty array is a walk of no nodes.
CREATE OR REPLACE FUNCTION memory._check_walk(node_ids bigint[], max_depth integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF node_ids IS NULL THEN
        RAISE EXCEPTION 'node_ids must not be NULL'
            USING ERRCODE = '22023', HINT = 'Pass the nodes'' ids (memory.nodes.id), e.g. ARRAY[42]; ''{}'' walks none.';
    END IF;
    IF max_depth IS NULL OR max_depth < 1 THEN
        RAISE EXCEPTION 'max_depth must be at least 1, got %', coalesce(max_depth::text, 'NULL')
            USING ERRCODE = '22023', HINT = 'How many edges to follow from each node (default 4: L2 -> L1 -> L0).';
    END IF;
END $$;
COMMENT ON FUNCTION memory._check_walk(bigint[], integer) IS
    '22023 for NULL node_ids or a max_depth below 1 (or NULL), each naming the argument: the checks of memory.provenance_walk and memory._provenance_reach.';

-- PL/pgSQL, not SQL: PostgreSQL 15 plans a SQL function's body at every call, PL/pgSQL
-- keeps the statement's plan for the session (memory.select_evidence calls this per query).
CREATE OR REPLACE FUNCTION memory.provenance_walk(
    node_ids bigint[], max_depth integer DEFAULT 4, as_of timestamptz DEFAULT NULL
)
RETURNS TABLE (root_id bigint, child_id bigint, parent_id bigint, depth integer, precedence integer)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    -- A parent counts when it has not expired at as_of (else now) and is the version held
    -- then, or a version rewritten since that the child still cites (memory._cites_superseded).
    known memory.visibility := memory._visibility(as_of => as_of);
    alive memory.visibility := memory._visibility(every_version => true, live_at => coalesce(as_of, now()));
BEGIN
    PERFORM memory._check_walk(node_ids, max_depth);
    RETURN QUERY
    WITH RECURSIVE walk(root_id, child_id, parent_id, depth, precedence, path) AS (
        SELECT r.id, e.child_id, e.parent_id, 1, e.precedence, ARRAY[r.id, e.parent_id]
        FROM unnest(node_ids) AS r(id)
        JOIN memory.edges e ON e.child_id = r.id
        JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = e.project_id
                           AND memory._rests_on(p, e.child_id, e.linked_at, as_of, known, alive)
        UNION ALL
        SELECT w.root_id, e.child_id, e.parent_id, w.depth + 1, e.precedence, w.path || e.parent_id
        FROM walk w
        JOIN memory.edges e ON e.child_id = w.parent_id
        JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = e.project_id
                           AND memory._rests_on(p, e.child_id, e.linked_at, as_of, known, alive)
        WHERE w.depth < max_depth
          AND e.parent_id <> ALL (w.path)  -- cycle safety
    )
    SELECT w.root_id, w.child_id, w.parent_id, w.depth, w.precedence FROM walk w;
END $$;
COMMENT ON FUNCTION memory.provenance_walk(bigint[], integer, timestamptz) IS
    'Recursive CTE over memory.edges from each given node towards its sources (L2->L1->L0), depth-limited and cycle-safe, through the versions each node rests on: current ones, and a version rewritten since (superseded: memory._cites_superseded), never a retired or erased one; with as_of the versions visible then. One row per path to each edge reached (memory._provenance_reach: each source once). 22023 for NULL node_ids or a max_depth below 1.';

-- The sources each node reaches, each once: what memory.select_evidence cites. The walk
-- above returns a row per path, and paths multiply where nodes share ancestors (fan-out
-- 20 at depth 4: 168,420 rows, half a second, for 80 sources). Here a breadth-first
-- search keeps the (root, source) pairs it has reached: a step expands only the pairs
-- the last one found (EXCEPT: a hashed or sorted set difference, never pair by pair),
-- and it stops when a step finds none, so the work is at most roots x sources whatever
-- the fan-out, the cycles or max_depth (a recursive UNION of (root, source, depth) went
-- round a cycle until max_depth). The set is the walk's (SELECT DISTINCT root_id,
-- parent_id): the first step that reaches a source is its shortest way, which repeats no
-- node, and every edge on it passes memory._rests_on, as the walk requires; the root is
-- never its own source.
CREATE OR REPLACE FUNCTION memory._provenance_reach(
    node_ids bigint[], max_depth integer DEFAULT 4, as_of timestamptz DEFAULT NULL
)
RETURNS TABLE (root_id bigint, parent_id bigint)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    known memory.visibility := memory._visibility(as_of => as_of);
    alive memory.visibility := memory._visibility(every_version => true, live_at => coalesce(as_of, now()));
    -- the pairs found so far, and the frontier: the pairs the last step found
    seen_root bigint[] := '{}';
    seen_node bigint[] := '{}';
    front_root bigint[] := node_ids;
    front_node bigint[] := node_ids;
    new_root bigint[];
    new_node bigint[];
BEGIN
    PERFORM memory._check_walk(node_ids, max_depth);
    FOR d IN 1..max_depth LOOP
        SELECT array_agg(x.r), array_agg(x.p) INTO new_root, new_node
        FROM (SELECT f.r, e.parent_id AS p
              FROM unnest(front_root, front_node) AS f(r, n)
              JOIN memory.edges e ON e.child_id = f.n
              JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = e.project_id
                                 AND memory._rests_on(p, e.child_id, e.linked_at, as_of, known, alive)
              WHERE e.parent_id <> f.r
              EXCEPT
              SELECT s.r, s.p FROM unnest(seen_root, seen_node) AS s(r, p)) x;
        EXIT WHEN new_root IS NULL;
        seen_root := seen_root || new_root;
        seen_node := seen_node || new_node;
        front_root := new_root;
        front_node := new_node;
    END LOOP;
    RETURN QUERY SELECT s.r, s.p FROM unnest(seen_root, seen_node) AS s(r, p);
END $$;
COMMENT ON FUNCTION memory._provenance_reach(bigint[], integer, timestamptz) IS
    'The sources (root_id, parent_id) each of node_ids reaches within max_depth edges, each pair once: memory.provenance_walk''s pairs, breadth first, in work bounded by roots x sources rather than by paths (what memory.select_evidence cites). as_of: the versions held then (NULL: current). 22023 for NULL node_ids or a max_depth below 1.';

-- The tree expands shared ancestors into copies, so its size grows as fan-out^depth (fan-out
-- 20 at depth 4 made one result 30 MB): parents per node and nodes per tree are capped
-- (policy provenance_max_parents / provenance_max_nodes, memory.set_policy), and
-- every cut is flagged; a node's text is cut at provenance_text_chars (text_truncated). Built breadth first, so a capped tree keeps the nearest sources.
-- A whole result page is built in one pass, one statement per depth for all its trees:
-- tree by tree, the statements' own start-up cost made hydrate the page's slowest stage.
CREATE OR REPLACE FUNCTION memory.provenance_forest(
    node_ids bigint[], max_depth integer DEFAULT 4, root_projects integer[] DEFAULT NULL,
    as_of timestamptz DEFAULT NULL
)
RETURNS TABLE ("position" integer, node_id bigint, tree jsonb, truncated boolean)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    max_parents integer := memory._policy_value('provenance_max_parents')::integer;
    max_nodes integer := memory._policy_value('provenance_max_nodes')::integer;
    -- A tree repeats shared ancestors: with long texts one page of trees reached 226 MB.
    -- Each node shows the start of its text (the whole text: memory.get_node, evidence).
    max_chars integer := memory._policy_value('provenance_text_chars')::integer;
    roots integer := coalesce(cardinality(node_ids), 0);
    -- One entry per tree position ("instance"); instances 1..roots are the given nodes.
    ids bigint[] := coalesce(node_ids, '{}');
    -- Provenance never leaves a node's project (edges carry it, migration 0009): every
    -- statement below names each node's project, so on the partitioned layout a page of
    -- one project reads its partition (several projects: run-time pruning per node).
    pids integer[];
    root_of integer[];              -- the tree (1..roots) each instance belongs to
    up integer[];                   -- the instance whose parents list holds this one
    -- each frontier instance's ancestors (',id,id,'), for cycle safety; kept beside the
    -- frontier, not per instance: a text[] passed to a statement is found element by
    -- element from its start, and indexing one of every instance cost 20 ms a fan-out tree
    paths text[];
    nxt_paths text[];
    cut boolean[];                  -- this instance's parents were cut by a cap
    kids jsonb[];
    sizes integer[];                -- nodes per tree so far (its root is not counted)
    cut_trees boolean[];
    frontier integer[];
    nxt integer[];
    r record;
    t integer;
    nodes jsonb;
    obj jsonb;
    i integer;
    -- the parents' versions, as memory.provenance_walk reads them
    known memory.visibility := memory._visibility(as_of => as_of);
    alive memory.visibility := memory._visibility(every_version => true, live_at => coalesce(as_of, now()));
BEGIN
    IF root_projects IS NOT NULL AND coalesce(cardinality(root_projects), 0) <> roots THEN
        RAISE EXCEPTION 'root_projects has % entries for % node_ids', cardinality(root_projects), roots
            USING ERRCODE = '22023',
                  HINT = 'Give one project id per node id, in the same order, or NULL to look them up.';
    END IF;
    IF roots = 0 THEN
        RETURN;
    END IF;
    IF root_projects IS NOT NULL THEN
        pids := root_projects;
    ELSE
        pids := ARRAY(SELECT n.project_id
                      FROM unnest(ids) WITH ORDINALITY AS g(id, ord)
                      LEFT JOIN memory.nodes n ON n.id = g.id
                      ORDER BY g.ord);
    END IF;
    root_of := ARRAY(SELECT g FROM generate_series(1, roots) g);
    up := array_fill(0, ARRAY[roots]);
    paths := ARRAY(SELECT ',' || g.id || ',' FROM unnest(ids) WITH ORDINALITY AS g(id, ord)
                   ORDER BY g.ord);
    cut := array_fill(false, ARRAY[roots]);
    kids := array_fill('[]'::jsonb, ARRAY[roots]);
    sizes := array_fill(0, ARRAY[roots]);
    cut_trees := array_fill(false, ARRAY[roots]);
    frontier := root_of;
    FOR d IN 1..coalesce(max_depth, 0) LOOP
        EXIT WHEN cardinality(frontier) = 0;
        nxt := '{}';
        nxt_paths := '{}';
        -- An instance reads at most the parents a cap can keep and one more (the row that
        -- says it was cut), and once its tree is full only whether it has a parent at all:
        -- a fan-out of 20 four deep read and sorted every parent of the 236 instances left
        -- at depth 3 (4,720 rows a tree) to keep none. The rows kept and the cut flags are
        -- the same: a row past a cap only marks its instance cut, and the first one does.
        FOR r IN
            SELECT f.ord, f.inst, f.path, x.parent_id, x.rn
            FROM unnest(frontier, paths) WITH ORDINALITY AS f(inst, path, ord)
            CROSS JOIN LATERAL (
                SELECT e.parent_id, row_number() OVER (ORDER BY e.precedence, p.sha256) AS rn
                FROM memory.edges e
                JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = pids[f.inst]
                                   AND memory._rests_on(p, e.child_id, e.linked_at, as_of, known, alive)
                WHERE e.child_id = ids[f.inst] AND e.project_id = pids[f.inst]
                  AND strpos(f.path, ',' || e.parent_id || ',') = 0
                ORDER BY e.precedence, p.sha256
                LIMIT max_parents + 1
            ) x
            WHERE sizes[root_of[f.inst]] < max_nodes
            UNION ALL
            SELECT f.ord, f.inst, f.path, NULL, max_parents + 1  -- the instance is cut: its tree is full
            FROM unnest(frontier, paths) WITH ORDINALITY AS f(inst, path, ord)
            WHERE sizes[root_of[f.inst]] >= max_nodes
              AND EXISTS (SELECT FROM memory.edges e
                          JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = pids[f.inst]
                                             AND memory._rests_on(p, e.child_id, e.linked_at, as_of, known, alive)
                          WHERE e.child_id = ids[f.inst] AND e.project_id = pids[f.inst]
                            AND strpos(f.path, ',' || e.parent_id || ',') = 0)
            ORDER BY ord, rn
        LOOP
            t := root_of[r.inst];
            IF r.rn > max_parents OR sizes[t] >= max_nodes THEN
                cut[r.inst] := true;
                cut_trees[t] := true;
                CONTINUE;
            END IF;
            sizes[t] := sizes[t] + 1;
            ids := ids || r.parent_id;
            pids := pids || pids[r.inst];
            root_of := root_of || t;
            up := up || r.inst;
            cut := cut || false;
            kids := kids || '[]'::jsonb;
            nxt := nxt || cardinality(ids);
            nxt_paths := nxt_paths || (r.path || r.parent_id || ',');
        END LOOP;
        frontier := nxt;
        paths := nxt_paths;
    END LOOP;
    SELECT jsonb_object_agg(p.id::text, jsonb_build_object(
               'level', p.level, 'external_id', p.external_id,
               'sha256', encode(p.sha256, 'hex'), 'source', p.source,
               'title', p.title, 'text', left(p.text, max_chars), 'timestamp', p.ts)
           || CASE WHEN length(p.text) > max_chars
                   THEN jsonb_build_object('text_truncated', true, 'text_chars', length(p.text))
                   ELSE '{}' END
           -- the version a derived node rests on, rewritten since: shown, marked
           || CASE WHEN CASE WHEN as_of IS NULL THEN p.expired_at IS NULL
                             ELSE p.expired_at IS NULL OR p.expired_at > as_of END THEN '{}'
                   ELSE jsonb_build_object(
                            'superseded', true, 'revision', p.revision,
                            'current_revision', (
                                SELECT v.revision FROM memory.nodes v
                                WHERE v.project_id = p.project_id AND v.external_id = p.external_id
                                  AND memory._visible(v, known)
                                ORDER BY v.revision DESC LIMIT 1)) END)
      INTO nodes
      FROM (SELECT DISTINCT g.id, g.pid
            FROM unnest(ids[roots + 1:], pids[roots + 1:]) AS g(id, pid)) g
      JOIN memory.nodes p ON p.id = g.id AND p.project_id = g.pid;
    -- Bottom-up: children instances come after their parents' instance, so walking back
    -- finishes each instance's parents list before the instance itself is placed.
    FOR i IN REVERSE cardinality(ids)..roots + 1 LOOP
        obj := nodes -> ids[i]::text
               || jsonb_build_object('parents', kids[i], 'truncated', cut[i]);
        kids[up[i]] := jsonb_build_array(obj) || kids[up[i]];
    END LOOP;
    RETURN QUERY
        SELECT g.ord::integer, g.id, kids[g.ord], cut_trees[g.ord]
        FROM unnest(node_ids) WITH ORDINALITY AS g(id, ord)
        ORDER BY g.ord;
END $$;
COMMENT ON FUNCTION memory.provenance_forest(bigint[], integer, integer[], timestamptz) IS
    'memory.provenance for many nodes in one pass: one row per given node, in input order (position is 1-based), each with its own tree and truncated flag and its own provenance_max_nodes budget. root_projects: the nodes'' project ids, in the same order, when the caller knows them (saves a lookup). as_of: parents as the database held them then (NULL: current versions). What memory.hydrate uses for a page of results.';

CREATE OR REPLACE FUNCTION memory.provenance(
    node_id bigint, max_depth integer DEFAULT 4, root_project integer DEFAULT NULL
)
RETURNS TABLE (tree jsonb, truncated boolean)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT f.tree, f.truncated
    FROM memory.provenance_forest(ARRAY[node_id], max_depth,
                                  CASE WHEN root_project IS NOT NULL
                                       THEN ARRAY[root_project] END) f;
END;
COMMENT ON FUNCTION memory.provenance(bigint, integer, integer) IS
    'The node''s parents as nested JSON down to L0 ([{level, sha256, source, title, text, timestamp, parents:[..], truncated}]), ordered by edge precedence then sha256, breadth first and capped: at most provenance_max_parents parents per node (default 32) and provenance_max_nodes nodes per tree (default 256), both set with memory.set_policy. root_project: the node''s project id when the caller knows it (saves a lookup). truncated: some parents were left out by a cap (each cut node says truncated: true). For many nodes at once: memory.provenance_forest.';

CREATE OR REPLACE FUNCTION memory.provenance_tree(node_id bigint, max_depth integer DEFAULT 4)
RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.tree FROM memory.provenance(node_id, max_depth) p
$$;
COMMENT ON FUNCTION memory.provenance_tree(bigint, integer) IS
    'The tree of memory.provenance without its truncated flag: the node''s parents as nested JSON down to L0, capped.';

-- Support (issue 24): a derived node against the parents it was written with
-- (memory.nodes.parents_declared, migration 0014). One function, so every reader (query
-- results, memory.get_node, memory.list_nodes) says the same, and a later notion of a
-- parent that no longer counts (a retired version) changes it in one place.
CREATE OR REPLACE FUNCTION memory.support_status(parents_declared integer, parents_present integer)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN CASE WHEN coalesce(parents_declared, 0) = 0 AND coalesce(parents_present, 0) = 0 THEN NULL
            WHEN parents_present >= parents_declared THEN 'full'
            WHEN coalesce(parents_present, 0) = 0 THEN 'none'
            ELSE 'partial' END;
COMMENT ON FUNCTION memory.support_status(integer, integer) IS
    'full: every parent a node was written with is still there; partial: some are gone; none: all are gone; NULL: the node was written with no parents (evidence, or an underived memory).';

-- PL/pgSQL, not SQL: its body is checked when it runs, not when it is made, so sql/ applies
-- on a schema between migrations (edges.project_id came with 0009).
CREATE OR REPLACE FUNCTION memory.parents_present(node_id bigint, project_id integer)
RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- A parent is its external id across versions (memory._write_nodes gives a current
    -- child an edge to its parent's new version): it counts while one version is current;
    -- a hard delete removes its edges, a retire or an erase ends its versions.
    RETURN (SELECT count(DISTINCT coalesce(p.external_id, p.id::text))::integer
            FROM memory.edges e
            JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = e.project_id
            WHERE e.child_id = $1 AND e.project_id = $2 AND p.expired_at IS NULL);
END $$;
COMMENT ON FUNCTION memory.parents_present(bigint, integer) IS
    'How many of the parents a node names are there now: parents counted by external id across versions, while one version is current (a deleted parent takes its edges along; a retired or erased one has no current version). What memory.support_status compares with memory.nodes.parents_declared, for query results, memory.get_node, memory.list_nodes and memory.support alike.';
