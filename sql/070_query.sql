-- memory.query: the SQL user's entry point, composed from the stage functions.
-- Parallel labels: memory.query may call the PL/Python optimizer, whose plpy.execute runs in
-- a subtransaction, which a parallel operation forbids: it and its aliases are PARALLEL
-- UNSAFE. The stages it calls stay PARALLEL SAFE where they are.

-- The signatures changed ("limit" became k; node_id, external_id in the result): drop the
-- old ones first. DROP ... IF EXISTS is a no-op on a database that never had them.
DROP FUNCTION IF EXISTS public.memory_query(text, vector, text, text[], integer, text, text);
DROP FUNCTION IF EXISTS memory.query(text, vector, text, text[], integer, text, text, integer, integer);
DROP FUNCTION IF EXISTS memory.run_query(text, vector, text, text[], integer, text, text, integer, integer);
-- since, until and reference_time were added (the time filter): drop the shorter ones,
-- callers first (their atomic bodies depend on what they call).
DROP FUNCTION IF EXISTS public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision);
DROP FUNCTION IF EXISTS memory.query(text, vector, text, text[], integer, text, text, integer, integer, double precision);
DROP FUNCTION IF EXISTS memory.run_query(text, vector, text, text[], integer, text, text, integer, integer, double precision);
-- The row memory.query returns, declared once: memory.query, its implementation and the
-- public.memory_query alias all return SETOF memory.query_row. Declared here, like the
-- functions, rather than in a migration: it holds no data. The wanted shape is built as a
-- temporary type and compared with the stored one; only a different shape replaces it (with
-- the functions returning it, recreated below), so an unchanged type keeps its OID.
DO $$
DECLARE
    f regprocedure;
BEGIN
    CREATE TYPE pg_temp.query_row AS (
        rank integer,
        node_id bigint,
        external_id text,
        level text,
        sha256 text,
        project text,
        title text,
        text text,
        source text,
        breadcrumb text[],
        "timestamp" timestamptz,
        query_score double precision,
        lexical_score double precision,
        final_score double precision,
        semantic_rank integer,
        lexical_rank integer,
        fusion_method text,
        search_strategy text,
        provenance jsonb,
        provenance_truncated boolean
    );
    IF to_regtype('memory.query_row') IS NULL
       OR EXISTS ((SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = 'pg_temp.query_row'::regclass AND a.attnum > 0
                  EXCEPT
                   SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = pg_catalog.to_regclass('memory.query_row') AND a.attnum > 0 AND NOT a.attisdropped)
                  UNION ALL
                  (SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = pg_catalog.to_regclass('memory.query_row') AND a.attnum > 0 AND NOT a.attisdropped
                  EXCEPT
                   SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = 'pg_temp.query_row'::regclass AND a.attnum > 0)) THEN
        -- The functions returning the old shape go first, each alias before what it calls;
        -- no CASCADE: an object a DBA built on them stops the migration and is named in the
        -- error, rather than vanishing.
        FOR f IN
            SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.prorettype = pg_catalog.to_regtype('memory.query_row')
            ORDER BY p.pronamespace = 'memory'::regnamespace, p.proname = 'run_query'
        LOOP
            EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
        END LOOP;
        DROP TYPE IF EXISTS memory.query_row;
        EXECUTE (SELECT pg_catalog.format('CREATE TYPE memory.query_row AS (%s)',
                            pg_catalog.string_agg(pg_catalog.format('%I %s', a.attname,
                                pg_catalog.format_type(a.atttypid, a.atttypmod)), ', '
                                ORDER BY a.attnum))
                 FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = 'pg_temp.query_row'::regclass AND a.attnum > 0);
    END IF;
    DROP TYPE pg_temp.query_row;
    -- Before the declared type the query functions returned an anonymous TABLE; a return
    -- type cannot be replaced in place, so those are dropped, each alias before what it calls.
    FOR f IN
        SELECT p.oid FROM pg_catalog.pg_proc p
        WHERE p.prorettype = 'pg_catalog.record'::pg_catalog.regtype
          AND ((p.pronamespace = 'public'::regnamespace AND p.proname = 'memory_query')
               OR (p.pronamespace = 'memory'::regnamespace AND p.proname IN ('query', 'run_query')))
        ORDER BY p.proname = 'run_query', p.proname = 'query'
    LOOP
        EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
    END LOOP;
END $$;

-- project was added (the old signature goes first).
DROP FUNCTION IF EXISTS memory.hydrate(bigint[], vector, integer);

