-- Vector recall. Both functions order by the cosine distance operator with a LIMIT, so the
-- planner can serve semantic_search from the HNSW index and search_by_ids from the PK.

-- since/before (the time filter) were added: drop the old signatures first.
DROP FUNCTION IF EXISTS memory.semantic_search(vector, text, text[], integer, integer);
DROP FUNCTION IF EXISTS memory.exact_search(vector, text, text[], integer);
DROP FUNCTION IF EXISTS memory.search_by_ids(vector, bigint[], text, text[], integer);

CREATE OR REPLACE FUNCTION memory.semantic_search(
    query_embedding vector,
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    ef_search integer DEFAULT NULL,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
-- PARALLEL UNSAFE: it sets hnsw.ef_search with set_config, which no parallel mode allows,
-- not even in the leader (RESTRICTED fails the same way under force_parallel_mode).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
-- relaxed_order keeps scanning the graph until k rows pass the filter (pgvector #259);
-- these settings are restored when the function returns.
SET hnsw.iterative_scan = 'relaxed_order'
SET hnsw.ef_search = 100
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project);
    lv text[] := memory.check_levels(levels);
    q vector := memory.require_embedding(query_embedding);
    -- the time filter; with none given the planner folds this condition away
    timed boolean := since IS NOT NULL OR before IS NOT NULL;
    lo timestamptz := coalesce(since, '-infinity');
    hi timestamptz := coalesce(before, 'infinity');
BEGIN
    IF k IS NULL OR k < 1 OR k > 1000 THEN
        RAISE EXCEPTION 'k must be 1..1000, got %', k USING ERRCODE = '22023';
    END IF;
    IF ef_search IS NOT NULL THEN
        PERFORM set_config('hnsw.ef_search', greatest(ef_search, 1)::text, true);
    END IF;
    -- relaxed_order may return near-ties slightly out of order: re-sort the materialised
    -- top-k by exact distance, as the pgvector documentation recommends.
    RETURN QUERY
    WITH hits AS MATERIALIZED (
        SELECT n.id, n.embedding <=> q AS distance
        FROM memory.nodes n
        WHERE n.embedding IS NOT NULL
          AND (pid IS NULL OR n.project_id = pid) AND (lv IS NULL OR n.level = ANY (lv))
          AND (NOT timed OR (n.ts >= lo AND n.ts < hi))
        ORDER BY n.embedding <=> q
        LIMIT k
    )
    SELECT h.id, (row_number() OVER (ORDER BY h.distance, h.id))::integer, 1 - h.distance
    FROM hits h
    ORDER BY h.distance, h.id;
END $$;
COMMENT ON FUNCTION memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz) IS
    'HNSW top-k by cosine distance with optional project/level/time filters (since <= ts < before; the iterative scan fills k under selective filters). query_score = 1 - cosine distance.';

CREATE OR REPLACE FUNCTION memory.exact_search(
    query_embedding vector,
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
-- Disabling index scans makes this the brute-force recall reference for the HNSW path.
SET enable_indexscan = off
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project);
    lv text[] := memory.check_levels(levels);
    q vector := memory.require_embedding(query_embedding);
    -- Brute force reads every row: the owner bounds k (memory.set_policy).
    max_k integer := coalesce((SELECT c.value::integer FROM memory.config c
                               WHERE c.key = 'exact_search_max_k'), 1000);
    -- the time filter; with none given the planner folds this condition away
    timed boolean := since IS NOT NULL OR before IS NOT NULL;
    lo timestamptz := coalesce(since, '-infinity');
    hi timestamptz := coalesce(before, 'infinity');
BEGIN
    IF k IS NULL OR k < 1 OR k > max_k THEN
        RAISE EXCEPTION 'k must be within 1..%, got %', max_k, coalesce(k::text, 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'The owner raises the cap with memory.set_policy(''exact_search_max_k'', ''5000'').';
    END IF;
    RETURN QUERY
    SELECT n.id, (row_number() OVER (ORDER BY n.embedding <=> q, n.id))::integer,
           1 - (n.embedding <=> q)
    FROM memory.nodes n
    WHERE n.embedding IS NOT NULL
      AND (pid IS NULL OR n.project_id = pid) AND (lv IS NULL OR n.level = ANY (lv))
          AND (NOT timed OR (n.ts >= lo AND n.ts < hi))
    ORDER BY n.embedding <=> q, n.id
    LIMIT k;
END $$;
COMMENT ON FUNCTION memory.exact_search(vector, text, text[], integer, timestamptz, timestamptz) IS
    'Exact cosine top-k without the HNSW index: the recall reference for benchmarks. k is capped by memory.config exact_search_max_k (default 1000; memory.set_policy). since/before: only nodes with since <= ts < before.';

CREATE OR REPLACE FUNCTION memory.search_by_ids(
    query_embedding vector,
    ids bigint[],
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project);
    lv text[] := memory.check_levels(levels);
    q vector := memory.require_embedding(query_embedding);
    -- the time filter; with none given the planner folds this condition away
    timed boolean := since IS NOT NULL OR before IS NOT NULL;
    lo timestamptz := coalesce(since, '-infinity');
    hi timestamptz := coalesce(before, 'infinity');
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT n.id, (row_number() OVER (ORDER BY n.embedding <=> q, n.id))::integer,
           1 - (n.embedding <=> q)
    FROM memory.nodes n
    WHERE n.id = ANY (ids) AND n.embedding IS NOT NULL
      AND (pid IS NULL OR n.project_id = pid) AND (lv IS NULL OR n.level = ANY (lv))
          AND (NOT timed OR (n.ts >= lo AND n.ts < hi))
    ORDER BY n.embedding <=> q, n.id
    LIMIT k;
END $$;
COMMENT ON FUNCTION memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz) IS
    'Exact cosine ranking restricted to the given node ids (the second stage of the LexicalFirst cascade). Unknown ids, and ids outside since <= ts < before, are ignored.';
