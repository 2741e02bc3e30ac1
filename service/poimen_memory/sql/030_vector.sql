-- Vector recall. Both functions order by the cosine distance operator with a LIMIT, so the
-- planner can serve semantic_search from the HNSW index and search_by_ids from the PK.

-- The statements of the two vector stages, kept as text in one place: the stage functions
-- run them and memory.explain_query explains the very same text. What a caller may see is
-- one parameter, a memory.visibility, tested by memory._visible inside the scan (inlined:
-- the planner sees its tests as plain quals, current versions as expired_at IS NULL), so
-- the HNSW scans filter as they walk the graph and the iterative scan keeps filling k.
CREATE OR REPLACE FUNCTION memory.stage_sql(stage text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE stage
    -- $1 query vector, $2 k, $3 the visibility (memory._leg_visibility). relaxed_order may
    -- return near-ties slightly out of order: the materialised top-k is re-sorted by exact
    -- distance, as the pgvector documentation recommends.
    WHEN 'semantic' THEN $q$
    WITH hits AS MATERIALIZED (
        SELECT n.id, n.embedding <=> $1 AS distance
        FROM memory.nodes n
        WHERE n.embedding IS NOT NULL AND memory._visible(n, $3::memory.visibility)
        ORDER BY n.embedding <=> $1
        LIMIT $2
    )
    SELECT h.id, (row_number() OVER (ORDER BY h.distance, h.id))::integer, 1 - h.distance
    FROM hits h
    ORDER BY h.distance, h.id$q$
    -- A named project small enough (memory._semantic_stage): its rows read through the
    -- (project_id, level) btree (or whatever scan the planner finds cheapest for them) and
    -- ranked by exact distance, the recall of brute force. Same parameters as semantic; the
    -- visibility always names the project here. OFFSET 0 keeps the subquery apart, so the
    -- ORDER BY ... LIMIT k cannot be served by an HNSW index (this stage must not be
    -- approximate).
    WHEN 'semantic_exact' THEN $q$
    SELECT h.id, (row_number() OVER (ORDER BY h.distance, h.id))::integer, 1 - h.distance
    FROM (SELECT r.id, r.distance
          FROM (SELECT n.id, n.embedding <=> $1 AS distance
                FROM memory.nodes n
                WHERE n.embedding IS NOT NULL AND memory._visible(n, $3::memory.visibility)
                OFFSET 0) r
          ORDER BY r.distance, r.id
          LIMIT $2) h
    ORDER BY h.distance, h.id$q$
    -- semantic_exact for a visibility that tests nothing but the project, the levels and the
    -- current versions (memory._vector_stage says when): the same rows in the same order,
    -- its tests written as plain quals on the visibility's fields. semantic_exact is planned
    -- at every call (the visibility folds only as a constant, and a plan made for any value
    -- tests all of memory._visible per row: 1.3 against 0.7 ms for a LoCoMo conversation);
    -- this one is planned once a session (memory._semantic_exact_current), its project and
    -- each level an index condition whatever their values (one descent per level: with
    -- level = ANY (levels) a plan made for any levels read the whole project and filtered
    -- it, all of SciFact's abstracts for its L1/L2 leg). Same parameters as semantic.
    WHEN 'semantic_exact_current' THEN $q$
    SELECT h.id, (row_number() OVER (ORDER BY h.distance, h.id))::integer, 1 - h.distance
    FROM (SELECT r.id, r.distance
          FROM (SELECT DISTINCT l.level
                FROM unnest(($3::memory.visibility).levels) AS l(level)) lv
          CROSS JOIN LATERAL (
                SELECT n.id, n.embedding <=> $1 AS distance
                FROM memory.nodes n
                WHERE n.project_id = ($3::memory.visibility).project_id AND n.level = lv.level
                  AND n.expired_at IS NULL AND n.embedding IS NOT NULL
                OFFSET 0) r
          ORDER BY r.distance, r.id
          LIMIT $2) h
    ORDER BY h.distance, h.id$q$
    -- $1 query vector, $2 ids, $3 k, $4 the visibility.
    WHEN 'by_ids' THEN $q$
    SELECT n.id, (row_number() OVER (ORDER BY n.embedding <=> $1, n.id))::integer,
           1 - (n.embedding <=> $1)
    FROM memory.nodes n
    WHERE n.id = ANY ($2) AND n.embedding IS NOT NULL AND memory._visible(n, $4::memory.visibility)
    ORDER BY n.embedding <=> $1, n.id
    LIMIT $3$q$
    END
$$;
COMMENT ON FUNCTION memory.stage_sql(text) IS
    'The SQL text of a vector stage (semantic, the HNSW scan, semantic_exact, a named project''s rows ranked exactly, and semantic_exact_current, the same for the current versions of given levels with no other test, planned once a session: $1 vector, $2 k, $3 visibility; by_ids: $1 vector, $2 ids, $3 k, $4 visibility; the visibility a memory.visibility that memory._visible tests inside the scan, or semantic_exact_current reads as plain quals: its project and levels), run by memory.semantic_search / memory.search_by_ids and explained by memory.explain_query.';

-- Which vector stage the semantic leg runs (issue 28): a named project holding at most
-- exact_scan_max_nodes current nodes (memory.corpus_stats, kept by the lexical triggers: one
-- primary-key read) is ranked exactly; a larger project, or no project (every project the
-- caller may see), takes the HNSW scan. memory._vector_stage refines the choice for a
-- visibility; memory.semantic_search and memory.explain_query both call that.
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
    'The vector stage (memory.stage_sql) the semantic leg of project_id runs: semantic_exact when a project is named and holds at most the policy''s exact_scan_max_nodes current nodes (memory.corpus_stats; 0: never), else semantic (HNSW). Called by memory._vector_stage, which memory.semantic_search and memory.explain_query call alike.';

-- The vector stage memory.semantic_search runs for a visibility, and memory.explain_query
-- explains: memory._semantic_stage's choice, and semantic_exact_current instead of
-- semantic_exact when the visibility tests nothing but the project, given levels and the
-- current versions (memory._current_only). Not on the partitioned layout, where a plan made
-- once would lock every partition at each use (memory._plan_cache_mode).
CREATE OR REPLACE FUNCTION memory._vector_stage(v memory.visibility)
RETURNS text
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    stage text := memory._semantic_stage(v.project_id);
BEGIN
    IF stage = 'semantic_exact' AND v.levels IS NOT NULL AND memory._current_only(v)
       AND memory._plan_cache_mode() = 'force_generic_plan' THEN
        RETURN 'semantic_exact_current';
    END IF;
    RETURN stage;
END $$;
COMMENT ON FUNCTION memory._vector_stage(memory.visibility) IS
    'The vector stage (memory.stage_sql) of a semantic leg with visibility v: memory._semantic_stage of its project, semantic_exact_current in place of semantic_exact when v names levels and tests nothing else but the current versions (memory._current_only) on one table. Called by memory.semantic_search and memory.explain_query alike.';

-- semantic_exact_current's statement, planned once a session: the function's body is
-- memory.stage_sql's text (one copy), a PL/pgSQL statement whose generic plan is kept
-- (plan_cache_mode). enable_seqscan off keeps that plan on the (project_id, level) index
-- whatever the planner guesses of an unknown project's size: a plan made for every
-- project must not read the table when a store holds one large project beside small ones.
DO $do$
BEGIN
    -- The clauses start their lines: migrate names pgvector's schema in each line that
    -- starts "SET search_path =" (db/migrate/render.py).
    EXECUTE format($f$
CREATE OR REPLACE FUNCTION memory._semantic_exact_current(
    query_embedding vector, k integer, v memory.visibility)
RETURNS TABLE (node_id bigint, rank integer, query_score double precision)
-- PARALLEL UNSAFE as its one caller, memory.semantic_search, is (its own SET clauses
-- would be allowed in a worker).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
SET search_path = pg_catalog, public, pg_temp
AS %L$f$,
        E'BEGIN\n    RETURN QUERY' || memory.stage_sql('semantic_exact_current') || E';\nEND');
END $do$;
COMMENT ON FUNCTION memory._semantic_exact_current(vector, integer, memory.visibility) IS
    'Runs memory.stage_sql(''semantic_exact_current'') (its body is that text) with a plan kept for the session: the top k of the visibility''s project and levels by exact cosine distance, current versions only. Called by memory.semantic_search when memory._vector_stage chooses that stage.';

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
    -- what the leg may see (memory.visibility), tested inside the scan (memory.stage_sql)
    vis memory.visibility := memory._leg_visibility(memory.project_id(project), levels, since,
                                                    before, NULL, NULL, as_of, valid_at);
    q vector := memory.require_embedding(query_embedding);
    stage text;
    ef integer;
BEGIN
    IF k IS NULL OR k < 1 OR k > 1000 THEN
        RAISE EXCEPTION 'k must be 1..1000, got %', k USING ERRCODE = '22023';
    END IF;
    -- the filter and grammar checked last, as they always were (the stage's choice, which
    -- reads them, raises nothing)
    vis.filter := CASE WHEN filter IS NOT NULL THEN memory.check_filter(filter) END;
    vis := memory._with_grammar(vis, grammar);
    stage := memory._vector_stage(vis);
    IF stage = 'semantic' THEN
        ef := memory._semantic_ef(vis.project_id, ef_search);
        IF ef IS NOT NULL THEN
            PERFORM set_config('hnsw.ef_search', ef::text, true);
        END IF;
    END IF;
    RAISE DEBUG 'memory.semantic_search: stage %, hnsw.ef_search %', stage,
        current_setting('hnsw.ef_search');
    IF stage = 'semantic_exact_current' THEN
        RETURN QUERY SELECT * FROM memory._semantic_exact_current(q, k, vis);
    ELSE
        RETURN QUERY EXECUTE memory.stage_sql(stage) USING q, k, vis;
    END IF;
END $$;
COMMENT ON FUNCTION memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, timestamptz) IS
    'Top-k by cosine distance (HNSW; a named project with at most exact_scan_max_nodes nodes ranked exactly, memory._semantic_stage; a project''s HNSW scan, its own graph''s or the shared one''s, with ef_search, else the policy''s filtered_ef_search; a scan naming no project at large_store_ef_search past large_store_nodes: memory._semantic_ef) with optional project/level/time filters (since <= ts < before), filter (a JSON object the node''s metadata contains) and grammar (a memory.parse_query parse: its required phrases, tags and mentions and its exclusions); as_of: the versions the database held then (NULL: the current ones); valid_at: only nodes valid then (default: as_of, else now); the iterative scan fills k under selective filters. query_score = 1 - cosine distance. What it may see is one memory.visibility (memory._leg_visibility of these arguments), tested by memory._visible inside the scan.';

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
    vis memory.visibility := memory._leg_visibility(memory.project_id(project), levels, since,
                                                    before, NULL, NULL, as_of, valid_at);
    q vector := memory.require_embedding(query_embedding);
    -- checked after the vector, as it always was
    flt jsonb := memory.check_filter(filter);
    -- Brute force reads every row: the owner bounds k (memory.set_policy).
    max_k integer := memory._policy_value('exact_search_max_k')::integer;
BEGIN
    IF k IS NULL OR k < 1 OR k > max_k THEN
        RAISE EXCEPTION 'k must be within 1..%, got %', max_k, coalesce(k::text, 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'The owner raises the cap with memory.set_policy(''exact_search_max_k'', ''5000'').';
    END IF;
    vis.filter := flt;
    RETURN QUERY
    SELECT n.id, (row_number() OVER (ORDER BY n.embedding <=> q, n.id))::integer,
           1 - (n.embedding <=> q)
    FROM memory.nodes n
    WHERE n.embedding IS NOT NULL AND memory._visible(n, vis)
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
    vis memory.visibility := memory._leg_visibility(memory.project_id(project), levels, since,
                                                    before, NULL, NULL, as_of, valid_at);
    q vector := memory.require_embedding(query_embedding);
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    -- the filter and grammar checked last, as they always were
    vis.filter := CASE WHEN filter IS NOT NULL THEN memory.check_filter(filter) END;
    RETURN QUERY EXECUTE memory.stage_sql('by_ids') USING q, ids, k, memory._with_grammar(vis, grammar);
END $$;
COMMENT ON FUNCTION memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, timestamptz) IS
    'Exact cosine ranking restricted to the given node ids (the second stage of the LexicalFirst cascade). Unknown ids, ids outside since <= ts < before, ids failing filter (metadata containment) or grammar (a memory.parse_query parse), and ids not visible as of as_of (NULL: not current) or not valid at valid_at (as memory.semantic_search) are ignored: memory._visible of one memory.visibility (memory._leg_visibility of these arguments).';
