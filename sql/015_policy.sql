-- Retrieval policy: the one home of leg depths, the fusion default, RRF k and the dense
-- weight. memory.query and the HTTP service both read it here, so SQL and HTTP rank alike.
-- The defaults are the measured ones (docs/benchmarks.md); a DBA changes them with
-- memory.set_policy, which validates the value and records it in memory.config.

-- extracted_dates, then the evidence keys were added to the result: drop an older shape first.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.oid = to_regprocedure('memory.policy()')
                 AND NOT ('min_cosine' = ANY (p.proargnames))) THEN
        DROP FUNCTION memory.policy();
    END IF;
END $$;

CREATE OR REPLACE FUNCTION memory.policy()
RETURNS TABLE (fusion text, rrf_k integer, dense_weight double precision, candidates integer,
               cascade_candidates integer, fusion_by_type jsonb, extracted_dates text,
               evidence_budget integer, evidence_candidates integer,
               evidence_weight double precision, evidence_neighbours double precision,
               min_cosine double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    WITH c AS (
        SELECT coalesce(jsonb_object_agg(c.key, c.value), '{}'::jsonb) AS v
        FROM memory.config c
        WHERE c.key IN ('fusion', 'rrf_k', 'dense_weight', 'candidates', 'cascade_candidates',
                        'fusion_by_type', 'extracted_dates', 'evidence_budget',
                        'evidence_candidates', 'evidence_weight', 'evidence_neighbours',
                        'min_cosine')
    )
    SELECT coalesce(v ->> 'fusion', 'convex'),
           coalesce((v ->> 'rrf_k')::integer, 10),
           coalesce((v ->> 'dense_weight')::double precision, 0.4),
           coalesce((v ->> 'candidates')::integer, 50),
           coalesce((v ->> 'cascade_candidates')::integer, 200),
           coalesce((v ->> 'fusion_by_type')::jsonb, '{}'::jsonb),
           -- measured on LoCoMo dev (docs/benchmarks.md, "Time filters")
           coalesce(v ->> 'extracted_dates', 'annotate'),
           -- measured on LoCoMo dev (docs/benchmarks.md, "Evidence within a budget")
           coalesce((v ->> 'evidence_budget')::integer, 20),
           coalesce((v ->> 'evidence_candidates')::integer, 50),
           coalesce((v ->> 'evidence_weight')::double precision, 0.5),
           coalesce((v ->> 'evidence_neighbours')::double precision, 0.4),
           -- the relevance floor: off unless set (docs/benchmarks.md, "A relevance floor")
           (v ->> 'min_cosine')::double precision
    FROM c;
END
$$;
COMMENT ON FUNCTION memory.policy() IS
    'The retrieval policy in force: default fusion (convex), RRF k (10), convex dense weight (0.4), Hybrid leg depth (candidates, 50), LexicalFirst lexical depth (cascade_candidates, 200), per-question-type fusion overrides, and what a date the optimizer extracts from the query does (extracted_dates: annotate, the default, only reports it in the plan; filter applies it as since/until when the caller gave none), and the evidence a response cites (memory.select_evidence: evidence_budget, 20, the most L0 turns cited; evidence_candidates, 50, the depth of the direct L0 legs; evidence_weight, 0.5, how much citation by a top result counts against a turn''s own match; evidence_neighbours, 0.4, how much a candidate lifts the turns said just before and after it), and the relevance floor (min_cosine, NULL: off; the fused candidates whose cosine similarity to the query is below it are held back and counted as withheld). Read by memory.query and by the HTTP service; change it with memory.set_policy.';

CREATE OR REPLACE FUNCTION memory.set_policy(key text, value text)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ok boolean;
    t text;
BEGIN
    ok := CASE key
        WHEN 'fusion' THEN value = ANY (@vocabulary.fusions@)
        WHEN 'rrf_k' THEN value ~ '^[0-9]{1,6}$'
        WHEN 'dense_weight' THEN value ~ '^[0-9]*\.?[0-9]+$' AND value::double precision <= 1
        WHEN 'candidates' THEN value ~ '^[0-9]{1,4}$' AND value::integer BETWEEN 1 AND 1000
        WHEN 'cascade_candidates' THEN value ~ '^[0-9]{1,5}$' AND value::integer BETWEEN 1 AND 10000
        WHEN 'fusion_by_type' THEN value IS NOT NULL
        WHEN 'exact_search_max_k' THEN value ~ '^[0-9]{1,6}$' AND value::integer BETWEEN 1 AND 100000
        WHEN 'provenance_max_parents' THEN value ~ '^[0-9]{1,4}$' AND value::integer BETWEEN 1 AND 1000
        WHEN 'provenance_max_nodes' THEN value ~ '^[0-9]{1,6}$' AND value::integer BETWEEN 1 AND 100000
        WHEN 'extracted_dates' THEN value IN ('annotate', 'filter')
        WHEN 'evidence_budget' THEN value ~ '^[0-9]{1,3}$' AND value::integer BETWEEN 0 AND 100
        WHEN 'evidence_candidates' THEN value ~ '^[0-9]{1,4}$' AND value::integer BETWEEN 1 AND 1000
        WHEN 'evidence_weight' THEN value ~ '^[0-9]*\.?[0-9]+$' AND value::double precision <= 10
        WHEN 'evidence_neighbours' THEN value ~ '^[0-9]*\.?[0-9]+$' AND value::double precision <= 10
        WHEN 'min_cosine' THEN value ~ '^-?[0-9]*\.?[0-9]+$' AND value::double precision BETWEEN -1 AND 1
        WHEN 'forget_derived' THEN value IN ('flag', 'cascade')
        ELSE NULL END;
    IF ok IS NULL THEN
        RAISE EXCEPTION 'unknown policy key "%"', key
            USING ERRCODE = '22023',
                  HINT = 'Keys: fusion, rrf_k, dense_weight, candidates, cascade_candidates, fusion_by_type, exact_search_max_k, provenance_max_parents, provenance_max_nodes, extracted_dates, evidence_budget, evidence_candidates, evidence_weight, evidence_neighbours, min_cosine, forget_derived.';
    END IF;
    IF key = 'fusion_by_type' THEN
        -- {"Factual": "convex", "Open": "rrf"}: question types from memory.optimize_query.
        IF jsonb_typeof(value::jsonb) <> 'object' THEN
            ok := false;
        ELSE
            FOR t IN SELECT j.value FROM jsonb_each_text(value::jsonb) j LOOP
                ok := ok AND t = ANY (@vocabulary.fusions@);
            END LOOP;
            ok := ok AND NOT EXISTS (
                SELECT 1 FROM jsonb_object_keys(value::jsonb) k(name)
                WHERE NOT k.name = ANY (@vocabulary.question_types@));
        END IF;
    END IF;
    IF NOT ok THEN
        RAISE EXCEPTION 'invalid value "%" for policy key "%"', value, key
            USING ERRCODE = '22023',
                  HINT = 'fusion: rrf|convex; rrf_k: integer >= 0; dense_weight: 0..1; candidates: 1..1000; cascade_candidates: 1..10000; fusion_by_type: {"Factual":"convex",...}; exact_search_max_k: 1..100000; provenance_max_parents: 1..1000; provenance_max_nodes: 1..100000; extracted_dates: annotate|filter; evidence_budget: 0..100 (0: off); evidence_candidates: 1..1000; evidence_weight: 0..10; evidence_neighbours: 0..10 (0: off); min_cosine: -1..1; forget_derived: flag|cascade.';
    END IF;
    INSERT INTO memory.config AS c (key, value) VALUES (key, value)
    ON CONFLICT ON CONSTRAINT config_pkey DO UPDATE SET value = EXCLUDED.value, updated_at = now();
END $$;
COMMENT ON FUNCTION memory.set_policy(text, text) IS
    'Sets one retrieval policy value after validating it (22023 otherwise). Takes effect for memory.query at once and for the HTTP service on its next query.';

CREATE OR REPLACE FUNCTION memory.reset_policy(key text DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM memory.config c
    WHERE c.key IN ('fusion', 'rrf_k', 'dense_weight', 'candidates', 'cascade_candidates',
                    'fusion_by_type', 'exact_search_max_k', 'provenance_max_parents',
                    'provenance_max_nodes', 'extracted_dates', 'evidence_budget',
                    'evidence_candidates', 'evidence_weight', 'evidence_neighbours', 'min_cosine',
                    'forget_derived')
      AND (reset_policy.key IS NULL OR c.key = reset_policy.key)
$$;
COMMENT ON FUNCTION memory.reset_policy(text) IS
    'Returns one policy key (or, with NULL, all of them) to its built-in default.';
