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

CREATE OR REPLACE FUNCTION memory.provenance_tree(node_id bigint, max_depth integer DEFAULT 4)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    tree jsonb := '{}';
    walk jsonb;
    d integer;
BEGIN
    -- Build bottom-up from the walk: each node's JSON embeds its already-built parents.
    SELECT jsonb_agg(w) INTO walk FROM memory.provenance_walk(ARRAY[node_id], max_depth) w;
    IF walk IS NULL THEN
        RETURN '[]'::jsonb;
    END IF;
    FOR d IN SELECT DISTINCT w.depth FROM jsonb_to_recordset(walk) AS w(depth integer) ORDER BY 1 DESC LOOP
        tree := tree || coalesce((
            SELECT jsonb_object_agg(x.child_id::text, x.parents)
            FROM (
                SELECT w.child_id,
                       jsonb_agg(jsonb_build_object(
                           'level', p.level, 'sha256', encode(p.sha256, 'hex'),
                           'source', p.source, 'title', p.title, 'text', p.text,
                           'timestamp', p.ts,
                           'parents', coalesce(tree -> p.id::text, '[]'::jsonb))
                           ORDER BY w.precedence, p.sha256) AS parents
                FROM (SELECT DISTINCT r.child_id, r.parent_id, r.precedence
                      FROM jsonb_to_recordset(walk)
                           AS r(child_id bigint, parent_id bigint, depth integer, precedence integer)
                      WHERE r.depth = d) w
                JOIN memory.nodes p ON p.id = w.parent_id
                GROUP BY w.child_id
            ) x), '{}'::jsonb);
    END LOOP;
    RETURN coalesce(tree -> node_id::text, '[]'::jsonb);
END $$;
COMMENT ON FUNCTION memory.provenance_tree(bigint, integer) IS
    'The node''s parents as nested JSON down to L0 ([{level, sha256, source, title, text, timestamp, parents:[..]}]), ordered by edge precedence then sha256.';
