-- In-database BM25. Term statistics (postings, document frequencies, corpus sizes) are
-- kept exact by statement-level triggers, so inserts, updates, deletes and TRUNCATE never
-- drift the IDF. Term frequencies come from tsvector positions, which PostgreSQL caps at
-- 256 per lexeme (and positions at 16383): beyond that a term's tf is under-counted.
-- term_stats also carries, per (project, lexeme), the largest tf and the smallest dl/tf of
-- its postings (migration 0004): together they bound any posting's BM25 weight, which is
-- what lets memory.lexical_search skip postings that cannot reach the top k (MaxScore).

CREATE OR REPLACE FUNCTION memory.lexical_document(title text, breadcrumb text[], body text)
RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN to_tsvector('english'::regconfig,
                   coalesce(title, '') || ' ' || coalesce(array_to_string(breadcrumb, ' '), '') || ' ' || body);
COMMENT ON FUNCTION memory.lexical_document(text, text[], text) IS
    'The text BM25 indexes for a node: title, breadcrumb and body, English stemming and stop words.';

CREATE OR REPLACE FUNCTION memory.nodes_lexical_row()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.tsv := memory.lexical_document(NEW.title, NEW.breadcrumb, NEW.text);
    NEW.lex_len := coalesce((SELECT sum(cardinality(u.positions)) FROM unnest(NEW.tsv) u), 0);
    RETURN NEW;
END $$;

-- One statement trigger keeps the statistics for INSERT, UPDATE, DELETE and TRUNCATE: an
-- update is a delete of the old statistics followed by an insert of the new ones, so the two
-- halves below serve all three. Each half reads only the transition table its operation has
-- (PL/pgSQL plans a statement when it first runs it).
-- Only current versions (expired_at IS NULL) have postings and count in df, N and avgdl
-- (migration 0012): a version that is superseded, retired or erased leaves the statistics
-- in the statement that ends it, exactly as a DELETE would, and the statistics of a
-- project always equal a rebuild from its current rows (memory.lexical_rebuild_check).
CREATE OR REPLACE FUNCTION memory.nodes_lexical_statement()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    every boolean := TG_OP <> 'UPDATE';
    changed bigint[];  -- UPDATE: the rows whose statistics change
    gone_projects integer[];  -- the terms whose last current posting went
    gone_lexemes text[];
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE memory.postings, memory.term_stats, memory.corpus_stats;
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- Only rows whose lexical content, project or level changed: an embedding-only
        -- update (reembed) must not rewrite postings. Column lists are not allowed with
        -- transition tables, hence the comparison here.
        SELECT array_agg(o.id) INTO changed
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE (o.tsv, o.project_id, o.level, o.lex_len, o.expired_at IS NULL)
              IS DISTINCT FROM (n.tsv, n.project_id, n.level, n.lex_len, n.expired_at IS NULL);
        IF changed IS NULL THEN
            RETURN NULL;
        END IF;
    END IF;
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        DELETE FROM memory.postings p USING old_rows o
        WHERE p.node_id = o.id AND o.expired_at IS NULL AND (every OR o.id = ANY (changed));
        -- Sorted updates and upserts take row locks in one order, so concurrent writers
        -- cannot deadlock. Score bounds are never lowered here: they stay valid, possibly
        -- loose, until the term's last document goes and its row with them.
        WITH counted AS (
            UPDATE memory.term_stats t SET df = t.df - d.cnt
            FROM (SELECT o.project_id, u.lexeme, count(*) AS cnt
                  FROM old_rows o, unnest(o.tsv) u
                  WHERE o.expired_at IS NULL AND (every OR o.id = ANY (changed))
                  GROUP BY 1, 2 ORDER BY 1, 2) d
            WHERE t.project_id = d.project_id AND t.lexeme = d.lexeme
            RETURNING t.project_id, t.lexeme, t.df
        )
        SELECT array_agg(c.project_id), array_agg(c.lexeme) INTO gone_projects, gone_lexemes
        FROM counted c WHERE c.df = 0;
        -- Only a term this statement counted down can have reached 0, so its row goes by
        -- the key: "DELETE ... WHERE df = 0" read every term of every project at each
        -- statement that ended a version (48 ms at 30,000 nodes, and growing with them).
        IF gone_lexemes IS NOT NULL THEN
            DELETE FROM memory.term_stats t
            USING unnest(gone_projects, gone_lexemes) AS g(project_id, lexeme)
            WHERE t.project_id = g.project_id AND t.lexeme = g.lexeme AND t.df = 0;
        END IF;
        UPDATE memory.corpus_stats c SET n_docs = c.n_docs - d.cnt, total_len = c.total_len - d.len
        FROM (SELECT o.project_id, count(*) AS cnt, sum(o.lex_len) AS len FROM old_rows o
              WHERE o.expired_at IS NULL AND (every OR o.id = ANY (changed))
              GROUP BY 1 ORDER BY 1) d
        WHERE c.project_id = d.project_id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        -- In primary-key order: a large statement (a COPY, a big batch) then fills the key's
        -- B-tree page after page, at its fill factor, instead of splitting pages at random
        -- (measured at 250k nodes in one COPY: the key 84.5 -> 58.0 bytes a posting, the
        -- COPY 232 -> 191 s; docs/benchmarks.md "Loading postings in key order").
        INSERT INTO memory.postings (lexeme, project_id, node_id, level, tf, dl)
        SELECT u.lexeme, n.project_id, n.id, n.level, cardinality(u.positions), n.lex_len
        FROM new_rows n, unnest(n.tsv) u
        WHERE n.expired_at IS NULL AND (every OR n.id = ANY (changed))
        ORDER BY 1, 2, 3;
        INSERT INTO memory.term_stats AS t (project_id, lexeme, df, max_tf, min_dl_per_tf)
        SELECT n.project_id, u.lexeme, count(*), max(cardinality(u.positions)),
               min(n.lex_len::double precision / greatest(cardinality(u.positions), 1))
        FROM new_rows n, unnest(n.tsv) u
        WHERE n.expired_at IS NULL AND (every OR n.id = ANY (changed))
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (project_id, lexeme) DO UPDATE
            SET df = t.df + EXCLUDED.df,
                max_tf = greatest(t.max_tf, EXCLUDED.max_tf),
                min_dl_per_tf = least(t.min_dl_per_tf, EXCLUDED.min_dl_per_tf);
        INSERT INTO memory.corpus_stats AS c (project_id, n_docs, total_len)
        SELECT n.project_id, count(*), sum(n.lex_len) FROM new_rows n
        WHERE n.expired_at IS NULL AND (every OR n.id = ANY (changed))
        GROUP BY 1 ORDER BY 1
        ON CONFLICT (project_id) DO UPDATE
            SET n_docs = c.n_docs + EXCLUDED.n_docs, total_len = c.total_len + EXCLUDED.total_len;
    END IF;
    RETURN NULL;
