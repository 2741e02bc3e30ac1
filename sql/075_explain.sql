-- memory.explain_query: the plans a DBA needs, without auto_explain. The retrieval
-- statements run inside PL/pgSQL, where EXPLAIN of the outer call shows a Function Scan
-- only; this runs the query, then EXPLAINs the vector stages it ran, with its values.

CREATE OR REPLACE FUNCTION memory.explain_query(
    query text,
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    levels text[] DEFAULT ARRAY['L1', 'L2'],
    k integer DEFAULT 5,
    strategy text DEFAULT NULL,
    actual boolean DEFAULT false  -- EXPLAIN ANALYZE, BUFFERS: actual rows and times
)
RETURNS TABLE (stage text, search_strategy text, plan jsonb)
-- VOLATILE: PL/pgSQL runs EXPLAIN, a utility statement, only from a volatile function.
-- PARALLEL UNSAFE: it may embed and route in PL/Python (subtransactions).
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
-- The settings memory.semantic_search runs under, so the plan is the one it gets.
SET hnsw.iterative_scan = 'relaxed_order'
SET hnsw.ef_search = 100
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    strat text;
    emb vector := query_embedding;
    pol record;
    pid integer := memory.project_id(project);
    lv text[] := memory.check_levels(levels);
    ids bigint[];
    opts text := CASE WHEN actual THEN 'FORMAT JSON, ANALYZE, BUFFERS' ELSE 'FORMAT JSON' END;
    p json;
BEGIN
    -- The answer decides which stages ran: run it once, exactly as memory.query would.
    SELECT q.search_strategy INTO strat
    FROM memory.query(query, query_embedding, project, levels, k, strategy) q LIMIT 1;
    strat := coalesce(strat, strategy, 'LexicalOnly');
    search_strategy := strat;
    IF strat = 'LexicalOnly' THEN
        RETURN;  -- memory.lexical_search only: see docs/sql-api.md, Reading the plans
    END IF;
    SELECT * INTO pol FROM memory.policy();
    emb := coalesce(emb, memory.embed(query));
    IF strat IN ('Hybrid', 'SemanticOnly') THEN
        EXECUTE format('EXPLAIN (%s) %s', opts, memory.stage_sql('semantic')) INTO p
            USING emb, pid, lv, CASE strat WHEN 'Hybrid' THEN pol.candidates ELSE k END,
                  NULL::timestamptz, NULL::timestamptz;
        stage := 'semantic';
        plan := p::jsonb -> 0;
        RETURN NEXT;
    ELSE  -- LexicalFirst: exact cosine over the lexical leg's ids
        ids := ARRAY(SELECT l.node_id FROM memory.lexical_search(query, project, lv,
                                                                  pol.cascade_candidates) l);
        EXECUTE format('EXPLAIN (%s) %s', opts, memory.stage_sql('by_ids')) INTO p
            USING emb, ids, pid, lv,
                  CASE WHEN pol.fusion = 'convex' THEN greatest(cardinality(ids), 1) ELSE k END,
                  NULL::timestamptz, NULL::timestamptz;
        stage := 'by_ids';
        plan := p::jsonb -> 0;
        RETURN NEXT;
    END IF;
END $$;
COMMENT ON FUNCTION memory.explain_query(text, vector, text, text[], integer, text, boolean) IS
    'Runs the query like memory.query, then returns EXPLAIN (FORMAT JSON[, ANALYZE, BUFFERS]) of each vector stage it ran (semantic: the HNSW/btree recall; by_ids: the LexicalFirst cosine stage), with the same values and settings. LexicalOnly returns no rows.';
