-- Vector recall. Both functions order by the cosine distance operator with a LIMIT, so the
-- planner can serve semantic_search from the HNSW index and search_by_ids from the PK.

-- since/before (the time filter) were added: drop the old signatures first.
DROP FUNCTION IF EXISTS memory.semantic_search(vector, text, text[], integer, integer);
DROP FUNCTION IF EXISTS memory.exact_search(vector, text, text[], integer);
DROP FUNCTION IF EXISTS memory.search_by_ids(vector, bigint[], text, text[], integer);
-- filter (metadata containment) and grammar (the query grammar's constraints) were added,
-- then as_of and valid_at (time travel).
DROP FUNCTION IF EXISTS memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz);
DROP FUNCTION IF EXISTS memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz);
DROP FUNCTION IF EXISTS memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz, jsonb, jsonb);
DROP FUNCTION IF EXISTS memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz, jsonb, jsonb);
DROP FUNCTION IF EXISTS memory.exact_search(vector, text, text[], integer, timestamptz, timestamptz, jsonb);

-- The statements of the two vector stages, kept as text in one place: the stage functions
-- run them and memory.explain_query explains the very same text. Both see current versions
-- only (expired_at IS NULL, migration 0012); the HNSW scans filter the others out as they
-- walk the graph (iterative scans keep filling k).
CREATE OR REPLACE FUNCTION memory.stage_sql(stage text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE stage
    -- $1 query vector, $2 project id, $3 levels, $4 k, $5 since, $6 before (the time window
    -- since <= ts < before; NULL: unbounded, and a node without ts never passes), $7 filter
    -- (metadata containment), $8 grammar (memory._grammar_constraints; NULL: none), $9 as_of
    -- (the versions visible then; NULL: the current ones), $10 the instant valid time is
    -- tested at (memory._valid_at; NULL: none): all
    -- inside the scan, so the iterative scan fills k with nodes that pass. relaxed_order may return near-ties
    -- slightly out of order: the materialised top-k is re-sorted by exact distance, as the
    -- pgvector documentation recommends.
    WHEN 'semantic' THEN $q$
    WITH hits AS MATERIALIZED (
        SELECT n.id, n.embedding <=> $1 AS distance
        FROM memory.nodes n
        WHERE n.embedding IS NOT NULL
          AND CASE WHEN $9::timestamptz IS NULL THEN n.expired_at IS NULL
                   ELSE n.created_at <= $9 AND (n.expired_at IS NULL OR n.expired_at > $9)
                        AND n.erased_at IS NULL END
          AND ($10::timestamptz IS NULL OR ((n.valid_from IS NULL OR n.valid_from <= $10)
                                            AND (n.valid_to IS NULL OR n.valid_to > $10)
                                            AND (n.expires_at IS NULL OR n.expires_at > $10)))
          AND ($2::integer IS NULL OR n.project_id = $2) AND ($3::text[] IS NULL OR n.level = ANY ($3))
          AND ($5::timestamptz IS NULL OR n.ts >= $5) AND ($6::timestamptz IS NULL OR n.ts < $6)
          AND ($7::jsonb IS NULL OR n.metadata @> $7)
          AND ($8::jsonb IS NULL OR memory._grammar_match(n.tsv, memory._grammar_doc(n.title, n.breadcrumb, n.text), $8))
        ORDER BY n.embedding <=> $1
        LIMIT $4
    )
    SELECT h.id, (row_number() OVER (ORDER BY h.distance, h.id))::integer, 1 - h.distance
    FROM hits h
    ORDER BY h.distance, h.id$q$
    -- A named project small enough (memory._semantic_stage): its rows read through the
    -- (project_id, level) btree (or whatever scan the planner finds cheapest for them) and
    -- ranked by exact distance, the recall of brute force. Same parameters as semantic; $2
    -- is never NULL here. OFFSET 0 keeps the subquery apart, so the ORDER BY ... LIMIT k
    -- cannot be served by an HNSW index (this stage must not be approximate).
    WHEN 'semantic_exact' THEN $q$
    SELECT h.id, (row_number() OVER (ORDER BY h.distance, h.id))::integer, 1 - h.distance
    FROM (SELECT r.id, r.distance
          FROM (SELECT n.id, n.embedding <=> $1 AS distance
                FROM memory.nodes n
                WHERE n.project_id = $2 AND n.embedding IS NOT NULL
                  AND CASE WHEN $9::timestamptz IS NULL THEN n.expired_at IS NULL
                           ELSE n.created_at <= $9 AND (n.expired_at IS NULL OR n.expired_at > $9)
                                AND n.erased_at IS NULL END
                  AND ($10::timestamptz IS NULL OR ((n.valid_from IS NULL OR n.valid_from <= $10)
                                                    AND (n.valid_to IS NULL OR n.valid_to > $10)
                                                    AND (n.expires_at IS NULL OR n.expires_at > $10)))
                  AND ($3::text[] IS NULL OR n.level = ANY ($3))
                  AND ($5::timestamptz IS NULL OR n.ts >= $5) AND ($6::timestamptz IS NULL OR n.ts < $6)
                  AND ($7::jsonb IS NULL OR n.metadata @> $7)
                  AND ($8::jsonb IS NULL OR memory._grammar_match(n.tsv, memory._grammar_doc(n.title, n.breadcrumb, n.text), $8))
                OFFSET 0) r
          ORDER BY r.distance, r.id
          LIMIT $4) h
    ORDER BY h.distance, h.id$q$
    -- $1 query vector, $2 ids, $3 project id, $4 levels, $5 k, $6 since, $7 before, $8 filter, $9 grammar,
    -- $10 as_of, $11 valid time's instant.
    WHEN 'by_ids' THEN $q$
    SELECT n.id, (row_number() OVER (ORDER BY n.embedding <=> $1, n.id))::integer,
           1 - (n.embedding <=> $1)
    FROM memory.nodes n
    WHERE n.id = ANY ($2) AND n.embedding IS NOT NULL
      AND CASE WHEN $10::timestamptz IS NULL THEN n.expired_at IS NULL
               ELSE n.created_at <= $10 AND (n.expired_at IS NULL OR n.expired_at > $10)
                    AND n.erased_at IS NULL END
      AND ($11::timestamptz IS NULL OR ((n.valid_from IS NULL OR n.valid_from <= $11)
                                        AND (n.valid_to IS NULL OR n.valid_to > $11)
                                        AND (n.expires_at IS NULL OR n.expires_at > $11)))
      AND ($3::integer IS NULL OR n.project_id = $3) AND ($4::text[] IS NULL OR n.level = ANY ($4))
      AND ($6::timestamptz IS NULL OR n.ts >= $6) AND ($7::timestamptz IS NULL OR n.ts < $7)
      AND ($8::jsonb IS NULL OR n.metadata @> $8)
      AND ($9::jsonb IS NULL OR memory._grammar_match(n.tsv, memory._grammar_doc(n.title, n.breadcrumb, n.text), $9))
    ORDER BY n.embedding <=> $1, n.id
    LIMIT $5$q$
    END
$$;
COMMENT ON FUNCTION memory.stage_sql(text) IS
    'The SQL text of a vector stage (semantic, the HNSW scan, and semantic_exact, a named project''s rows ranked exactly: $1 vector, $2 project id, $3 levels, $4 k, $5 since, $6 before, $7 filter, $8 grammar, $9 as_of, $10 valid-time instant; by_ids: $1 vector, $2 ids, $3 project id, $4 levels, $5 k, $6 since, $7 before, $8 filter, $9 grammar, $10 as_of, $11 valid-time instant), run by memory.semantic_search / memory.search_by_ids and explained by memory.explain_query.';

-- Which vector stage the semantic leg runs (issue 28): a named project holding at most
-- exact_scan_max_nodes current nodes (memory.corpus_stats, kept by the lexical triggers: one
-- primary-key read) is ranked exactly; a larger project, or no project (every project the
-- caller may see), takes the HNSW scan. memory.semantic_search runs it and memory._explain
-- explains it, both through this function.
CREATE OR REPLACE FUNCTION memory._semantic_stage(project_id integer)
RETURNS text
-- STABLE PARALLEL SAFE: it only reads (the policy, corpus_stats); it sets nothing.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cap integer;
BEGIN
    IF project_id IS NULL THEN
        RETURN 'semantic';
    END IF;
    cap := memory._policy_value('exact_scan_max_nodes')::integer;
    IF cap > 0 AND coalesce((SELECT c.n_docs FROM memory.corpus_stats c
                             WHERE c.project_id = _semantic_stage.project_id), 0) <= cap THEN
        RETURN 'semantic_exact';
    END IF;
    RETURN 'semantic';
END $$;
COMMENT ON FUNCTION memory._semantic_stage(integer) IS
    'The vector stage (memory.stage_sql) the semantic leg of project_id runs: semantic_exact when a project is named and holds at most the policy''s exact_scan_max_nodes current nodes (memory.corpus_stats; 0: never), else semantic (HNSW). Called by memory.semantic_search and memory.explain_query alike.';

-- The hnsw.ef_search of an HNSW scan: the caller's, else filtered_ef_search when a project
-- is named (its own graph, or the shared one filtered), else large_store_ef_search once the
-- store is past large_store_nodes (a graph's recall at a fixed beam falls as it grows:
-- 0.969 at 100k nodes, 0.928 at 1M at ef 100; docs/benchmarks.md), else NULL:
-- memory.semantic_search's own SET (100). The store's size is the table's planner estimate
-- (pg_class.reltuples, which row-level security does not hide: the graph holds every row
-- whoever asks). Not on a partitioned table: each partition has a graph of its own size,
-- and the parent's estimate (set by the ANALYZE that partitioned it) is never refreshed.
CREATE OR REPLACE FUNCTION memory._semantic_ef(project_id integer, ef_search integer DEFAULT NULL)
RETURNS integer
-- STABLE PARALLEL SAFE: it reads the policy and returns a number; the callers (PARALLEL
-- UNSAFE) are the ones that set hnsw.ef_search.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF ef_search IS NOT NULL THEN
        RETURN greatest(ef_search, 1);
    ELSIF project_id IS NOT NULL THEN
        RETURN memory._policy_value('filtered_ef_search')::integer;
    ELSIF (SELECT c.reltuples FROM pg_catalog.pg_class c
           WHERE c.oid = 'memory.nodes'::regclass AND c.relkind = 'r')
          > memory._policy_value('large_store_nodes')::bigint THEN
        RETURN memory._policy_value('large_store_ef_search')::integer;
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION memory._semantic_ef(integer, integer) IS
    'The hnsw.ef_search an HNSW semantic scan of project_id runs with: ef_search when given (at least 1), else the policy''s filtered_ef_search when a project is named, else large_store_ef_search when memory.nodes holds more than large_store_nodes rows (pg_class.reltuples), else NULL (memory.semantic_search''s own setting, 100). Called by memory.semantic_search and memory.explain_query alike.';

CREATE OR REPLACE FUNCTION memory.semantic_search(
    query_embedding vector,
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    ef_search integer DEFAULT NULL,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    grammar jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
-- PARALLEL UNSAFE: it sets hnsw.ef_search with set_config, which no parallel mode allows,
-- not even in the leader (RESTRICTED fails the same way under force_parallel_mode).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
-- relaxed_order keeps scanning the graph until k rows pass the filter (pgvector #259);
-- these settings are restored when the function returns.
SET hnsw.iterative_scan = 'relaxed_order'
SET hnsw.ef_search = 100
-- No parallel workers: memory._semantic_stage has chosen between the exact stage and the
-- graph already. pgvector costs an HNSW scan in proportion to ef_search, so at
-- filtered_ef_search (400) a cheap enough parallel plan (a Parallel Seq Scan, Sort, Gather
-- Merge: brute force split over workers) would undo the choice of the graph; found under
-- debug_parallel_query with free parallel costs (tests/test_sql_modes.py, issue 28). Neither
-- stage gains from workers: the exact one reads at most exact_scan_max_nodes rows.
SET max_parallel_workers_per_gather = 0
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    f record := memory.node_filter(project, levels, since, before, as_of, valid_at);
    q vector := memory.require_embedding(query_embedding);
    stage text := memory._semantic_stage(f.pid);
    ef integer;
BEGIN
    IF k IS NULL OR k < 1 OR k > 1000 THEN
        RAISE EXCEPTION 'k must be 1..1000, got %', k USING ERRCODE = '22023';
    END IF;
    IF stage = 'semantic' THEN
        ef := memory._semantic_ef(f.pid, ef_search);
        IF ef IS NOT NULL THEN
            PERFORM set_config('hnsw.ef_search', ef::text, true);
        END IF;
    END IF;
    RAISE DEBUG 'memory.semantic_search: stage %, hnsw.ef_search %', stage,
        current_setting('hnsw.ef_search');
    RETURN QUERY EXECUTE memory.stage_sql(stage)
        USING q, f.pid, f.lv, k, since, before,
              CASE WHEN filter IS NOT NULL THEN memory.check_filter(filter) END,
              CASE WHEN grammar IS NOT NULL THEN memory._grammar_constraints(grammar) END,
              as_of, f.va;
END $$;
COMMENT ON FUNCTION memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, timestamptz) IS
    'Top-k by cosine distance (HNSW; a named project with at most exact_scan_max_nodes nodes ranked exactly, memory._semantic_stage; a project''s HNSW scan, its own graph''s or the shared one''s, with ef_search, else the policy''s filtered_ef_search; a scan naming no project at large_store_ef_search past large_store_nodes: memory._semantic_ef) with optional project/level/time filters (since <= ts < before), filter (a JSON object the node''s metadata contains) and grammar (a memory.parse_query parse: its required phrases, tags and mentions and its exclusions); as_of: the versions the database held then (NULL: the current ones); valid_at: only nodes valid then (default: as_of, else now); the iterative scan fills k under selective filters. query_score = 1 - cosine distance.';

-- The form before the metadata filter goes first (and the one before time travel, above).
DROP FUNCTION IF EXISTS memory.exact_search(vector, text, text[], integer, timestamptz, timestamptz);

CREATE OR REPLACE FUNCTION memory.exact_search(
    query_embedding vector,
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
-- Disabling index scans makes this the brute-force recall reference for the HNSW path.
SET enable_indexscan = off
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    f record := memory.node_filter(project, levels, since, before, as_of, valid_at);
    q vector := memory.require_embedding(query_embedding);
    flt jsonb := memory.check_filter(filter);
    -- Brute force reads every row: the owner bounds k (memory.set_policy).
    max_k integer := memory._policy_value('exact_search_max_k')::integer;
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
      AND CASE WHEN as_of IS NULL THEN n.expired_at IS NULL
               ELSE n.created_at <= as_of AND (n.expired_at IS NULL OR n.expired_at > as_of)
                    AND n.erased_at IS NULL END
      AND (f.va IS NULL OR ((n.valid_from IS NULL OR n.valid_from <= f.va)
                            AND (n.valid_to IS NULL OR n.valid_to > f.va)
                            AND (n.expires_at IS NULL OR n.expires_at > f.va)))
      AND (f.pid IS NULL OR n.project_id = f.pid) AND (f.lv IS NULL OR n.level = ANY (f.lv))
      AND (NOT f.timed OR (n.ts >= f.lo AND n.ts < f.hi))
      AND (flt IS NULL OR n.metadata @> flt)
    ORDER BY n.embedding <=> q, n.id
    LIMIT k;
END $$;
COMMENT ON FUNCTION memory.exact_search(vector, text, text[], integer, timestamptz, timestamptz, jsonb, timestamptz, timestamptz) IS
    'Exact cosine top-k without the HNSW index: the recall reference for benchmarks. k is capped by memory.config exact_search_max_k (default 1000; memory.set_policy). since/before: only nodes with since <= ts < before; filter: only nodes whose metadata contains it (JSON containment, as memory.semantic_search); as_of and valid_at as memory.semantic_search.';

CREATE OR REPLACE FUNCTION memory.search_by_ids(
    query_embedding vector,
    ids bigint[],
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    grammar jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    f record := memory.node_filter(project, levels, since, before, as_of, valid_at);
    q vector := memory.require_embedding(query_embedding);
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE memory.stage_sql('by_ids')
        USING q, ids, f.pid, f.lv, k, since, before,
              CASE WHEN filter IS NOT NULL THEN memory.check_filter(filter) END,
              CASE WHEN grammar IS NOT NULL THEN memory._grammar_constraints(grammar) END,
              as_of, f.va;
END $$;
COMMENT ON FUNCTION memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, timestamptz) IS
    'Exact cosine ranking restricted to the given node ids (the second stage of the LexicalFirst cascade). Unknown ids, ids outside since <= ts < before, ids failing filter (metadata containment) or grammar (a memory.parse_query parse), and ids not visible as of as_of (NULL: not current) or not valid at valid_at (as memory.semantic_search) are ignored.';
