-- Configuration helpers: projects, levels and the embedding model.

CREATE OR REPLACE FUNCTION memory.project_id(project text)
RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- By the unique name's index, always: a few hundred projects fit in a handful of pages,
-- where the planner prefers reading them all, and every stage of every query looks its
-- project up; the work of a query then grew with the number of projects.
SET enable_seqscan = off
AS $$
DECLARE pid integer;
BEGIN
    IF project IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT p.id INTO pid FROM memory.projects p WHERE p.name = project;
    IF pid IS NULL THEN
        RAISE EXCEPTION 'unknown project "%"', project
            USING ERRCODE = @vocabulary.sqlstate_unknown_project@,
                  DETAIL = 'No row in memory.projects has this name.',
                  HINT = 'List projects with SELECT name FROM memory.projects, or ingest into it first.';
    END IF;
    RETURN pid;
END $$;
COMMENT ON FUNCTION memory.project_id(text) IS
    'Resolves a project name to its id; NULL stays NULL (no filter); an unknown name raises PM404.';

CREATE OR REPLACE FUNCTION memory.check_levels(levels text[])
RETURNS text[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF levels IS NULL THEN
        RETURN NULL;
    END IF;
    IF cardinality(levels) = 0 OR NOT levels <@ @vocabulary.levels@ OR array_position(levels, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'invalid levels %', levels
            USING ERRCODE = '22023',
                  DETAIL = 'levels must be a non-empty subset of {L0,L1,L2}.',
                  HINT = 'For example ARRAY[''L1'',''L2''] (the default) or ARRAY[''L0''].';
    END IF;
    RETURN levels;
END $$;
COMMENT ON FUNCTION memory.check_levels(text[]) IS
    'Validates a level filter: NULL means all levels; otherwise a non-empty subset of {L0,L1,L2} (22023).';

-- Time travel (issue 24). A version is visible as of t when the database knew it then:
-- created_at <= t < expired_at (NULL: still current), and it is not erased (an erased
-- version has no content to show, whenever it was current). as_of NULL: the current
-- versions. Valid time is a filter of what is ranked: a node is valid at t when
-- valid_from <= t < valid_to (a NULL bound is open). memory._valid_at says at which instant
-- a stage tests it, or NULL for no test: the caller's valid_at, else as_of, else now, and
-- now only when the scope holds a current version with a bounded valid time at all (one
-- probe of the partial index nodes_valid_bounded), so the usual store pays nothing.
CREATE OR REPLACE FUNCTION memory._valid_at(pid integer, as_of timestamptz, valid_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lo integer := coalesce(pid, -2147483648);
    hi integer := coalesce(pid, 2147483647);
BEGIN
    IF valid_at IS NOT NULL OR as_of IS NOT NULL THEN
        RETURN coalesce(valid_at, as_of);
    END IF;
    -- The project as a range of keys (every project for NULL): an index condition of
    -- nodes_valid_bounded in a plan made once for every project (memory.lexical_search
    -- looks this up under generic plans), where "pid IS NULL OR project_id = pid" would
    -- read the bounded nodes of every project. Its ends are made above: coalesce() in the
    -- statement is not leakproof, and under row-level security would be a filter after
    -- the policy, not an index condition (memory.lexical_query says what that cost).
    IF EXISTS (SELECT 1 FROM memory.nodes n
               WHERE n.project_id BETWEEN lo AND hi
                 AND n.expired_at IS NULL
                 -- nodes_valid_bounded's predicate (migration 0021): an expiry is an
                 -- upper bound of valid time, tested at the same instant
                 AND (n.valid_from IS NOT NULL OR n.valid_to IS NOT NULL OR n.expires_at IS NOT NULL)) THEN
        RETURN now();
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION memory._valid_at(integer, timestamptz, timestamptz) IS
    'The instant a search stage tests valid time at (valid_from <= t < valid_to, and t < expires_at): valid_at, else as_of, else now() when the project (NULL: any) has a current version with a bounded valid time or an expiry; NULL: no test needed.';

CREATE OR REPLACE FUNCTION memory.check_instant(value timestamptz, name text)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- as reference_time's bounds: an infinite or far instant is a mistake, not a question
    IF value IS NOT NULL AND NOT (
        isfinite(value)
        AND extract(year FROM value AT TIME ZONE 'UTC')
            BETWEEN @vocabulary.reference_first_year@ AND @vocabulary.reference_last_year@) THEN
        RAISE EXCEPTION '% must be a finite timestamp between the years % and %, got %', name,
            @vocabulary.reference_first_year@, @vocabulary.reference_last_year@, value
            USING ERRCODE = '22023',
                  HINT = format('For example %s => ''2024-06-01T00:00:00Z''; NULL: now.', name);
    END IF;
    RETURN value;
END $$;
COMMENT ON FUNCTION memory.check_instant(timestamptz, text) IS
    'Returns value (as_of, valid_at) unless it is infinite or its UTC year is outside the optimizer''s years: then 22023 naming the argument.';

CREATE OR REPLACE FUNCTION memory.strategies()
RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN @vocabulary.strategies@;
COMMENT ON FUNCTION memory.strategies() IS
    'The search strategies a query may be routed to or forced into (poimen_core.vocabulary STRATEGIES, written here by migrate).';

CREATE OR REPLACE FUNCTION memory.check_within(
    name text, value integer, lo integer, hi integer, hint text
)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR value NOT BETWEEN lo AND hi THEN
        RAISE EXCEPTION '% must be within %..%, got %', name, lo, hi, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023', HINT = hint;
    END IF;
    RETURN value;
END $$;
COMMENT ON FUNCTION memory.check_within(text, integer, integer, integer, text) IS
    'Returns value unless it is NULL or outside lo..hi: then 22023 naming the argument, with the hint.';

CREATE OR REPLACE FUNCTION memory.check_k(k integer)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory.check_within('k', k, @vocabulary.k_min@, @vocabulary.k_max@,
                               'k is the number of rows to return, e.g. k => 5.');
END
$$;
COMMENT ON FUNCTION memory.check_k(integer) IS
    'Returns k unless it is NULL or outside 1..50 (22023): the number of results a query returns.';

-- A metadata filter: JSON containment (metadata @> filter) on memory.nodes.metadata.
CREATE OR REPLACE FUNCTION memory.check_filter(filter jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF filter IS NULL OR filter = 'null'::jsonb OR filter = '{}'::jsonb THEN
        RETURN NULL;  -- no filter (an empty object contains nothing to test)
    END IF;
    IF jsonb_typeof(filter) <> 'object' THEN
        RAISE EXCEPTION 'filter must be a JSON object, got a JSON %', jsonb_typeof(filter)
            USING ERRCODE = '22023', HINT = 'e.g. filter => ''{"user": "alice"}'': nodes whose metadata contains it.';
    END IF;
    IF octet_length(filter::text) > @vocabulary.filter_max_bytes@ THEN
        RAISE EXCEPTION 'filter must be at most % bytes as JSON text, got %',
            @vocabulary.filter_max_bytes@, octet_length(filter::text)
            USING ERRCODE = '22023', HINT = 'Filter on a few keys; metadata containment is an equality test.';
    END IF;
    -- Nested at most filter_max_depth deep (poimen_core.vocabulary; the object itself is
    -- 1), as the service's parser: a filter
    -- names keys, and a deeper one is a mistake (or an attempt at a slow statement).
    IF (WITH RECURSIVE d(v, lvl) AS (
            SELECT filter, 1
            UNION ALL
            SELECT c.value, d.lvl + 1
            FROM d, LATERAL (SELECT e.value FROM jsonb_each(CASE WHEN jsonb_typeof(d.v) = 'object' THEN d.v END) e
                             UNION ALL
                             SELECT a.value FROM jsonb_array_elements(CASE WHEN jsonb_typeof(d.v) = 'array' THEN d.v END) a) c
            WHERE d.lvl <= @vocabulary.filter_max_depth@)
        SELECT max(d.lvl) FROM d WHERE jsonb_typeof(d.v) IN ('object', 'array'))
       > @vocabulary.filter_max_depth@ THEN
        RAISE EXCEPTION 'filter must be nested at most % deep', @vocabulary.filter_max_depth@
            USING ERRCODE = '22023', HINT = 'Filter on a few keys; metadata containment is an equality test.';
    END IF;
    RETURN filter;
END
$$;
COMMENT ON FUNCTION memory.check_filter(jsonb) IS
    'A metadata filter, checked: NULL for none (NULL, JSON null or {}), else a JSON object of at most 4096 bytes nested at most 8 deep (22023 otherwise) that a node''s metadata must contain (@>): the filter of memory.query, memory.list_nodes, memory.count_nodes and memory.forget.';

CREATE OR REPLACE FUNCTION memory.check_fusion(fusion text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF fusion IS NOT NULL AND NOT fusion = ANY (@vocabulary.fusions@) THEN
        RAISE EXCEPTION 'fusion must be one of %, got %', array_to_string(@vocabulary.fusions@, ', '), quote_literal(fusion)
            USING ERRCODE = '22023', HINT = 'Use rrf, convex or NULL (the policy decides: memory.policy()).';
    END IF;
    RETURN fusion;
END $$;
COMMENT ON FUNCTION memory.check_fusion(text) IS
    'Raises 22023 unless fusion is rrf, convex or NULL (the policy''s); returns it.';

CREATE OR REPLACE FUNCTION memory.check_evidence_budget(budget integer)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory.check_within('budget', budget, @vocabulary.evidence_min@, @vocabulary.evidence_max@,
                               'budget is the most L0 turns cited; 0 turns evidence off.');
END
$$;
COMMENT ON FUNCTION memory.check_evidence_budget(integer) IS
    'Raises 22023 unless the evidence budget is within 0..100; returns it.';

CREATE OR REPLACE FUNCTION memory.check_query(query text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Any whitespace, not only spaces (btrim): a tab-only query must fail here, in SQL,
    -- not later inside the PL/Python optimizer or as a silent empty result.
    IF query IS NULL OR query !~ '[^[:space:]]' THEN
        RAISE EXCEPTION 'query must not be empty'
            USING ERRCODE = '22023',
                  DETAIL = 'The query is NULL, empty or only whitespace.',
                  HINT = 'Pass the text to search for, e.g. memory_query(''kong body buffer'').';
    END IF;
    -- Bounded before anything reads it: 1 MB of text took 3.9 s to parse, embed and score
    -- (issue 43). The service's own cap (POIMEN_MAX_QUERY_CHARS) is at most this one.
    IF length(query) > @vocabulary.query_max_chars@ THEN
        RAISE EXCEPTION 'query is longer than % characters', @vocabulary.query_max_chars@
            USING ERRCODE = '22023',
                  DETAIL = format('It has %s characters.', length(query)),
                  HINT = format('A question, or a few sentences: at most %s characters (docs/sql-api.md, "Query cost").',
                                @vocabulary.query_max_chars@);
    END IF;
    RETURN $1;  -- not "RETURN query": plpgsql would read RETURN QUERY
END $$;
COMMENT ON FUNCTION memory.check_query(text) IS
    'Returns the query unchanged unless it is NULL, empty or only whitespace, or longer than the vocabulary''s QUERY_MAX_CHARS (@vocabulary.query_max_chars@) characters (22023).';

-- The free text a caller attaches to a change (forget's reason, a review's note) is kept in
-- every version it ends: 9 MB of a reason made a node's history too large to answer, for
-- good (issue 43). The service refuses it first, in the same words.
CREATE OR REPLACE FUNCTION memory.check_note(name text, value text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF length(value) > @vocabulary.note_max_chars@ THEN
        RAISE EXCEPTION '% is longer than % characters', name, @vocabulary.note_max_chars@
            USING ERRCODE = '22023', DETAIL = format('It has %s characters.', length(value)),
                  HINT = 'Say why in a sentence or two; the versions it ends keep it.';
    END IF;
    RETURN value;
END $$;
COMMENT ON FUNCTION memory.check_note(text, text) IS
    'Returns value (forget''s reason, a review''s note) unless it is longer than the vocabulary''s NOTE_MAX_CHARS (@vocabulary.note_max_chars@) characters: then 22023 naming the argument (name).';

CREATE OR REPLACE FUNCTION memory.check_weight(name text, weight double precision)
RETURNS double precision
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- NaN sorts above every number in PostgreSQL, so BETWEEN alone would let it through.
    IF weight IS NULL OR weight = 'NaN'::float8 OR weight NOT BETWEEN 0 AND 1 THEN
        RAISE EXCEPTION '% must be a number within [0, 1], got %', name, coalesce(weight::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    RETURN weight;
END $$;
COMMENT ON FUNCTION memory.check_weight(text, double precision) IS
    'Returns the weight unchanged if it is within [0, 1] (not NULL, NaN or infinite); otherwise 22023 naming the argument.';

CREATE OR REPLACE FUNCTION memory.configure_embedding(model text, dim integer)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
-- The service's role records the model on its first ingest; only the owner may alter nodes.
SECURITY DEFINER
-- No schema a caller could write to is on the path of a function that runs as the owner
-- (CVE-2018-1058): pgvector's type and operator class are named with their own schema.
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cur memory.embedding_model;
    vs name := (SELECT n.nspname FROM pg_catalog.pg_extension e
                JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
                WHERE e.extname = 'vector');
BEGIN
    IF model IS NULL OR model = '' OR dim IS NULL OR dim < 1 OR dim > 2000 THEN
        RAISE EXCEPTION 'invalid embedding configuration (model %, dim %)', model, dim
            USING ERRCODE = '22023', HINT = 'dim must be 1..2000 (the HNSW limit for vector).';
    END IF;
    SELECT * INTO cur FROM memory.embedding_model;
    IF FOUND THEN
        IF cur.model = model AND cur.dim = dim THEN
            RETURN;
        END IF;
        RAISE EXCEPTION 'database is configured for embedding model % (% dims), not % (% dims)',
                cur.model, cur.dim, model, dim
            USING ERRCODE = @vocabulary.sqlstate_embedding_model_mismatch@,
                  DETAIL = 'Mixing embedding models would make cosine scores meaningless.',
                  HINT = 'Use the configured model, or run `poimen-memory reembed` to switch.';
    END IF;
    INSERT INTO memory.embedding_model (model, dim) VALUES (model, dim);
    -- A new type brings its own storage (pgvector's EXTERNAL): keep the vector in the row
    -- again (migration 0010 says why).
    EXECUTE pg_catalog.format('ALTER TABLE memory.nodes ALTER COLUMN embedding TYPE %I.vector(%s),
             ALTER COLUMN embedding SET STORAGE MAIN', vs, dim);
    -- The HNSW indexes, from their one definition (sql/088_indexes.sql), now that a model
    -- is recorded.
    PERFORM memory._ensure_indexes();
END $$;
COMMENT ON FUNCTION memory.configure_embedding(text, integer) IS
    'Records the embedding model and dimension once; types nodes.embedding as vector(dim) stored in the row (MAIN) and builds the HNSW indexes (all levels, and L1/L2 only). A different model raises PM409.';

CREATE OR REPLACE FUNCTION memory.reset_embedding(model text, dim integer)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    graph name;
BEGIN
    -- Every HNSW graph, the large projects' own too (memory._project_graphs): one left on
    -- the column would be rebuilt on an undimensioned vector, which pgvector refuses.
    -- configure_embedding builds the shared ones again; the projects' own are built
    -- concurrently after this transaction (reembed's last step, or the next migrate:
    -- memory._missing_project_graphs).
    FOR graph IN
        SELECT c.relname FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'memory.nodes'::regclass
          AND (c.relname IN ('nodes_embedding_hnsw', 'nodes_embedding_hnsw_l1_l2')
               OR memory._is_project_graph(c.relname))
    LOOP
        EXECUTE pg_catalog.format('DROP INDEX memory.%I', graph);
    END LOOP;
    UPDATE memory.nodes SET embedding = NULL WHERE embedding IS NOT NULL;
    ALTER TABLE memory.nodes ALTER COLUMN embedding TYPE vector;
    DELETE FROM memory.embedding_model;
    PERFORM memory.configure_embedding(model, dim);
END $$;
COMMENT ON FUNCTION memory.reset_embedding(text, integer) IS
    'Switches the embedding model: clears every stored embedding and re-creates the column and the shared HNSW indexes; the large projects'' own graphs it drops, and `poimen-memory reembed` builds them concurrently once the vectors are back (memory._missing_project_graphs). Used by `poimen-memory reembed`.';

CREATE OR REPLACE FUNCTION memory.check_embedding(query_embedding vector)
RETURNS vector
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE d integer;
BEGIN
    IF query_embedding IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT dim INTO d FROM memory.embedding_model;
    IF d IS NULL THEN
        RAISE EXCEPTION 'no embedding model is configured'
            USING ERRCODE = @vocabulary.sqlstate_embedding_not_configured@, HINT = 'Ingest nodes first, or call memory.configure_embedding(model, dim).';
    END IF;
    IF vector_dims(query_embedding) <> d THEN
        RAISE EXCEPTION 'query embedding has % dimensions, the database stores %', vector_dims(query_embedding), d
            USING ERRCODE = @vocabulary.sqlstate_embedding_model_mismatch@, HINT = 'Embed the query with the model recorded in memory.embedding_model.';
    END IF;
    -- The cosine distance to a zero vector is NaN, which would sort above every score.
    IF vector_norm(query_embedding) = 0 THEN
        RAISE EXCEPTION 'query_embedding is the zero vector'
            USING ERRCODE = '22023',
                  DETAIL = 'Cosine similarity is undefined for a vector of norm 0.',
                  HINT = 'Pass the embedding of the query text, or NULL for a text-only query.';
    END IF;
    RETURN query_embedding;
END $$;
COMMENT ON FUNCTION memory.check_embedding(vector) IS
    'Returns the embedding unchanged if its dimension matches the configured model; otherwise PM409/PM412; the zero vector raises 22023.';

CREATE OR REPLACE FUNCTION memory.require_embedding(query_embedding vector)
RETURNS vector
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
BEGIN
    IF query_embedding IS NULL THEN
        RAISE EXCEPTION 'query_embedding must not be NULL' USING ERRCODE = '22023';
    END IF;
    RETURN memory.check_embedding(query_embedding);
END $$;
COMMENT ON FUNCTION memory.require_embedding(vector) IS
    'memory.check_embedding for the vector stages, where an embedding is required: NULL raises 22023.';