CREATE OR REPLACE FUNCTION memory.hydrate(
    ids bigint[],
    query_embedding vector DEFAULT NULL,
    max_depth integer DEFAULT 4,
    project_name text DEFAULT NULL  -- not "project": that is a result column
)
RETURNS TABLE (node_id bigint, level text, sha256 text, project text, title text, text text,
               source text, breadcrumb text[], "timestamp" timestamptz,
               query_score double precision, provenance jsonb, external_id text,
               provenance_truncated boolean)
LANGUAGE plpgsql STABLE PARALLEL SAFE
-- public holds pgvector's <=> unless migrate finds vector elsewhere and pins that schema.
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project_name);
BEGIN
    -- Dynamic, so the project is a constant to the planner: on the partitioned layout the
    -- id lookups then read the project's partition only, not one index per project.
    RETURN QUERY EXECUTE
        'WITH page AS MATERIALIZED (
             SELECT n.id, n.project_id, n.level, n.sha256, n.title, n.text, n.source,
                    n.breadcrumb, n.ts, n.embedding, n.external_id,
                    row_number() OVER (ORDER BY i.ord)::integer AS pos
             FROM unnest($1) WITH ORDINALITY AS i(id, ord)
             JOIN memory.nodes n ON n.id = i.id'
        || CASE WHEN pid IS NULL THEN '' ELSE ' AND n.project_id = $4' END || '
         )
         SELECT n.id, n.level, encode(n.sha256, ''hex''),
                coalesce($5, (SELECT p.name FROM memory.projects p WHERE p.id = n.project_id)),
                n.title, n.text, n.source, n.breadcrumb, n.ts,
                CASE WHEN $2 IS NULL OR n.embedding IS NULL THEN NULL
                     ELSE 1 - (n.embedding <=> memory.check_embedding($2)) END,
                pv.tree, n.external_id, pv.truncated
         FROM page n
         JOIN memory.provenance_forest(
                  ARRAY(SELECT g.id FROM page g ORDER BY g.pos), $3,
                  ARRAY(SELECT g.project_id FROM page g ORDER BY g.pos)) pv
           ON pv.position = n.pos
         ORDER BY n.pos'
        USING ids, query_embedding, max_depth, pid, CASE WHEN pid IS NOT NULL THEN project_name END;
END $$;
COMMENT ON FUNCTION memory.hydrate(bigint[], vector, integer, text) IS
    'Node rows for the given ids, in input order (with project_name: only ids of that project, PM404 when unknown), with query_score (if an embedding is given), provenance down to L0 as nested jsonb (capped: memory.provenance_forest, all trees in one pass), external_id, and provenance_truncated when a cap left parents out. One round trip for a whole result page.';

CREATE OR REPLACE FUNCTION memory.run_query(
    p_query text,
    p_embedding vector,
    p_project text,
    p_levels text[],
    p_k integer,
    p_strategy text,
    p_fusion text,
    p_rrf_k integer,
    p_candidates integer,
    p_dense_weight double precision,
    p_since text,
    p_until text,
    p_reference_time timestamptz
)
RETURNS SETOF memory.query_row
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    p record;
BEGIN
    -- The one plan and the one executor (sql/066_plan.sql, sql/071_execute.sql); rows cite
    -- no evidence list (memory.answer does), so the plan's budget is 0 and trees stay whole.
    SELECT * INTO p FROM memory._prepare(
        memory._request(p_query, p_project, p_levels, p_k, p_strategy, p_fusion, p_rrf_k,
                        p_candidates, p_dense_weight, p_since, p_until, p_reference_time, 0),
        p_embedding, 'memory.query');
    RETURN QUERY
    SELECT * FROM jsonb_populate_recordset(NULL::memory.query_row,
                                           memory._execute(p.plan, p.embedding) -> 'results');
END $$;
COMMENT ON FUNCTION memory.run_query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz) IS
    'Implementation of memory.query (positional parameters; call memory.query instead).';

