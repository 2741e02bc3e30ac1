-- memory.explain_query: the plans a DBA needs, without auto_explain. The retrieval
-- statements run inside PL/pgSQL, where EXPLAIN of the outer call shows a Function Scan
-- only; this plans the query with the one planner, runs it with the one executor (so the
-- plan reported is the plan that ran, and each stage's time is the time it took there),
-- then EXPLAINs every stage it ran with the plan's own values.

-- What EXPLAIN counts, a caller under row-level security does not see (issue 43): a
-- filter's "Rows Removed by Filter: 5092" and an index's rows before the policy's test are
-- other tenants' rows, and so are the pages read and the planner's estimates (from every
-- project's statistics). Such a caller gets the plan's shape, its conditions, costs and
-- times; the owner (and a superuser, or a role with BYPASSRLS: row_security_active says)
-- every count.
CREATE OR REPLACE FUNCTION memory._without_counts(plan jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF jsonb_typeof(plan) = 'object' THEN
        RETURN coalesce((SELECT jsonb_object_agg(e.key, memory._without_counts(e.value))
                         FROM jsonb_each(plan) e
                         WHERE e.key NOT IN ('Plan Rows', 'Actual Rows', 'Heap Fetches')
                           AND e.key NOT LIKE 'Rows Removed by %'
                           AND e.key NOT LIKE '%Blocks%'), '{}');
    ELSIF jsonb_typeof(plan) = 'array' THEN
        RETURN coalesce((SELECT jsonb_agg(memory._without_counts(e.v) ORDER BY e.o)
                         FROM jsonb_array_elements(plan) WITH ORDINALITY AS e(v, o)), '[]');
    END IF;
    RETURN plan;
END $$;
COMMENT ON FUNCTION memory._without_counts(jsonb) IS
    'An EXPLAIN (FORMAT JSON) plan without its row and page counts (Plan Rows, Actual Rows, Rows Removed by ..., Heap Fetches, every ...Blocks key), at every depth: what memory.explain_query shows a caller under row-level security, to whom they would tell how many rows other projects hold.';

CREATE OR REPLACE FUNCTION memory._explained(x json)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF row_security_active('memory.nodes'::regclass) THEN
        RETURN memory._without_counts(x::jsonb -> 0)
               || jsonb_build_object('Counts', 'hidden: row-level security applies to this role, and the counts would include other projects'' rows (the schema''s owner sees them)');
    END IF;
    RETURN x::jsonb -> 0;
END $$;
COMMENT ON FUNCTION memory._explained(json) IS
    'One stage''s EXPLAIN (FORMAT JSON) output as memory.explain_query returns it: the plan object, without its row and page counts (memory._without_counts, and a key Counts saying so) when row-level security applies to the caller.';

-- One vector stage's EXPLAIN as memory.semantic_search runs it: the stage's text with the
-- leg's values (a plan made for them), except semantic_exact_current, whose plan is made
-- once a session (memory._semantic_exact_current): its text is prepared and explained as a
-- plan made for any values, under that function's settings, read from its catalog entry
-- (declared there only, so the two cannot disagree) and set for this EXPLAIN alone.
CREATE OR REPLACE FUNCTION memory._explain_vector(
    stage text, opts text, query_embedding vector, k integer, v memory.visibility
)
RETURNS json
-- VOLATILE: it runs EXPLAIN and PREPARE, utility statements. PARALLEL UNSAFE: it prepares
-- a statement (session state) and sets settings.
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    stmt constant text := 'poimen_explain_exact_current';
    setting text;
    saved text[] := '{}';
    x json;
BEGIN
    IF stage <> 'semantic_exact_current' THEN
        EXECUTE format('EXPLAIN (%s) %s', opts, memory.stage_sql(stage)) INTO x
            USING query_embedding, k, v;
        RETURN x;
    END IF;
    -- a prepared statement outlives a failed transaction: one left by an earlier call goes
    IF EXISTS (SELECT 1 FROM pg_prepared_statements s WHERE s.name = stmt) THEN
        EXECUTE format('DEALLOCATE %I', stmt);
    END IF;
    EXECUTE format('PREPARE %I (vector, integer, memory.visibility) AS %s', stmt,
                   memory.stage_sql(stage));
    FOR setting IN
        SELECT c FROM pg_proc p, unnest(p.proconfig) AS c
        WHERE p.oid = memory._only('_semantic_exact_current') AND c NOT LIKE 'search_path=%'
    LOOP
        saved := saved || ARRAY[split_part(setting, '=', 1), current_setting(split_part(setting, '=', 1))];
        PERFORM set_config(split_part(setting, '=', 1), substr(setting, strpos(setting, '=') + 1), true);
    END LOOP;
    EXECUTE format('EXPLAIN (%s) EXECUTE %I (%L::vector, %s, %L::memory.visibility)', opts, stmt,
                   query_embedding::text, k, v::text) INTO x;
    FOR i IN 1 .. cardinality(saved) / 2 LOOP
        PERFORM set_config(saved[2 * i - 1], saved[2 * i], true);
    END LOOP;
    EXECUTE format('DEALLOCATE %I', stmt);
    RETURN x;
END $$;
COMMENT ON FUNCTION memory._explain_vector(text, text, vector, integer, memory.visibility) IS
    'EXPLAIN (opts) of the vector stage memory.stage_sql(stage) with the query vector, k and the visibility v: a plan made for these values, or for semantic_exact_current the plan made once for any values under memory._semantic_exact_current''s settings (set for the EXPLAIN alone), the one that stage keeps for the session. Called by memory.explain_query.';

-- The implementation: req is memory._request's, as memory._answer takes it.
CREATE OR REPLACE FUNCTION memory._explain(
    req jsonb,
    query_embedding vector,
    actual boolean  -- EXPLAIN ANALYZE, BUFFERS: actual rows, times and pages
)
RETURNS TABLE (stage text, search_strategy text, plan jsonb, time_ms double precision)
-- VOLATILE: PL/pgSQL runs EXPLAIN, a utility statement, only from a volatile function.
-- PARALLEL UNSAFE: it may embed and route in PL/Python (subtransactions).
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
-- It also runs under memory.semantic_search's hnsw and parallel settings, copied from that
-- function's catalog entry below, so the plan is the one it gets.
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    p record;
    pl jsonb;
    state jsonb;
    doc jsonb;
    ids bigint[];
    lv text[];
    pid integer;
    lo timestamptz;
    hi timestamptz;
    ev jsonb;
    flt jsonb;
    as_of timestamptz;
    -- what the vector stages were tested with, as memory.semantic_search and
    -- memory.search_by_ids build it from the plan's arguments (memory._plan_visibility)
    vis memory.visibility;
    ev_vis memory.visibility;
    opts text := CASE WHEN actual THEN 'FORMAT JSON, ANALYZE, BUFFERS' ELSE 'FORMAT JSON' END;
    x json;
    -- the vector stages memory.semantic_search runs for the two legs and their ef_search,
    -- as it chooses them (memory._vector_stage, memory._semantic_ef); ef0: its own SET
    sem text;
    ev_sem text;
    ef integer;
    ef0 text := current_setting('hnsw.ef_search');
BEGIN
    SELECT * INTO p FROM memory._prepare(req, query_embedding, 'memory.explain_query');
    pl := p.plan;
    state := memory._run_legs(pl, p.embedding);
    doc := memory._finish(pl, state, p.embedding);
    ids := ARRAY(SELECT (r ->> 'node_id')::bigint FROM jsonb_array_elements(doc -> 'results') r);
    lv := ARRAY(SELECT jsonb_array_elements_text(pl -> 'levels'));
    pid := (pl ->> 'project_id')::integer;
    lo := (pl ->> 'since_ts')::timestamptz;
    hi := (pl ->> 'before_ts')::timestamptz;
    ev := pl -> 'evidence';
    flt := nullif(pl -> 'filter', 'null');
    as_of := (pl ->> 'as_of')::timestamptz;
    vis := memory._plan_visibility(pl);
    ev_vis := memory._plan_visibility(pl, ARRAY['L0']);
    search_strategy := pl ->> 'search_strategy';
    sem := memory._vector_stage(vis);
    ev_sem := memory._vector_stage(ev_vis);
    ef := CASE WHEN sem = 'semantic' THEN memory._semantic_ef(pid, NULL) END;
    PERFORM set_config('hnsw.ef_search', coalesce(ef::text, ef0), true);

    stage := 'plan';
    plan := pl;
    time_ms := NULL;
    RETURN NEXT;
    IF pl -> 'lexical' ->> 'engine' = 'postgres-bm25' THEN
        EXECUTE format('EXPLAIN (%s) SELECT * FROM memory.lexical_search($1, $2, $3, $4, since => $5, before => $6, filter => $7, as_of => $8, valid_at => $9)', opts)
            INTO x USING pl ->> 'query', pl ->> 'project', lv, (pl -> 'lexical' ->> 'depth')::integer, lo, hi, flt,
                         as_of, (pl ->> 'valid_at')::timestamptz;
        stage := 'lexical';
        plan := memory._explained(x);
        time_ms := (doc -> 'stages' ->> 'lexical_time_ms')::double precision;
        RETURN NEXT;
    END IF;
    IF pl -> 'semantic' ->> 'engine' = 'hnsw' THEN
        x := memory._explain_vector(sem, opts, p.embedding, (pl -> 'semantic' ->> 'depth')::integer, vis);
        stage := 'semantic';
        plan := memory._explained(x) || jsonb_build_object('Stage', sem, 'hnsw.ef_search',
                                                     CASE WHEN sem = 'semantic' THEN current_setting('hnsw.ef_search')::integer END);
        time_ms := (doc -> 'stages' ->> 'semantic_time_ms')::double precision;
        RETURN NEXT;
    ELSIF pl -> 'semantic' ->> 'engine' = 'by-ids' THEN
        EXECUTE format('EXPLAIN (%s) %s', opts, memory.stage_sql('by_ids')) INTO x
            USING p.embedding, ARRAY(SELECT jsonb_array_elements_text(state -> 'lexical' -> 'ids')::bigint),
                  coalesce((pl -> 'semantic' ->> 'depth')::integer,
                           greatest(jsonb_array_length(state -> 'lexical' -> 'ids'), 1)),
                  vis;
        stage := 'by_ids';
        plan := memory._explained(x);
        time_ms := (doc -> 'stages' ->> 'semantic_time_ms')::double precision;
        RETURN NEXT;
    END IF;
    IF (ev ->> 'budget')::integer > 0 AND NOT (ev ->> 'reuses_legs')::boolean THEN
        IF (ev ->> 'lexical')::boolean THEN
            EXECUTE format('EXPLAIN (%s) SELECT * FROM memory.lexical_search($1, $2, ''{L0}'', $3, since => $4, before => $5, filter => $6, as_of => $7, valid_at => $8)', opts)
                INTO x USING pl ->> 'query', pl ->> 'project', (ev ->> 'candidates')::integer, lo, hi, flt,
                             as_of, (pl ->> 'valid_at')::timestamptz;
            stage := 'evidence_lexical';
            plan := memory._explained(x);
            time_ms := (doc -> 'stages' ->> 'evidence_legs_time_ms')::double precision;
            RETURN NEXT;
        END IF;
        IF (ev ->> 'semantic')::boolean AND p.embedding IS NOT NULL THEN
            x := memory._explain_vector(ev_sem, opts, p.embedding, (ev ->> 'candidates')::integer, ev_vis);
            stage := 'evidence_semantic';
            plan := memory._explained(x) || jsonb_build_object('Stage', ev_sem, 'hnsw.ef_search',
                                                         CASE WHEN ev_sem = 'semantic' THEN current_setting('hnsw.ef_search')::integer END);
            time_ms := (doc -> 'stages' ->> 'evidence_legs_time_ms')::double precision;
            RETURN NEXT;
        END IF;
    END IF;
    EXECUTE format('EXPLAIN (%s) SELECT * FROM memory.fuse_legs($1, $2, $3, $4, $5, $6, $7)', opts)
        INTO x USING state -> 'semantic', state -> 'lexical', pl ->> 'search_strategy', pl ->> 'fusion',
                     (pl ->> 'dense_weight')::double precision, (pl ->> 'rrf_k')::integer,
                     (pl ->> 'final_k')::integer;
    stage := 'fusion';
    plan := memory._explained(x);
    time_ms := (doc -> 'stages' ->> 'fusion_time_ms')::double precision;
    RETURN NEXT;
    EXECUTE format('EXPLAIN (%s) SELECT * FROM memory.hydrate($1, $2, 4, $3, $4)', opts)
        INTO x USING ids, p.embedding, pl ->> 'project', as_of;
    stage := 'provenance';
    plan := memory._explained(x);
    time_ms := (doc -> 'stages' ->> 'provenance_time_ms')::double precision;
    RETURN NEXT;
    IF (ev ->> 'budget')::integer > 0 THEN
        -- the call memory._finish makes (sql/071_execute.sql), its deeper candidates and the
        -- question's text (the speaker term) included
        EXECUTE format('EXPLAIN (%s) SELECT * FROM memory.select_evidence($1, $2, $3, $4, $5, $6, 4, $7, $8, $9, $10, $11, $12, $13, $14, $15)', opts)
            INTO x USING ids, state -> 'evidence_semantic', state -> 'evidence_lexical', pl ->> 'fusion',
                         (ev ->> 'budget')::integer, pl ->> 'project', lo, hi,
                         (pl ->> 'dense_weight')::double precision, (pl ->> 'rrf_k')::integer,
                         nullif(pl -> 'filter', 'null'), as_of, memory._deeper(pl, state, ids),
                         pl ->> 'query', (pl ->> 'valid_at')::timestamptz;
        stage := 'evidence';
        plan := memory._explained(x);
        time_ms := (doc -> 'stages' ->> 'evidence_time_ms')::double precision;
        RETURN NEXT;
    END IF;
END $$;
COMMENT ON FUNCTION memory._explain(jsonb, vector, boolean) IS
    'Implementation of memory.explain_query: the stages of the request req (memory._request) as it runs, each EXPLAINed (actual: ANALYZE, BUFFERS).';

-- memory.explain_query takes memory.answer's arguments (so memory.query's, and evidence),
-- made from its catalog entry as memory.answer's are from memory.query's (sql/070_query.sql),
-- and actual, which stands before fusion, where it stood before the arguments after it came
-- (a positional call keeps its meaning).
DO $$
DECLARE
    args text := pg_catalog.pg_get_function_arguments(memory._only('answer'));
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION memory.explain_query(%s) '
        'RETURNS TABLE (stage text, search_strategy text, plan jsonb, time_ms double precision) '
        'LANGUAGE sql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp '
        'BEGIN ATOMIC SELECT * FROM memory._explain(memory._request(query, project, levels, k, '
        'strategy, fusion, rrf_k, candidates, dense_weight, since, until, reference_time, '
        'evidence) || jsonb_build_object(''filter'', filter, ''min_cosine'', min_cosine, ''as_of'', as_of, ''valid_at'', valid_at, ''unsupported'', unsupported), query_embedding, actual); END',
        pg_catalog.regexp_replace(args, ', fusion ', ', actual boolean DEFAULT false, fusion '));
END $$;
COMMENT ON FUNCTION memory.explain_query(text, vector, text, text[], integer, text, boolean, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text, integer) IS
    'Plans the query with memory.plan_query''s planner and runs it with the executor memory.query and GET /memory/query use, then returns one row per stage that ran: plan (the plan itself, jsonb), lexical, semantic (the recall statement memory.semantic_search runs, memory._vector_stage''s choice: HNSW or, for a small named project, the exact stage, semantic_exact or, for a plain search of the current versions, semantic_exact_current with the plan it keeps for the session; its plan carries Stage and the hnsw.ef_search it ran with, memory._semantic_ef, NULL on the exact stage) or by_ids (the LexicalFirst cosine stage), evidence_lexical and evidence_semantic (the direct L0 legs), fusion, provenance and evidence, each with EXPLAIN (FORMAT JSON[, ANALYZE, BUFFERS]) of that stage with the plan''s values and settings, and time_ms, the time the stage took when the query ran. A caller under row-level security gets each EXPLAIN without its row and page counts (memory._without_counts: they would count other projects'' rows), with a key Counts saying so. Arguments as memory.answer; evidence NULL: the policy''s budget (explain_query shows the evidence stages GET /memory/query runs).';

-- The settings memory.semantic_search runs under (sql/030_vector.sql) are declared there
-- only: memory._explain takes each hnsw.* one and max_parallel_workers_per_gather from its
-- catalog entry, so the two can never disagree (the other stages explained are Function
-- Scans of PL/pgSQL functions, whose plans these settings do not change).
DO $$
DECLARE
    setting text;
BEGIN
    FOR setting IN
        SELECT c FROM pg_catalog.pg_proc p, unnest(p.proconfig) AS c
        WHERE p.oid = memory._only('semantic_search')
          AND (c LIKE 'hnsw.%' OR c LIKE 'max_parallel_workers_per_gather=%')
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET %s = %L', memory._only('_explain'),
                                  split_part(setting, '=', 1),
                                  substr(setting, strpos(setting, '=') + 1));
    END LOOP;
END $$;