END $$;

COMMENT ON FUNCTION memory.nodes_lexical_row() IS
    'Row trigger: computes a node''s tsvector and BM25 length (lex_len) from title, breadcrumb and text.';
COMMENT ON FUNCTION memory.nodes_lexical_statement() IS
    'Statement trigger for INSERT, UPDATE, DELETE and TRUNCATE (which empties the statistics): removes the old rows'' postings, document frequencies and corpus sizes and adds the new rows'' (an UPDATE only for rows whose lexical content, project or level changed). Score bounds only grow: they stay valid, possibly loose.';

-- A trigger is (re)created only when it differs from its definition here (or is disabled):
-- CREATE OR REPLACE TRIGGER locks the table SHARE ROW EXCLUSIVE, which would queue every
-- writer behind it on a deploy that changes nothing. Definitions are written as
-- pg_get_triggerdef prints them; memory._ensure_trigger refuses one that is not.
CREATE OR REPLACE FUNCTION memory._ensure_trigger(tbl regclass, trigger_name name, definition text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    wanted text := pg_catalog.btrim(pg_catalog.regexp_replace(definition, '\s+', ' ', 'g'));
    have text;
BEGIN
    SELECT pg_catalog.pg_get_triggerdef(t.oid) INTO have FROM pg_catalog.pg_trigger t
    WHERE t.tgrelid = tbl AND t.tgname = trigger_name AND t.tgenabled = 'O';
    IF have = wanted THEN
        RETURN false;
    END IF;
    EXECUTE pg_catalog.regexp_replace(wanted, '^CREATE TRIGGER ', 'CREATE OR REPLACE TRIGGER ');
    SELECT pg_catalog.pg_get_triggerdef(t.oid) INTO have FROM pg_catalog.pg_trigger t
    WHERE t.tgrelid = tbl AND t.tgname = trigger_name;
    IF have IS DISTINCT FROM wanted THEN
        RAISE EXCEPTION 'trigger % is not written as PostgreSQL prints it', trigger_name
            USING DETAIL = pg_catalog.format('sql/ has: %s; pg_get_triggerdef: %s', wanted, have),
                  HINT = 'Write the definition as pg_get_triggerdef gives it, or every migrate re-creates it.';
    END IF;
    RETURN true;
END $$;
COMMENT ON FUNCTION memory._ensure_trigger(regclass, name, text) IS
    'Creates or replaces one of the product''s triggers only when it is missing, disabled or differs from definition (written as pg_get_triggerdef prints it); true when it did. Run by migrate, so a deploy that changes nothing locks no table.';

-- The statement triggers of a table that read its transition tables, one per change
-- (<prefix>_insert, <prefix>_update, <prefix>_delete), all running one function: the BM25
-- statistics here and the OpenSearch outbox (sql/080_outbox.sql) follow every change so.
CREATE OR REPLACE FUNCTION memory._ensure_statement_triggers(tbl regclass, prefix text, func regproc)
RETURNS integer
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record;
    made integer := 0;
BEGIN
    FOR c IN SELECT * FROM (VALUES ('insert', 'NEW TABLE AS new_rows'),
                                   ('update', 'OLD TABLE AS old_rows NEW TABLE AS new_rows'),
                                   ('delete', 'OLD TABLE AS old_rows')) AS v(op, transition) LOOP
        IF memory._ensure_trigger(tbl, (prefix || '_' || c.op)::name, pg_catalog.format(
               'CREATE TRIGGER %I AFTER %s ON %s REFERENCING %s FOR EACH STATEMENT EXECUTE FUNCTION %s()',
               prefix || '_' || c.op, pg_catalog.upper(c.op), tbl, c.transition, func)) THEN
            made := made + 1;
        END IF;
    END LOOP;
    RETURN made;
END $$;
COMMENT ON FUNCTION memory._ensure_statement_triggers(regclass, text, regproc) IS
    'Ensures (memory._ensure_trigger) the AFTER INSERT, UPDATE and DELETE statement triggers prefix_insert, prefix_update and prefix_delete on tbl, with their transition tables (new_rows, old_rows), each executing func; returns how many it made or replaced.';

SELECT memory._ensure_trigger('memory.nodes', 'nodes_lexical_row',
    'CREATE TRIGGER nodes_lexical_row BEFORE INSERT OR UPDATE OF title, breadcrumb, text ON memory.nodes
     FOR EACH ROW EXECUTE FUNCTION memory.nodes_lexical_row()');
SELECT memory._ensure_statement_triggers('memory.nodes', 'nodes_lexical', 'memory.nodes_lexical_statement');
SELECT memory._ensure_trigger('memory.nodes', 'nodes_lexical_truncate',
    'CREATE TRIGGER nodes_lexical_truncate AFTER TRUNCATE ON memory.nodes
     FOR EACH STATEMENT EXECUTE FUNCTION memory.nodes_lexical_statement()');

CREATE OR REPLACE FUNCTION memory.lexical_query(
    query text, pid integer, k integer, k1 double precision, b double precision,
    OUT terms text[], OUT n double precision, OUT avgdl double precision
)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- The project as a range of keys (every project for NULL), made here: written in the
    -- statement, coalesce() is not leakproof, so under row-level security the range waited
    -- behind the policy as a filter, and the service's every lexical leg read the sizes of
    -- every project (a sequential scan, 169-181 us at 1,000 projects; one index probe now;
    -- docs/benchmarks.md, "Two tenant checks that grew with the tenants").
    lo integer := coalesce(pid, -2147483648);
    hi integer := coalesce(pid, 2147483647);
BEGIN
    PERFORM memory.check_query(query);
    IF k IS NULL OR k < 1 THEN
        RAISE EXCEPTION 'k must be >= 1, got %', k USING ERRCODE = '22023';
    END IF;
    -- NaN sorts above every number in PostgreSQL, so the upper bounds also refuse it.
    IF k1 IS NULL OR k1 < 0 OR k1 >= 'Infinity'::float8 OR b IS NULL OR b < 0 OR b > 1 THEN
        RAISE EXCEPTION 'k1 must be >= 0 and b within [0, 1] (got %, %)', k1, b USING ERRCODE = '22023';
    END IF;
    terms := tsvector_to_array(to_tsvector('english'::regconfig, query));
    SELECT sum(c.n_docs), sum(c.total_len)::double precision / nullif(sum(c.n_docs), 0)
      INTO n, avgdl
      FROM memory.corpus_stats c
     -- a range: an index condition in a generic plan too, and under the policy
     WHERE c.project_id BETWEEN lo AND hi;
END $$;
COMMENT ON FUNCTION memory.lexical_query(text, integer, integer, double precision, double precision) IS
    'First step of memory.lexical_search: validates the arguments (22023) and returns the query''s lexemes with the corpus size and mean length of the project (or of all projects).';

-- The k-th largest value, deflated by 1e-9 relative (float rounding must never make a
-- lower bound of a score exceed the score); 0 when there are fewer than k values.
CREATE OR REPLACE FUNCTION memory.lexical_kth(vals double precision[], k integer)
RETURNS double precision
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN coalesce((SELECT u.v FROM unnest(vals) AS u(v) ORDER BY u.v DESC OFFSET k - 1 LIMIT 1), 0)
           * (1 - 1e-9);
END
$$;
COMMENT ON FUNCTION memory.lexical_kth(double precision[], integer) IS
    'Helper of memory.lexical_search: the k-th largest element of vals, deflated by 1e-9 relative, or 0.';

-- Pruned top-k: MaxScore over per-term score bounds, term at a time. Terms are ordered by
-- their bound (the largest weight any of their postings can have under the current
-- statistics). The rarest terms are scored first; the k-th best partial score so far is a
-- proven lower bound theta of the k-th best full score (a partial score never exceeds the
-- full one). A document that contains none of the remaining terms' "essential" part scores
-- at most the sum of the other terms' bounds: once that sum is below theta, such documents
-- cannot make the top k and those (long, frequent-term) posting lists are only read for the
-- candidates whose partial score plus the remaining bounds still reaches theta: whole when
-- short against the candidates, by primary-key probes otherwise. Bounds are inflated and
-- theta deflated by 1e-9 relative so float rounding cannot drop a document: the ranking is
-- the exhaustive scorer's (exhaustive => true).
-- A BM25 score as lexical_search returns it: rounded to 1e-9. A document's score is a sum
-- over the query's terms, and a floating-point sum depends on the order its terms arrive
-- in, which the plan decides (row-level security's quals, the pruned or the exhaustive
-- path): two documents with the same text could score an ulp apart, and which of them
-- ranks first, or makes the top k, would differ between the owner and the service's role
-- (measured on the realistic corpus: 3 of 100 answers of one project). Rounded, equal
-- documents tie exactly and the tie breaks by id, whoever asks.
-- Inlined (migrate.INLINED): no SET clause, which would make every scored document pay a
-- function call; the operators are named in pg_catalog instead.
CREATE OR REPLACE FUNCTION memory._bm25_score(raw double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.round(raw OPERATOR(pg_catalog.*) 1e9) OPERATOR(pg_catalog./) 1e9 $$;
COMMENT ON FUNCTION memory._bm25_score(double precision) IS
    'A BM25 score rounded to 1e-9, so that documents of equal score tie exactly whatever order the plan summed their terms in (ties then break by id). Used by memory.lexical_search on every path.';

CREATE OR REPLACE FUNCTION memory.lexical_search(
    query text,
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    k1 double precision DEFAULT 1.2,
    b double precision DEFAULT 0.75,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL,
    exhaustive boolean DEFAULT false,
    filter jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, rank integer, lexical_score double precision)
-- PARALLEL UNSAFE: a plain search sets plan_cache_mode (below), which no parallel mode
-- allows (memory.semantic_search sets hnsw.ef_search, the same).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
-- Plans made per call, with the project as a constant: on the partitioned layout a cached
-- (generic) plan locks every partition of postings and its indexes at each use, which cost
-- more than the statements (docs/scaling.md). The visibility is a constant of each plan
-- too, so memory._visible folds to the tests it makes. A plain search on one table keeps
-- generic plans instead (the first statement below says when).
SET plan_cache_mode = force_custom_plan
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    -- What the leg may see (memory.visibility, sql/019_visibility.sql): the project and
    -- levels select the postings, and every node a score reaches passes memory._visible
    -- before the top k. The query's own grammar is added to it below. Made in the body,
    -- after the plan mode is chosen (below), like everything that depends on it here.
    vis memory.visibility;
    pid integer;
    -- the project as a range of keys (every project for NULL): an index condition in a
    -- plan made once for all projects, where "pid IS NULL OR project_id = pid" is a filter
    p_lo integer;
    p_hi integer;
    lv text[];
    -- the time filter, checked per posting only when one is given
    timed boolean;
    -- the corpus the past is scored against: every version of the project held at as_of
    -- (read only with as_of: a constant false cuts its statements from the plan otherwise)
    held memory.visibility;
    one_table boolean := memory._plan_cache_mode() = 'force_generic_plan';
    terms text[];
    n double precision;
    avgdl double precision;
    -- BM25's constants, folded once a call: tf (k1 + 1) / (tf + k1 (1 - b + b dl / avgdl))
    -- is tf c1 / (tf + c2 + c3 dl), four operations a posting fewer in every statement
    -- below that scores postings (the past's scorer takes c3 of the corpus it counts)
    c1 double precision;
    c2 double precision;
    c3 double precision;
    -- per term, ordered by bound ascending (the most frequent terms first)
    t_lex text[];
    t_w double precision[];
    t_ub double precision[];
    t_df bigint[];
    total_df bigint;
    m integer;
    seed_df bigint := 0;
    theta double precision;
    s0 integer;  -- the terms s0..m (bound order) seed the candidates
    ne integer := 0;  -- the first ne terms (bound order) are non-essential
    below double precision[] := '{}';
    c_id bigint[];  -- candidates: node, project, partial score
    c_proj integer[];
    c_ps double precision[];
    i integer;
    -- the query grammar (sql/018_grammar.sql): it, a metadata filter or a valid-time test
    -- sends the query to the filtered exhaustive scorer below
    g jsonb;
    cons jsonb;
BEGIN
    -- A plain search (no past, grammar, filter, valid time or time window: the statements
    -- that test nodes with memory._visible are not run) keeps its plans for the session on
    -- one table: re-planned at every call, as the clause above says, its statements cost
    -- about 0.45 ms of planning a call. On the partitioned layout, and for the rest, plans
    -- made for the call (memory._plan_cache_mode). The SET clause scopes this to the call;
    -- set_config is why the function is PARALLEL UNSAFE. The look-ups that make the
    -- visibility (the project by name, whether it holds a bounded valid time) run first,
    -- under generic plans on one table whatever the search: planned for each call, they
    -- cost 0.3 ms of an answer's two legs.
    IF one_table THEN
        PERFORM pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
    END IF;
    vis := memory._leg_visibility(memory.project_id(project), levels, since, before, filter,
                                  NULL, as_of, valid_at);
    pid := vis.project_id;
    p_lo := coalesce(vis.project_id, -2147483648);
    p_hi := coalesce(vis.project_id, 2147483647);
    lv := vis.levels;
    timed := vis.since IS NOT NULL OR vis.before IS NOT NULL;
    held := memory._visibility(project_id => vis.project_id, as_of => vis.as_of);
    -- (parsed only when the query has a quote, sigil, leading "-" or OR: memory.parse_query's
    -- own first test, repeated here so a plain query pays no function call for it)
    g := CASE WHEN query ~ '["#@]|(^|\s)-|(^|\s)OR(\s|$)' THEN memory.parse_query(query) END;
    cons := CASE WHEN g IS NOT NULL THEN memory._grammar_constraints(g) END;
    IF one_table AND (timed OR as_of IS NOT NULL OR cons IS NOT NULL OR vis.filter IS NOT NULL
                      OR vis.valid_at IS NOT NULL OR vis.live_at IS NOT NULL) THEN
        PERFORM pg_catalog.set_config('plan_cache_mode', 'force_custom_plan', true);
    END IF;
    SELECT x.terms, x.n, x.avgdl INTO terms, n, avgdl FROM memory.lexical_query(query, pid, k, k1, b) x;
    c1 := k1 + 1;
    c2 := k1 * (1 - b);
    -- NULL, never an error, for a corpus of empty documents: nothing can match there
    c3 := k1 * b / nullif(avgdl, 0);
    vis := memory._with_grammar(vis, cons);
    IF coalesce((g ->> 'operators')::boolean, false) THEN
        -- scored: the plain words, phrase words and tokens; never an excluded word or OR
        terms := tsvector_to_array(to_tsvector('english'::regconfig, g ->> 'text'));
    END IF;
    IF cardinality(terms) = 0 OR (as_of IS NULL AND coalesce(n, 0) = 0) THEN
        RETURN;  -- only stop words, or an empty corpus: nothing can match
    END IF;
    IF as_of IS NULL THEN
        SELECT array_agg(s.lexeme ORDER BY s.ub, s.lexeme), array_agg(s.w ORDER BY s.ub, s.lexeme),
               array_agg(s.ub ORDER BY s.ub, s.lexeme), array_agg(s.df ORDER BY s.ub, s.lexeme),
               sum(s.df)
          INTO t_lex, t_w, t_ub, t_df, total_df
          FROM (SELECT g.lexeme, g.w, g.df,
                       -- the largest weight any posting can have: tf -> max_tf, dl/tf -> min_dl_per_tf
                       g.w * CASE WHEN g.unknown THEN k1 + 1
                                  ELSE (k1 + 1) / (1 + k1 * (1 - b) / g.max_tf + k1 * b * g.min_ratio / avgdl)
                             END * (1 + 1e-9) AS ub
                FROM (SELECT t.lexeme, sum(t.df) AS df,
                             ln(1 + (n - sum(t.df) + 0.5) / (sum(t.df) + 0.5)) AS w,
                             bool_or(t.max_tf < 1) AS unknown,  -- no bound recorded: the loosest one
                             max(t.max_tf) AS max_tf, min(t.min_dl_per_tf) AS min_ratio
                      FROM memory.term_stats t
                      WHERE t.lexeme = ANY (terms) AND t.project_id BETWEEN p_lo AND p_hi
                      GROUP BY t.lexeme) g) s;
        m := coalesce(cardinality(t_lex), 0);
        IF m = 0 THEN
            RETURN;
        END IF;
    END IF;
    -- The past, or a phrase, tag, mention, exclusion, metadata filter or valid-time test (a
    -- project holding nodes with a bounded valid time): every candidate is scored and the
    -- nodes that fail the test drop out before the top k, so k still fills when enough
    -- nodes pass (the pruning's bounds assume every scored node can be returned). One
    -- test of the nodes, over scores from one of two places, the other branch cut by a
    -- one-time filter (the plan is made per call, with as_of a constant):
    -- * the past (as_of): postings and statistics hold current versions only, so BM25 is
    --   scored here from the versions visible as of as_of, with the statistics of the
    --   corpus as it stood then (N, mean length and document frequencies counted over
    --   those versions, all levels, as the postings count them now). Exact, and slower: it
    --   counts the project's versions of that moment and reads the matching ones' tsv;
    -- * now: every posting of the terms, with the current statistics.
    IF as_of IS NOT NULL OR cons IS NOT NULL OR vis.filter IS NOT NULL OR vis.valid_at IS NOT NULL
       OR vis.live_at IS NOT NULL THEN
        RETURN QUERY
        WITH st AS (
            SELECT count(*)::double precision AS n,
                   -- c3 of that corpus (c1 and c2 do not depend on it): one BM25 form
                   k1 * b / nullif(avg(v.lex_len)::double precision, 0) AS c3
            FROM memory.nodes v
            WHERE as_of IS NOT NULL AND memory._visible(v, held)
        ), tp AS MATERIALIZED (
            SELECT m.id, m.project_id, u.lexeme, cardinality(u.positions) AS tf, m.lex_len AS dl
            FROM memory.nodes m, unnest(m.tsv) u
            WHERE m.tsv @@ (SELECT string_agg('''' || replace(replace(t, '\', '\\'), '''', '''''') || '''', ' | ')
                            FROM unnest(terms) t)::tsquery
              AND as_of IS NOT NULL AND memory._visible(m, held) AND u.lexeme = ANY (terms)
        ), df AS (
            SELECT tp.lexeme, count(*)::double precision AS df FROM tp GROUP BY tp.lexeme
        )
        SELECT s.id, (row_number() OVER (ORDER BY s.score DESC, s.id))::integer, s.score
        FROM (SELECT tp.id, tp.project_id AS proj,
                     memory._bm25_score(sum(ln(1 + (st.n - df.df + 0.5) / (df.df + 0.5))
                         * tp.tf * c1 / (tp.tf + c2 + st.c3 * tp.dl))) AS score
              FROM tp JOIN df ON df.lexeme = tp.lexeme CROSS JOIN st
              WHERE as_of IS NOT NULL
              GROUP BY tp.id, tp.project_id
              UNION ALL
              SELECT p.node_id, p.project_id,
                     memory._bm25_score(sum(w.w * p.tf * c1 / (p.tf + c2 + c3 * p.dl)))
              FROM unnest(t_lex, t_w) AS w(lexeme, w)
              JOIN memory.postings p ON p.lexeme = w.lexeme
              WHERE as_of IS NULL
                AND (pid IS NULL OR p.project_id = pid) AND (lv IS NULL OR p.level = ANY (lv))
              GROUP BY p.node_id, p.project_id) s
        JOIN memory.nodes tn ON tn.id = s.id AND tn.project_id = s.proj
        -- everything the visibility tests: the level again for the past's scores (now's
        -- postings are filtered by it already), the time window, valid time, the metadata
        -- filter and the grammar
        WHERE memory._visible(tn, vis)
        ORDER BY s.score DESC, s.id
        LIMIT k;
        RETURN;
    END IF;
    -- Few postings in all (measured on SciFact: a claim's median is 3.2k): scoring them all
    -- is cheaper than the pruning's extra statements. exhaustive => true always takes this
    -- path: the reference the pruned path is tested against.
    -- The top k are cut before they are numbered: a LIMIT directly above the sort makes it
    -- a bounded (top-N heap) sort, where a LIMIT above the window function sorted every
    -- scored node (3.2k on a SciFact claim). The same rows; on 150 SciFact claims the call
    -- took 3.06 ms against 3.65, an answer 0.98x of the database's CPU.
    IF exhaustive OR m = 1 OR total_df <= 4 * k + 6000 THEN
        RETURN QUERY
        SELECT s.id, (row_number() OVER (ORDER BY s.score DESC, s.id))::integer, s.score
        FROM (SELECT p.node_id AS id,
                     memory._bm25_score(sum(w.w * p.tf * c1 / (p.tf + c2 + c3 * p.dl))) AS score
              FROM unnest(t_lex, t_w) AS w(lexeme, w)
              JOIN memory.postings p ON p.lexeme = w.lexeme
              WHERE p.project_id BETWEEN p_lo AND p_hi AND (lv IS NULL OR p.level = ANY (lv))
              AND (NOT timed OR EXISTS (SELECT 1 FROM memory.nodes tn WHERE tn.id = p.node_id AND memory._visible(tn, vis)))
              GROUP BY p.node_id
              ORDER BY score DESC, id
              LIMIT k) s
        ORDER BY s.score DESC, s.id;
        RETURN;
    END IF;
    -- Seed: the highest-bound (rarest) terms, while their postings stay few. Their partial
    -- scores are the first candidates, and the k-th best of them is the first theta.
    s0 := m;
    seed_df := t_df[m];
    WHILE s0 > 2 AND seed_df + t_df[s0 - 1] <= greatest(2 * k, 2048) LOOP
        s0 := s0 - 1;
        seed_df := seed_df + t_df[s0];
    END LOOP;
    SELECT array_agg(e.id), array_agg(e.proj), array_agg(e.ps)
      INTO c_id, c_proj, c_ps
      FROM (SELECT p.node_id AS id, p.project_id AS proj,
                   sum(w.w * p.tf * c1 / (p.tf + c2 + c3 * p.dl)) AS ps
            FROM unnest(t_lex[s0:], t_w[s0:]) AS w(lexeme, w)
            JOIN memory.postings p ON p.lexeme = w.lexeme
            WHERE p.project_id BETWEEN p_lo AND p_hi AND (lv IS NULL OR p.level = ANY (lv))
              AND (NOT timed OR EXISTS (SELECT 1 FROM memory.nodes tn WHERE tn.id = p.node_id AND memory._visible(tn, vis)))
            GROUP BY p.node_id, p.project_id) e;
    theta := memory.lexical_kth(c_ps, k);
    -- Non-essential: the longest prefix of low-bound terms whose bounds sum below theta.
    FOR i IN 1 .. m LOOP
        below[i] := coalesce(below[i - 1], 0) + t_ub[i];  -- bound of the terms 1..i together
    END LOOP;
    WHILE ne < s0 - 1 AND below[ne + 1] < theta LOOP
        ne := ne + 1;
    END LOOP;
    IF ne < s0 - 1 THEN
        -- The other essential terms: their documents join the candidates.
        SELECT array_agg(coalesce(c.id, x.id)), array_agg(coalesce(c.proj, x.proj)),
               array_agg(coalesce(c.ps, 0) + coalesce(x.ps, 0))
          INTO c_id, c_proj, c_ps
          FROM unnest(c_id, c_proj, c_ps) AS c(id, proj, ps)
          FULL JOIN (SELECT p.node_id AS id, p.project_id AS proj,
                            sum(w.w * p.tf * c1 / (p.tf + c2 + c3 * p.dl)) AS ps
                     FROM unnest(t_lex[ne + 1:s0 - 1], t_w[ne + 1:s0 - 1]) AS w(lexeme, w)
                     JOIN memory.postings p ON p.lexeme = w.lexeme
                     WHERE p.project_id BETWEEN p_lo AND p_hi AND (lv IS NULL OR p.level = ANY (lv))
                       AND (NOT timed OR EXISTS (SELECT 1 FROM memory.nodes tn WHERE tn.id = p.node_id AND memory._visible(tn, vis)))
                     GROUP BY p.node_id, p.project_id) x
            ON x.id = c.id AND x.proj = c.proj;
        theta := greatest(theta, memory.lexical_kth(c_ps, k));
    END IF;
    -- Then the non-essential terms, highest bound first. Before each, drop the candidates
    -- that cannot reach theta even with every remaining term; after each, raise theta to
    -- the k-th best partial score (a partial score never exceeds the full one).
    FOR j IN REVERSE ne .. 1 LOOP
        SELECT array_agg(c.id), array_agg(c.proj), array_agg(c.ps)
          INTO c_id, c_proj, c_ps
          FROM unnest(c_id, c_proj, c_ps) AS c(id, proj, ps)
         WHERE c.ps + below[j] >= theta;
        EXIT WHEN c_id IS NULL;
        IF t_df[j] <= 16 * cardinality(c_id) THEN
            -- a list short against the candidates: read it whole
            SELECT array_agg(c.id), array_agg(c.proj), array_agg(c.ps + coalesce(x.s, 0))
              INTO c_id, c_proj, c_ps
              FROM unnest(c_id, c_proj, c_ps) AS c(id, proj, ps)
              LEFT JOIN (SELECT p.node_id, p.project_id,
                                t_w[j] * p.tf * c1 / (p.tf + c2 + c3 * p.dl) AS s
                         FROM memory.postings p
                         WHERE p.lexeme = t_lex[j] AND p.project_id BETWEEN p_lo AND p_hi) x
                ON x.node_id = c.id AND x.project_id = c.proj;
        ELSE
            -- a long list: probe it for the surviving candidates only. By the candidate's own
            -- project (the project when one is named): under row-level security a qual that
            -- is not leakproof, as coalesce(pid, c.proj) was, cannot be an index condition, and
            -- each probe then read the lexeme's every project (0.4-1.5 s a query at 100k).
            SELECT array_agg(c.id), array_agg(c.proj), array_agg(c.ps + coalesce(x.s, 0))
              INTO c_id, c_proj, c_ps
              FROM unnest(c_id, c_proj, c_ps) AS c(id, proj, ps)
              LEFT JOIN LATERAL (
                  SELECT t_w[j] * p.tf * c1 / (p.tf + c2 + c3 * p.dl) AS s
                  FROM memory.postings p
                  WHERE p.lexeme = t_lex[j] AND p.project_id = c.proj AND p.node_id = c.id
                  LIMIT 1) x ON true;
        END IF;
        IF j > 1 THEN
            theta := greatest(theta, memory.lexical_kth(c_ps, k));
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT c.id, (row_number() OVER (ORDER BY c.ps DESC, c.id))::integer, c.ps
    FROM (SELECT u.id, memory._bm25_score(u.ps) AS ps FROM unnest(c_id, c_ps) AS u(id, ps)) c
    ORDER BY c.ps DESC, c.id
    LIMIT k;
END $$;
COMMENT ON FUNCTION memory.lexical_search(text, text, text[], integer, double precision, double precision, timestamptz, timestamptz, boolean, jsonb, timestamptz, timestamptz) IS
    'BM25 (Okapi, k1/b tunable, Lucene IDF) over title, breadcrumb and text with per-project statistics. Disjunctive: any query term can match. The query grammar (memory.parse_query) holds: strict +"phrases" (and the phrases of a query made only of operators), #tags and @mentions required, -exclusions never returned; a soft phrase (one quoted in a question) is scored as its words here, and the answer raises what contains it after fusion (memory._after_fusion); filter (a JSON object) keeps only nodes whose metadata contains it; both apply before the top k. Returns node ids ranked 1..k; skips the postings that cannot reach the top k (MaxScore over per-term score bounds) unless exhaustive => true, which scores every posting (the reference, same ranking). since/before (timestamptz, either NULL) keep only nodes with since <= ts < before, before the top k is taken. as_of: the versions the database held then, scored exactly with the statistics of the corpus as it stood then (NULL: the current versions and their postings); valid_at: only nodes valid then (valid_from <= t < valid_to; default as_of, else now).';

CREATE OR REPLACE FUNCTION memory.refresh_lexical_bounds(project text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer := memory.project_id(project);
    changed bigint;
BEGIN
    -- Deletes and updates leave max_tf/min_dl_per_tf valid but possibly loose; recompute
    -- them from the postings (sorted, so concurrent refreshes lock rows in one order).
    WITH fresh AS (
        SELECT p.project_id, p.lexeme, max(p.tf) AS max_tf,
               min(p.dl::double precision / greatest(p.tf, 1)) AS min_ratio
        FROM memory.postings p
        WHERE pid IS NULL OR p.project_id = pid
        GROUP BY 1, 2 ORDER BY 1, 2
    )
    UPDATE memory.term_stats t
    SET max_tf = f.max_tf, min_dl_per_tf = f.min_ratio
    FROM fresh f
    WHERE t.project_id = f.project_id AND t.lexeme = f.lexeme
      AND (t.max_tf, t.min_dl_per_tf) IS DISTINCT FROM (f.max_tf, f.min_ratio);
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END $$;
COMMENT ON FUNCTION memory.refresh_lexical_bounds(text) IS
    'Recomputes the per-term score bounds (max tf, min dl/tf) that pruned BM25 uses, for one project or all; returns the number of terms whose bounds tightened. Writes keep the bounds valid; deletes and updates only loosen them, so run this after large deletions.';
