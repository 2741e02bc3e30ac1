-- Provenance: from any node down its derivation edges to L0 evidence.

CREATE OR REPLACE FUNCTION memory.provenance_walk(node_ids bigint[], max_depth integer DEFAULT 4)
RETURNS TABLE (root_id bigint, child_id bigint, parent_id bigint, depth integer, precedence integer)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    WITH RECURSIVE walk(root_id, child_id, parent_id, depth, precedence, path) AS (
        SELECT r.id, e.child_id, e.parent_id, 1, e.precedence, ARRAY[r.id, e.parent_id]
        FROM unnest(node_ids) AS r(id)
        JOIN memory.edges e ON e.child_id = r.id
        UNION ALL
        SELECT w.root_id, e.child_id, e.parent_id, w.depth + 1, e.precedence, w.path || e.parent_id
        FROM walk w
        JOIN memory.edges e ON e.child_id = w.parent_id
        WHERE w.depth < max_depth
          AND e.parent_id <> ALL (w.path)  -- cycle safety
    )
    SELECT root_id, child_id, parent_id, depth, precedence FROM walk;
END;
COMMENT ON FUNCTION memory.provenance_walk(bigint[], integer) IS
    'Recursive CTE over memory.edges from each given node towards its sources (L2->L1->L0), depth-limited and cycle-safe. One row per edge reached.';

-- The tree expands shared ancestors into copies, so its size grows as fan-out^depth (fan-out
-- 20 at depth 4 made one result 30 MB): parents per node and nodes per tree are capped
-- (memory.config provenance_max_parents / provenance_max_nodes, memory.set_policy), and
-- every cut is flagged. Built breadth first, so a capped tree keeps the nearest sources.
-- root_project was added: the old signature goes first.
DROP FUNCTION IF EXISTS memory.provenance(bigint, integer);
CREATE OR REPLACE FUNCTION memory.provenance(
    node_id bigint, max_depth integer DEFAULT 4, root_project integer DEFAULT NULL
)
RETURNS TABLE (tree jsonb, truncated boolean)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    max_parents integer := coalesce((SELECT c.value::integer FROM memory.config c
                                     WHERE c.key = 'provenance_max_parents'), 32);
    max_nodes integer := coalesce((SELECT c.value::integer FROM memory.config c
                                   WHERE c.key = 'provenance_max_nodes'), 256);
    -- One entry per tree position ("instance"); instance 1 is the node itself.
    -- Provenance never leaves the node's project (edges carry it, migration 0009): every
    -- statement below names it, so on the partitioned layout each reads one partition.
    pid integer := coalesce(root_project, (SELECT n.project_id FROM memory.nodes n
                                           WHERE n.id = provenance.node_id));
    ids bigint[] := ARRAY[provenance.node_id];
    up integer[] := ARRAY[0];       -- the instance whose parents list holds this one
    paths text[] := ARRAY[',' || provenance.node_id || ','];  -- ancestors, for cycle safety
    cut boolean[] := ARRAY[false];  -- this instance's parents were cut by a cap
    frontier integer[] := ARRAY[1];
    nxt integer[];
    r record;
    n integer := 0;                 -- tree nodes so far (the root is not counted)
    nodes jsonb;
    kids jsonb[] := ARRAY['[]'::jsonb];
    obj jsonb;
    i integer;
BEGIN
    FOR d IN 1..coalesce(max_depth, 0) LOOP
        EXIT WHEN cardinality(frontier) = 0;
        nxt := '{}';
        FOR r IN
            SELECT f.inst, e.parent_id,
                   row_number() OVER (PARTITION BY f.inst ORDER BY e.precedence, p.sha256) AS rn
            FROM unnest(frontier) WITH ORDINALITY AS f(inst, ord)
            JOIN memory.edges e ON e.child_id = ids[f.inst] AND e.project_id = pid
            JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = pid
            WHERE strpos(paths[f.inst], ',' || e.parent_id || ',') = 0
            ORDER BY f.ord, rn
        LOOP
            IF r.rn > max_parents OR n >= max_nodes THEN
                cut[r.inst] := true;
                CONTINUE;
            END IF;
            n := n + 1;
            ids := ids || r.parent_id;
            up := up || r.inst;
            paths := paths || (paths[r.inst] || r.parent_id || ',');
            cut := cut || false;
            kids := kids || '[]'::jsonb;
            nxt := nxt || cardinality(ids);
        END LOOP;
        frontier := nxt;
    END LOOP;
    SELECT jsonb_object_agg(p.id::text, jsonb_build_object(
               'level', p.level, 'sha256', encode(p.sha256, 'hex'), 'source', p.source,
               'title', p.title, 'text', p.text, 'timestamp', p.ts))
      INTO nodes
      FROM memory.nodes p WHERE p.id = ANY (ids[2:]) AND p.project_id = pid;
    -- Bottom-up: children instances come after their parents' instance, so walking back
    -- finishes each instance's parents list before the instance itself is placed.
    FOR i IN REVERSE cardinality(ids)..2 LOOP
        obj := nodes -> ids[i]::text
               || jsonb_build_object('parents', kids[i], 'truncated', cut[i]);
        kids[up[i]] := jsonb_build_array(obj) || kids[up[i]];
    END LOOP;
    tree := kids[1];
    truncated := true = ANY (cut);
    RETURN NEXT;
END $$;
COMMENT ON FUNCTION memory.provenance(bigint, integer, integer) IS
    'The node''s parents as nested JSON down to L0 ([{level, sha256, source, title, text, timestamp, parents:[..], truncated}]), ordered by edge precedence then sha256, breadth first and capped: at most provenance_max_parents parents per node (default 32) and provenance_max_nodes nodes per tree (default 256), both set with memory.set_policy. root_project: the node''s project id when the caller knows it (saves a lookup). truncated: some parents were left out by a cap (each cut node says truncated: true).';

CREATE OR REPLACE FUNCTION memory.provenance_tree(node_id bigint, max_depth integer DEFAULT 4)
RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.tree FROM memory.provenance(node_id, max_depth) p
$$;
COMMENT ON FUNCTION memory.provenance_tree(bigint, integer) IS
    'The tree of memory.provenance without its truncated flag: the node''s parents as nested JSON down to L0, capped.';