CREATE OR REPLACE FUNCTION memory.answer(
    query text,
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    levels text[] DEFAULT ARRAY['L1', 'L2'],
    k integer DEFAULT 5,
    strategy text DEFAULT NULL,
    fusion text DEFAULT NULL,
    rrf_k integer DEFAULT NULL,
    candidates integer DEFAULT NULL,
    dense_weight double precision DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL,
    evidence integer DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    p record;
BEGIN
    SELECT * INTO p FROM memory._prepare(
        memory._request($1, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14), $2, 'memory.answer');
    RETURN memory._execute(p.plan, p.embedding);
END $$;
COMMENT ON FUNCTION memory.answer(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, integer) IS
    'The whole answer GET /memory/query gives, as jsonb: search_strategy, plan (memory.plan_query''s), results (as memory.query''s rows, each provenance tree kept to the cited L0 turns, provenance_l0_omitted counting the rest), evidence (the cited L0 turns, best first, at most evidence of them: NULL, the policy''s evidence_budget; 0: none, whole trees), counts and stage times. Arguments as memory.query.';

CREATE OR REPLACE FUNCTION memory.query(
    query text,
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    levels text[] DEFAULT ARRAY['L1', 'L2'],
    k integer DEFAULT 5,
    strategy text DEFAULT NULL,
    fusion text DEFAULT NULL,
    rrf_k integer DEFAULT NULL,
    candidates integer DEFAULT NULL,
    dense_weight double precision DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL
)
RETURNS SETOF memory.query_row
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT * FROM memory.run_query(query, query_embedding, project, levels, k, strategy,
                                   fusion, rrf_k, candidates, dense_weight, since, until,
                                   reference_time);
END;
COMMENT ON FUNCTION memory.query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz) IS
    'One-call retrieval: routes by the optimizer (or strategy), runs lexical/semantic legs, fuses them, and returns the top k (1..50) nodes with node_id, external_id, scores, ranks and provenance down to L0. Without query_embedding it routes and embeds in the database (memory.embed), as the HTTP service does; where the embedder or PL/Python is missing the lexical leg answers alone, with a NOTICE. fusion, rrf_k, candidates and dense_weight default to memory.policy(), the same policy the HTTP service reads. since/until (inclusive ISO dates or timestamps) keep only nodes whose timestamp is in range, inside every leg before its top k; reference_time (default now) anchors relative dates the optimizer extracts ("last week"), which filter only under memory.policy() extracted_dates = filter.';

-- Entry points on the default search_path, so `SELECT * FROM memory_query('...')` works.
-- Each alias is made from its target's catalog entry (arguments with their defaults, result,
-- volatility, parallel label), so an alias can never disagree with what it calls. An alias
-- left from an older signature is dropped; one that still matches is replaced in place, so
-- its OID (and anything a DBA built on it) survives a re-run. Every overload gets its alias.
DO $$
DECLARE
    a record;
    target regprocedure;
    old regprocedure;
    body text;
BEGIN
    FOR a IN SELECT * FROM (VALUES ('memory', 'query', 'memory_query'),
                                   ('memory', 'optimize_query', 'memory_optimize_query'))
                           AS v(nsp, fn, alias)
    LOOP
        FOR old IN
            SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.pronamespace = 'public'::regnamespace AND p.proname = a.alias
              AND NOT EXISTS (
                  SELECT 1 FROM pg_catalog.pg_proc t
                  WHERE t.pronamespace = a.nsp::regnamespace AND t.proname = a.fn
                    AND pg_catalog.pg_get_function_identity_arguments(t.oid)
                        = pg_catalog.pg_get_function_identity_arguments(p.oid)
                    AND pg_catalog.pg_get_function_result(t.oid)
                        = pg_catalog.pg_get_function_result(p.oid))
        LOOP
            EXECUTE pg_catalog.format('DROP FUNCTION %s', old);
        END LOOP;
        FOR target IN
            SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.pronamespace = a.nsp::regnamespace AND p.proname = a.fn
        LOOP
            SELECT pg_catalog.format('SELECT * FROM %I.%I(%s)', a.nsp, a.fn,
                                     pg_catalog.string_agg('$' || i, ', ' ORDER BY i))
              INTO body
              FROM pg_catalog.generate_series(1, (SELECT p.pronargs FROM pg_catalog.pg_proc p
                                                   WHERE p.oid = target)) AS i;
            EXECUTE pg_catalog.format(
                'CREATE OR REPLACE FUNCTION public.%I(%s) RETURNS %s LANGUAGE sql %s '
                'SET search_path = pg_catalog, pg_temp AS %L',
                a.alias, pg_catalog.pg_get_function_arguments(target),
                pg_catalog.pg_get_function_result(target),
                (SELECT CASE p.provolatile WHEN 'i' THEN 'IMMUTABLE' WHEN 's' THEN 'STABLE'
                                           ELSE 'VOLATILE' END
                        || CASE p.proparallel WHEN 's' THEN ' PARALLEL SAFE'
                                              WHEN 'r' THEN ' PARALLEL RESTRICTED'
                                              ELSE ' PARALLEL UNSAFE' END
                 FROM pg_catalog.pg_proc p WHERE p.oid = target),
                body);
            EXECUTE pg_catalog.format(
                'COMMENT ON FUNCTION public.%I(%s) IS %L', a.alias,
                pg_catalog.pg_get_function_identity_arguments(target),
                pg_catalog.format('Alias of %s.%s on the default search_path, made from its signature by sql/070_query.sql. See docs/sql-api.md.', a.nsp, a.fn));
        END LOOP;
    END LOOP;
END $$;
