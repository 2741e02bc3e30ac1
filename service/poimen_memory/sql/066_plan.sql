-- The one planner. memory._plan turns a request, what the caller can do (its capabilities)
-- and memory.policy() into the plan that every path runs: memory.query, memory.answer,
-- memory.evidence, memory.explain_query and the HTTP service (which calls it, then runs
-- the plan with memory._execute). Nothing else decides the route, the fusion, a leg's
-- depth, the levels, the time range or the evidence budget: when two places decide, they
-- come to disagree (they did: docs/sql-api.md, "One plan").
--
-- The request is jsonb because the same document arrives from SQL's named arguments and
-- from an HTTP query string; every key is checked here, and errors name the argument.
--   query, project, levels (default L1, L2), k (1..50), strategy, fusion, rrf_k,
--   candidates, dense_weight, since, until, reference_time, evidence (0..100),
--   filter (a JSON object a node's metadata must contain; memory.check_filter),
--   min_cosine (the relevance floor, -1..1; NULL: the policy's),
--   as_of (the versions visible then; NULL: current), valid_at (valid time's instant),
--   routing: the optimizer's output (memory.optimize_query, or poimen_core.optimizer in
--   the service: the same module). NULL: the planner asks memory.optimize_query when it
--   needs to, and routes without it where PL/Python is missing (managed PostgreSQL).
-- The capabilities say what the caller can bring; a key that is absent means SQL's own:
--   vector (boolean): a query vector is given or can be made (default true);
--   embed_model: the model the caller embeds with (NULL: the database's own);
--   embed_failed / opensearch_failed: the reason the caller's embedder or OpenSearch failed;
--   lexical: the lexical engines at hand (default ["postgres"]; the service adds opensearch);
--   rerank_depth: how many fused candidates a reranker will reorder (NULL: none).

CREATE OR REPLACE FUNCTION memory._request(
    query text, project text, levels text[], k integer, strategy text, fusion text,
    rrf_k integer, candidates integer, dense_weight double precision, since text, until text,
    reference_time timestamptz, evidence integer
)
RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- jsonb_build_object keeps SQL NULL as JSON null, which the planner reads as absent; levels
-- NULL stays null and is refused by name.
RETURN jsonb_build_object('query', query, 'project', project, 'levels', to_jsonb(levels),
                          'k', k, 'strategy', strategy, 'fusion', fusion, 'rrf_k', rrf_k,
                          'candidates', candidates, 'dense_weight', dense_weight,
                          'since', since, 'until', until, 'reference_time', reference_time,
                          'evidence', evidence);
COMMENT ON FUNCTION memory._request(text, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, integer) IS
    'The request document memory._plan reads, from SQL''s named arguments (one place, so every SQL entry point builds the same request).';

-- An instant of the request document (as_of, valid_at, reference_time): NULL when absent or
-- JSON null; an empty or malformed one is refused naming it (22023), where a cast would say
-- only "invalid input syntax for type timestamp with time zone" (issue 43: empty instants).
CREATE OR REPLACE FUNCTION memory._request_instant(req jsonb, name text)
RETURNS timestamptz
-- STABLE: the text's reading depends on the session's TimeZone. PARALLEL UNSAFE: its
-- exception block is a subtransaction, which a parallel worker cannot start (the planner
-- calling it is PARALLEL UNSAFE anyway).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v text := req ->> name;
BEGIN
    IF v IS NULL THEN
        RETURN NULL;
    END IF;
    IF btrim(v) = '' THEN
        RAISE EXCEPTION '% must not be empty', name
            USING ERRCODE = '22023', HINT = format('An ISO timestamp, e.g. %s => ''2024-06-01T00:00:00Z''; NULL (absent): now.', name);
    END IF;
    BEGIN
        RETURN v::timestamptz;
    EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow THEN
        RAISE EXCEPTION '% must be an ISO timestamp, got %', name, quote_literal(v)
            USING ERRCODE = '22023', HINT = format('For example %s => ''2024-06-01T00:00:00Z''.', name);
    END;
END $$;
COMMENT ON FUNCTION memory._request_instant(jsonb, text) IS
    'The instant a request document (memory._plan''s) holds under name: NULL when absent or null; 22023 naming it when empty or not a timestamp.';

CREATE OR REPLACE FUNCTION memory._plan(req jsonb, caps jsonb DEFAULT '{}')
RETURNS jsonb
-- PARALLEL UNSAFE: it may route in PL/Python (memory.optimize_query runs subtransactions).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
-- The clause scopes the set_config below to this call. Lookups by key: one plan a session
-- serves every request on one table (PostgreSQL kept making a plan per call for the count
-- of the question's postings below, 0.13 ms for a 0.1 ms statement); on the partitioned
-- layout the choice stays PostgreSQL's (memory._plan_cache_mode says why).
SET plan_cache_mode = auto
AS $$
DECLARE
    pol record;
    q text := memory.check_query(req ->> 'query');
    k integer := memory.check_k((req ->> 'k')::integer);
    lv text[];
    forced text := req ->> 'strategy';
    fusion text := memory.check_fusion(req ->> 'fusion');
    rrf_k integer := (req ->> 'rrf_k')::integer;
    cand integer := (req ->> 'candidates')::integer;
    dw double precision := (req ->> 'dense_weight')::double precision;
    routing jsonb := nullif(req -> 'routing', 'null');
    q_routed text := q;
    lexical_engines text[] := CASE WHEN jsonb_typeof(caps -> 'lexical') = 'array'
                                   THEN ARRAY(SELECT jsonb_array_elements_text(caps -> 'lexical'))
                                   ELSE ARRAY['postgres'] END;
    has_vec boolean := coalesce((caps ->> 'vector')::boolean, true);
    why jsonb := '[]';
    degraded jsonb := '[]';
    strat text;
    db_model text;
    rerank_k integer;
    lex_engine text;
    sem_engine text;
    lo timestamptz;
    hi timestamptz;
    tf jsonb;
    budget integer;
    pid integer;
    msg text;
    grammar jsonb;
    flt jsonb;
    floor double precision := (req ->> 'min_cosine')::double precision;
    floor_src text := 'argument';
    origin timestamptz;
    as_of timestamptz := memory.check_instant(memory._request_instant(req, 'as_of'), 'as_of');
    valid_at timestamptz := memory.check_instant(memory._request_instant(req, 'valid_at'), 'valid_at');
    unsupported text;
    -- the work budget (issue 43): the distinct terms BM25 would score and their postings
    terms text[];
    n_postings bigint;
    max_terms integer := memory._policy_value('query_max_terms')::integer;
    max_postings bigint := memory._policy_value('query_max_postings')::bigint;
    reads_postings boolean;
    -- the floor's lexical evidence (memory._after_fusion): how many of the query's terms a
    -- candidate must hold to be kept below min_cosine (NULL: none can), and whether any
    -- candidate is left for the cosine to judge
    floor_need integer;
    floor_on boolean;
    floor_why text;
    -- the service embeds with another model than the database's vectors': no cosine means anything
    other_model boolean := false;
BEGIN
    PERFORM pg_catalog.set_config('plan_cache_mode', memory._plan_cache_mode(), true);
    IF jsonb_typeof(req) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'a query request is a JSON object' USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(req -> 'levels') = 'null' THEN
        RAISE EXCEPTION 'levels must not be NULL'
            USING ERRCODE = '22023', HINT = 'Pass a non-empty subset of {L0,L1,L2}, e.g. ARRAY[''L1'',''L2''] (the default).';
    END IF;
    lv := memory.check_levels(CASE WHEN req ? 'levels'
                                   THEN ARRAY(SELECT jsonb_array_elements_text(req -> 'levels'))
                                   ELSE ARRAY['L1', 'L2'] END);
    IF forced IS NOT NULL AND NOT forced = ANY (memory.strategies()) THEN
        RAISE EXCEPTION 'strategy must be one of %, got %', array_to_string(memory.strategies(), ', '), quote_literal(forced)
            USING ERRCODE = '22023', HINT = 'Use LexicalOnly, LexicalFirst, Hybrid, SemanticOnly or NULL (optimizer decides).';
    END IF;
    IF dw IS NOT NULL THEN
        IF dw = 'NaN'::float8 OR NOT dw BETWEEN @vocabulary.dense_weight_min@ AND @vocabulary.dense_weight_max@ THEN
            RAISE EXCEPTION 'dense_weight must be within %..%, got %',
                @vocabulary.dense_weight_min@, @vocabulary.dense_weight_max@, dw
                USING ERRCODE = '22023', HINT = 'The semantic leg''s weight in convex fusion; NULL: the policy''s (memory.policy: dense_weight).';
        END IF;
    END IF;
    IF rrf_k IS NOT NULL THEN
        PERFORM memory.check_within('rrf_k', rrf_k, @vocabulary.rrf_k_min@, @vocabulary.rrf_k_max@,
                                    'RRF''s k; NULL: the policy''s (memory.policy: rrf_k).');
    END IF;
    IF cand IS NOT NULL THEN
        PERFORM memory.check_within('candidates', cand, @vocabulary.candidates_min@, @vocabulary.candidates_max@,
                                    'How deep each leg reads; NULL: the policy''s (memory.policy: candidates).');
    END IF;
    SELECT t.since_ts, t.before_ts INTO lo, hi FROM memory.time_range(req ->> 'since', req ->> 'until') t;
    -- Checked even where the route never asks the optimizer: SQL and HTTP refuse alike.
    PERFORM memory.check_reference_time(memory._request_instant(req, 'reference_time'));
    flt := memory.check_filter(req -> 'filter');
    grammar := memory.check_grammar(memory.parse_query(q));
    pid := memory.project_id(req ->> 'project');
    SELECT * INTO pol FROM memory.policy();
    IF floor IS NULL THEN
        floor := pol.min_cosine;
        floor_src := CASE WHEN floor IS NOT NULL THEN 'policy' END;
    ELSIF floor = 'NaN'::float8 OR NOT floor BETWEEN @vocabulary.min_cosine_min@ AND @vocabulary.min_cosine_max@ THEN
        RAISE EXCEPTION 'min_cosine must be within -1..1, got %', floor
            USING ERRCODE = '22023', HINT = 'A cosine similarity; NULL: the policy''s floor (memory.policy() min_cosine).';
    END IF;
    -- The argument by its name (evidence), as the service's contract names it.
    budget := CASE WHEN req ->> 'evidence' IS NOT NULL
                   THEN memory.check_within('evidence', (req ->> 'evidence')::integer,
                                            @vocabulary.evidence_min@, @vocabulary.evidence_max@,
                                            'The most L0 turns the answer cites; 0: no evidence list; NULL: the policy''s evidence_budget.')
                   ELSE memory.check_evidence_budget(pol.evidence_budget) END;
    unsupported := coalesce(req ->> 'unsupported', memory._policy_value('unsupported'));
    IF NOT unsupported = ANY (@vocabulary.unsupported@) THEN
        RAISE EXCEPTION 'unsupported must be one of %, got %', array_to_string(@vocabulary.unsupported@, ', '), quote_literal(unsupported)
            USING ERRCODE = '22023',
                  HINT = 'What an answer does with results whose evidence changed or went (docs/lifecycle.md); NULL: the policy''s (memory.policy: unsupported).';
    END IF;
    -- Recency counts a node's age from the moment the question is asked about (NULL: now,
    -- the executor's; the plan stays the same for the same request).
    origin := (req ->> 'reference_time')::timestamptz;
    SELECT m.model INTO db_model FROM memory.embedding_model m;
    -- No floor asked for nor set by the policy: the database's model's (the vocabulary's
    -- MODEL_FLOORS; a cosine means something only on its model's scale).
    IF floor IS NULL THEN
        floor := (@vocabulary.model_floors@ ->> db_model)::double precision;
        floor_src := CASE WHEN floor IS NOT NULL THEN 'model' END;
    END IF;

    -- A soft phrase (memory.parse_query: a quoted phrase in a question) is no exact-match
    -- operator: the query is routed as its words (routing_text), whoever routed the raw
    -- text (the service passes the optimizer's routing of what the caller typed).
    IF grammar ? 'routing_text' AND (routing IS NULL OR (routing ->> 'has_special_syntax')::boolean) THEN
        routing := NULL;
        q_routed := grammar ->> 'routing_text';
    END IF;
    -- The optimizer's routing, asked for only when something depends on it.
    IF routing IS NULL AND (forced IS NULL OR (fusion IS NULL AND pol.fusion_by_type <> '{}')
                            OR pol.extracted_dates = 'filter') THEN
        BEGIN
            routing := memory.optimize_query(q_routed, (req ->> 'reference_time')::timestamptz);
        EXCEPTION WHEN SQLSTATE @vocabulary.sqlstate_component_unavailable@ THEN
            GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT;
            why := why || to_jsonb(format('no optimizer on this database (%s): routed as Hybrid', msg));
            degraded := degraded || jsonb_build_object('stage', 'optimizer', 'reason', 'not_installed');
        END;
    END IF;

    strat := coalesce(forced, routing ->> 'search_strategy', 'Hybrid');
    IF forced IS NOT NULL THEN
        why := why || to_jsonb(format('strategy %s forced by the request', forced));
    END IF;
    IF cardinality(lexical_engines) = 0 AND strat <> 'SemanticOnly' THEN
        why := why || to_jsonb(format('no lexical engine: %s became SemanticOnly', strat));
        degraded := degraded || jsonb_build_object('stage', 'lexical', 'reason', 'no_lexical_engine');
        strat := 'SemanticOnly';
    END IF;
    IF strat <> 'LexicalOnly' AND NOT has_vec THEN
        IF cardinality(lexical_engines) = 0 THEN
            RAISE EXCEPTION 'no query vector and no lexical engine'
                USING ERRCODE = @vocabulary.sqlstate_component_unavailable@, HINT = 'Configure an embedder, or a lexical engine.';
        END IF;
        IF caps ->> 'embed_failed' IS NOT NULL THEN
            degraded := degraded || jsonb_build_object('stage', 'embed', 'reason', caps ->> 'embed_failed');
            why := why || to_jsonb(format('embedder unavailable (%s): fell back to LexicalOnly', caps ->> 'embed_failed'));
        ELSE
            why := why || coalesce(caps -> 'vector_why', to_jsonb('no embedder configured: LexicalOnly'::text));
        END IF;
        strat := 'LexicalOnly';
    END IF;
    IF strat <> 'LexicalOnly' AND caps ->> 'embed_model' IS NOT NULL
       AND db_model IS DISTINCT FROM NULL AND db_model <> caps ->> 'embed_model'
       AND cardinality(lexical_engines) > 0 THEN
        -- Another model's vectors would give meaningless cosine scores.
        degraded := degraded || jsonb_build_object('stage', 'embed', 'reason', 'model_mismatch');
        why := why || to_jsonb(format('the database holds %s vectors, the service embeds with %s: LexicalOnly',
                                      db_model, caps ->> 'embed_model'));
        strat := 'LexicalOnly';
        other_model := true;
    END IF;

    fusion := coalesce(fusion, pol.fusion_by_type ->> (routing ->> 'question_type'), pol.fusion);
    cand := coalesce(cand, pol.candidates);
    rerank_k := coalesce((caps ->> 'rerank_depth')::integer, k);

    -- The lexical engine: OpenSearch when the caller has it (its documents carry no
    -- timestamp, so not under a time filter), else Postgres BM25.
    IF strat <> 'SemanticOnly' THEN
        IF 'opensearch' = ANY (lexical_engines) AND caps ->> 'opensearch_failed' IS NOT NULL THEN
            degraded := degraded || jsonb_build_object('stage', 'lexical', 'reason', 'opensearch_' || (caps ->> 'opensearch_failed'));
            why := why || to_jsonb('OpenSearch unavailable, used Postgres lexical'::text);
        ELSIF 'opensearch' = ANY (lexical_engines) AND (as_of IS NOT NULL OR valid_at IS NOT NULL) THEN
            -- its documents are the current versions, without their valid time
            why := why || to_jsonb('as_of/valid_at: lexical leg on Postgres BM25, not OpenSearch'::text);
            IF NOT 'postgres' = ANY (lexical_engines) THEN
                degraded := degraded || jsonb_build_object('stage', 'lexical', 'reason', 'time_travel');
            END IF;
        ELSIF 'opensearch' = ANY (lexical_engines) AND flt IS NOT NULL THEN
            -- its documents carry no metadata
            why := why || to_jsonb('metadata filter: lexical leg on Postgres BM25, not OpenSearch'::text);
            IF NOT 'postgres' = ANY (lexical_engines) THEN
                degraded := degraded || jsonb_build_object('stage', 'lexical', 'reason', 'metadata_filter');
            END IF;
        ELSIF 'opensearch' = ANY (lexical_engines) AND (lo IS NOT NULL OR hi IS NOT NULL
                  OR (pol.extracted_dates = 'filter' AND jsonb_typeof(routing -> 'time_filter') = 'object'
                      AND req ->> 'since' IS NULL AND req ->> 'until' IS NULL)) THEN
            why := why || to_jsonb('time filter: lexical leg on Postgres BM25, not OpenSearch'::text);
            IF NOT 'postgres' = ANY (lexical_engines) THEN
                degraded := degraded || jsonb_build_object('stage', 'lexical', 'reason', 'time_filter');
            END IF;
        ELSIF 'opensearch' = ANY (lexical_engines) THEN
            lex_engine := 'opensearch';
        END IF;
        IF lex_engine IS NULL AND 'postgres' = ANY (lexical_engines) THEN
            lex_engine := 'postgres-bm25';
        END IF;
    END IF;
    sem_engine := CASE strat WHEN 'Hybrid' THEN 'hnsw' WHEN 'SemanticOnly' THEN 'hnsw'
                             WHEN 'LexicalFirst' THEN 'by-ids' END;

    -- The work budget, checked before anything runs (issue 43; docs/sql-api.md, "Query
    -- cost"): the distinct terms BM25 would score, and the postings a Postgres lexical leg
    -- (the query's, or the evidence's direct L0 leg) would read at most: the sum of their
    -- document frequencies in the projects the query reads, as memory.term_stats holds them
    -- for this caller (row-level security: another tenant's counts are neither read nor
    -- told). One index probe a term; the legs read the same rows again.
    terms := tsvector_to_array(to_tsvector('english'::regconfig,
                                           CASE WHEN (grammar ->> 'operators')::boolean
                                                THEN grammar ->> 'text' ELSE q END));
    reads_postings := coalesce(lex_engine = 'postgres-bm25', false)
                      OR (budget > 0 AND strat <> 'SemanticOnly' AND 'postgres' = ANY (lexical_engines));
    IF reads_postings AND cardinality(terms) > max_terms THEN
        RAISE EXCEPTION 'query has % distinct terms, at most % are scored', cardinality(terms), max_terms
            USING ERRCODE = @vocabulary.sqlstate_query_too_costly@,
                  DETAIL = 'Each term is one more posting list the lexical leg reads.',
                  HINT = format('Ask with fewer words (2,000 characters of prose hold fewer than 200 terms), or raise the policy: memory.set_policy(''query_max_terms'', ...), now %s.', max_terms);
    END IF;
    -- The relevance floor (docs/sql-api.md, "Relevance floor"): below min_cosine a fused
    -- candidate is held back unless the query's words vouch for it. A keyword query (at
    -- most floor_keyword_words words) is answered by its lexical matches: a candidate
    -- holding one of its terms is kept (MiniLM's cosine of two or three words with the
    -- paragraph that answers them is often below any floor that silences off-topic
    -- sentences); a longer query keeps a candidate holding floor_term_share of its terms
    -- (at least one). A query with required operands (a strict phrase, #tag, @mention) is
    -- not floored: every candidate matched what it required.
    floor_need := CASE WHEN cardinality(terms) = 0 THEN NULL
                       WHEN cardinality(regexp_split_to_array(btrim(CASE WHEN (grammar ->> 'operators')::boolean
                                                                          THEN grammar ->> 'text' ELSE q END), '\s+'))
                            <= memory._policy_value('floor_keyword_words')::integer THEN 1
                       ELSE greatest(1, ceil(cardinality(terms)
                                             * memory._policy_value('floor_term_share')::double precision))::integer END;
    floor_on := floor IS NOT NULL AND jsonb_array_length(grammar -> 'required') = 0;
    floor_why := CASE WHEN floor IS NULL THEN NULL
                      -- -1 turns the floor off: no vector is asked for it
                      WHEN floor <= @vocabulary.min_cosine_min@ THEN 'min_cosine -1: no cosine is below it'
                      WHEN NOT floor_on THEN 'the query requires operands: every candidate matched them'
                      WHEN strat = 'LexicalOnly' AND floor_need = 1
                           THEN 'a LexicalOnly keyword query: every candidate holds one of its terms'
                      WHEN strat = 'LexicalOnly' AND NOT has_vec THEN 'no query vector'
                      -- a caller who forces LexicalOnly asked for no embedding: the floor's
                      -- cosine would embed the text behind its back
                      WHEN other_model THEN 'the database holds another model''s vectors: no cosine to judge by'
                      WHEN forced = 'LexicalOnly' THEN 'strategy LexicalOnly forced by the request: no cosine to judge by' END;
    IF floor_why IS NOT NULL THEN
        floor_on := false;
    END IF;
    -- The project an equality, not a range of keys: term_stats' primary key leads with the
    -- project, and a range there made the planner of a table not yet analyzed read the
    -- project's every term (docs/benchmarks.md, "poimen-memory bench on a quiet machine").
    -- One statement for each case, each with a plan fit for any project (the function's
    -- generic plans, on one table); term_stats_lexeme_idx, (lexeme, project_id), serves both.
    IF pid IS NULL THEN
        SELECT coalesce(sum(t.df), 0) INTO n_postings
          FROM memory.term_stats t
         WHERE t.lexeme = ANY (terms);
    ELSE
        SELECT coalesce(sum(t.df), 0) INTO n_postings
          FROM memory.term_stats t
         WHERE t.lexeme = ANY (terms) AND t.project_id = pid;
    END IF;
    IF reads_postings AND n_postings > max_postings THEN
        RAISE EXCEPTION 'query would read % postings, at most % are read', n_postings, max_postings
            USING ERRCODE = @vocabulary.sqlstate_query_too_costly@,
                  DETAIL = format('Its %s terms have %s postings (their document frequencies summed) in %s.',
                                  cardinality(terms), n_postings,
                                  CASE WHEN pid IS NULL THEN 'the projects it reads' ELSE 'the project' END),
                  HINT = format('%sLeave out the commonest words, or raise the policy: memory.set_policy(''query_max_postings'', ...), now %s.',
                                CASE WHEN pid IS NULL THEN 'Name a project. ' ELSE '' END, max_postings);
    END IF;

    -- The time filter: the caller's since/until always win; a range the optimizer found in
    -- the text filters only under the policy extracted_dates = filter.
    IF req ->> 'since' IS NOT NULL OR req ->> 'until' IS NOT NULL THEN
        tf := jsonb_build_object('since', req -> 'since', 'until', req -> 'until',
                                 'source', 'argument', 'applied', true);
    ELSIF jsonb_typeof(routing -> 'time_filter') = 'object' AND pol.extracted_dates = 'filter' THEN
        SELECT t.since_ts, t.before_ts INTO lo, hi
          FROM memory.time_range(routing -> 'time_filter' ->> 'since', routing -> 'time_filter' ->> 'until') t;
        tf := (routing -> 'time_filter') || jsonb_build_object('source', 'extracted', 'applied', true);
    ELSE
        tf := jsonb_build_object('since', NULL, 'until', NULL, 'source', NULL, 'applied', false,
                                 'why', CASE WHEN jsonb_typeof(routing -> 'time_filter') = 'object'
                                             THEN 'the query names a date; policy extracted_dates = annotate: not applied' END);
    END IF;
    IF (tf ->> 'applied')::boolean THEN
        tf := tf || jsonb_build_object('why', format('%s: only nodes with %s <= timestamp < %s', tf ->> 'source',
                                                      coalesce(to_jsonb(lo) #>> '{}', '-infinity'),
                                                      coalesce(to_jsonb(hi) #>> '{}', 'infinity')));
    END IF;
    tf := jsonb_build_object('dates', coalesce(routing -> 'dates', '[]')) || tf;

    RETURN jsonb_build_object(
        'query', q,
        'project', req ->> 'project',
        'project_id', pid,
        'levels', to_jsonb(lv),
        'k', k,
        'search_strategy', strat,
        -- a floor is a cosine: it needs the query vector even where no leg does
        'needs_embedding', strat <> 'LexicalOnly' OR (floor_on AND has_vec),
        'question_type', routing ->> 'question_type',
        'confidence', (routing ->> 'confidence')::double precision,
        'reasons', coalesce(routing -> 'reasons', '[]'),
        'optimizer_strategy', routing ->> 'search_strategy',
        'fusion', fusion,
        'dense_weight', coalesce(dw, pol.dense_weight),
        'rrf_k', coalesce(rrf_k, pol.rrf_k),
        'final_k', rerank_k,
        'lexical', jsonb_build_object(
            'engine', lex_engine,
            'depth', CASE WHEN lex_engine IS NULL THEN NULL
                          WHEN strat = 'Hybrid' THEN cand
                          WHEN strat = 'LexicalFirst' THEN pol.cascade_candidates
                          ELSE rerank_k END),
        'semantic', jsonb_build_object(
            'engine', sem_engine,
            -- a convex cascade blends cosine with BM25 over every lexical id: depth NULL
            'depth', CASE strat WHEN 'Hybrid' THEN cand WHEN 'SemanticOnly' THEN rerank_k
                                WHEN 'LexicalFirst' THEN CASE WHEN fusion = 'convex' THEN NULL ELSE rerank_k END
                     END),
        'since_ts', lo,
        'before_ts', hi,
        -- how the query grammar read the query (memory.parse_query); every leg honours it
        'grammar', grammar,
        'filter', flt,
        -- time travel: the versions the database held at as_of (NULL: the current ones),
        -- and the instant valid time is tested at (NULL: as_of, else now)
        'as_of', as_of,
        'valid_at', valid_at,
        -- results whose support is stale, partial or none (issue 40): demoted, excluded or kept
        'unsupported', jsonb_build_object('policy', unsupported,
                                          'source', CASE WHEN req ? 'unsupported' AND req ->> 'unsupported' IS NOT NULL
                                                         THEN 'argument' ELSE 'policy' END),
        'floor', jsonb_build_object('min_cosine', floor, 'source', floor_src, 'applied', floor_on,
                                    'terms', to_jsonb(terms), 'keep_with_terms', floor_need,
                                    'why', floor_why),
        'time_filter', tf,
        -- the work budget it was checked against (memory.policy: query_max_terms,
        -- query_max_postings; operands: the vocabulary's QUERY_MAX_OPERANDS)
        'cost', jsonb_build_object('terms', cardinality(terms), 'max_terms', max_terms,
                                   'postings', n_postings, 'max_postings', max_postings,
                                   'checked', reads_postings),
        -- recency as a ranking signal (the policy's; docs/benchmarks.md, "Recency")
        'recency', jsonb_build_object('half_life_days', pol.recency_half_life_days,
                                      'weight', pol.recency_weight, 'origin', origin,
                                      'applied', pol.recency_half_life_days IS NOT NULL
                                                 AND pol.recency_weight > 0),
        'evidence', jsonb_build_object(
            'budget', budget,
            'source', CASE WHEN req ->> 'evidence' IS NULL THEN 'policy' ELSE 'argument' END,
            'candidates', pol.evidence_candidates,
            'weight', pol.evidence_weight,
            'neighbours', pol.evidence_neighbours,
            -- A Hybrid query of L0 alone at the evidence depth on Postgres BM25 has run the
            -- direct legs already.
            'reuses_legs', budget > 0 AND lv = ARRAY['L0'] AND strat = 'Hybrid'
                           AND cand = pol.evidence_candidates
                           AND lex_engine IS NOT DISTINCT FROM 'postgres-bm25',
            'lexical', budget > 0 AND strat <> 'SemanticOnly' AND 'postgres' = ANY (lexical_engines),
            'semantic', budget > 0 AND strat <> 'LexicalOnly'),
        'embedding_model', db_model,
        'routing', routing,
        'why', why,
        'degraded', degraded);
END $$;
COMMENT ON FUNCTION memory._plan(jsonb, jsonb) IS
    'The planner every query path runs (memory.query, memory.answer, memory.evidence, memory.explain_query, the HTTP service): request (jsonb: query, project, levels, k, strategy, fusion, rrf_k, candidates, dense_weight, since, until, reference_time, evidence, filter, min_cosine, as_of, valid_at, unsupported, routing) and capabilities (vector, embed_model, embed_failed, lexical, opensearch_failed, rerank_depth) to the plan: route with its reasons, fusion and its parameters, each leg''s engine and depth, levels, time range, the query grammar''s parse (grammar) and the metadata filter (filter), time travel (as_of, valid_at), what happens to results in doubt (unsupported: demote, exclude or keep), the relevance floor (floor), the work budget it was checked against (cost: distinct terms and the postings a Postgres lexical leg would read, against the policy''s query_max_terms and query_max_postings; over either, PM400 naming the limit; more grammar operands than the vocabulary allows, 22023), recency (the policy''s half-life and weight, and the origin its ages count from: reference_time, NULL for now), evidence budget. Errors name the argument (22023), PM404 for an unknown project.';
