-- In-database BM25. Term statistics (postings, document frequencies, corpus sizes) are
-- kept exact by statement-level triggers, so inserts, updates, deletes and TRUNCATE never
-- drift the IDF. Term frequencies come from tsvector positions, which PostgreSQL caps at
-- 256 per lexeme (and positions at 16383): beyond that a term's tf is under-counted.

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
AS $$
BEGIN
    NEW.tsv := memory.lexical_document(NEW.title, NEW.breadcrumb, NEW.text);
    NEW.lex_len := coalesce((SELECT sum(cardinality(u.positions)) FROM unnest(NEW.tsv) u), 0);
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION memory.nodes_lexical_insert()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO memory.postings (lexeme, project_id, node_id, level, tf, dl)
    SELECT u.lexeme, n.project_id, n.id, n.level, cardinality(u.positions), n.lex_len
    FROM new_rows n, unnest(n.tsv) u;
    -- Sorted upserts take row locks in one order, so concurrent ingests cannot deadlock.
    INSERT INTO memory.term_stats AS t (project_id, lexeme, df)
    SELECT n.project_id, u.lexeme, count(*)
    FROM new_rows n, unnest(n.tsv) u
    GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (project_id, lexeme) DO UPDATE SET df = t.df + EXCLUDED.df;
    INSERT INTO memory.corpus_stats AS c (project_id, n_docs, total_len)
    SELECT project_id, count(*), sum(lex_len) FROM new_rows GROUP BY 1 ORDER BY 1
    ON CONFLICT (project_id) DO UPDATE
        SET n_docs = c.n_docs + EXCLUDED.n_docs, total_len = c.total_len + EXCLUDED.total_len;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION memory.nodes_lexical_delete()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM memory.postings p USING old_rows o WHERE p.node_id = o.id;
    UPDATE memory.term_stats t SET df = t.df - d.cnt
    FROM (SELECT o.project_id, u.lexeme, count(*) AS cnt
          FROM old_rows o, unnest(o.tsv) u GROUP BY 1, 2 ORDER BY 1, 2) d
    WHERE t.project_id = d.project_id AND t.lexeme = d.lexeme;
    DELETE FROM memory.term_stats WHERE df = 0;
    UPDATE memory.corpus_stats c SET n_docs = c.n_docs - d.cnt, total_len = c.total_len - d.len
    FROM (SELECT project_id, count(*) AS cnt, sum(lex_len) AS len FROM old_rows GROUP BY 1) d
    WHERE c.project_id = d.project_id;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION memory.nodes_lexical_update()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    changed bigint[];
BEGIN
    -- Only rows whose lexical content, project or level changed: an embedding-only update
    -- (reembed) must not rewrite postings. Column lists are not allowed with transition
    -- tables, hence the comparison here.
    SELECT array_agg(o.id) INTO changed
    FROM old_rows o JOIN new_rows n ON n.id = o.id
    WHERE (o.tsv, o.project_id, o.level, o.lex_len) IS DISTINCT FROM (n.tsv, n.project_id, n.level, n.lex_len);
    IF changed IS NULL THEN
        RETURN NULL;
    END IF;
    -- An update is a delete of the old statistics followed by an insert of the new ones.
    DELETE FROM memory.postings p WHERE p.node_id = ANY (changed);
    UPDATE memory.term_stats t SET df = t.df - d.cnt
    FROM (SELECT o.project_id, u.lexeme, count(*) AS cnt
          FROM old_rows o, unnest(o.tsv) u WHERE o.id = ANY (changed)
          GROUP BY 1, 2 ORDER BY 1, 2) d
    WHERE t.project_id = d.project_id AND t.lexeme = d.lexeme;
    UPDATE memory.corpus_stats c SET n_docs = c.n_docs - d.cnt, total_len = c.total_len - d.len
    FROM (SELECT project_id, count(*) AS cnt, sum(lex_len) AS len FROM old_rows
          WHERE id = ANY (changed) GROUP BY 1) d
    WHERE c.project_id = d.project_id;
    INSERT INTO memory.postings (lexeme, project_id, node_id, level, tf, dl)
    SELECT u.lexeme, n.project_id, n.id, n.level, cardinality(u.positions), n.lex_len
    FROM new_rows n, unnest(n.tsv) u WHERE n.id = ANY (changed);
    INSERT INTO memory.term_stats AS t (project_id, lexeme, df)
    SELECT n.project_id, u.lexeme, count(*) FROM new_rows n, unnest(n.tsv) u
    WHERE n.id = ANY (changed)
    GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (project_id, lexeme) DO UPDATE SET df = t.df + EXCLUDED.df;
    DELETE FROM memory.term_stats WHERE df = 0;
    INSERT INTO memory.corpus_stats AS c (project_id, n_docs, total_len)
    SELECT project_id, count(*), sum(lex_len) FROM new_rows WHERE id = ANY (changed)
    GROUP BY 1 ORDER BY 1
    ON CONFLICT (project_id) DO UPDATE
        SET n_docs = c.n_docs + EXCLUDED.n_docs, total_len = c.total_len + EXCLUDED.total_len;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION memory.nodes_lexical_truncate()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    TRUNCATE memory.postings, memory.term_stats, memory.corpus_stats;
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER nodes_lexical_row
    BEFORE INSERT OR UPDATE OF title, breadcrumb, text ON memory.nodes
    FOR EACH ROW EXECUTE FUNCTION memory.nodes_lexical_row();
CREATE OR REPLACE TRIGGER nodes_lexical_insert
    AFTER INSERT ON memory.nodes REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION memory.nodes_lexical_insert();
CREATE OR REPLACE TRIGGER nodes_lexical_delete
    AFTER DELETE ON memory.nodes REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION memory.nodes_lexical_delete();
CREATE OR REPLACE TRIGGER nodes_lexical_update
    AFTER UPDATE ON memory.nodes REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION memory.nodes_lexical_update();
CREATE OR REPLACE TRIGGER nodes_lexical_truncate
    AFTER TRUNCATE ON memory.nodes
    FOR EACH STATEMENT EXECUTE FUNCTION memory.nodes_lexical_truncate();

CREATE OR REPLACE FUNCTION memory.lexical_search(
    query text,
    project text DEFAULT NULL,
    levels text[] DEFAULT NULL,
    k integer DEFAULT 50,
    k1 double precision DEFAULT 1.2,
    b double precision DEFAULT 0.75
)
RETURNS TABLE (node_id bigint, rank integer, lexical_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project);
    lv text[] := memory.check_levels(levels);
    terms text[];
    n double precision;
    avgdl double precision;
BEGIN
    IF query IS NULL OR btrim(query) = '' THEN
        RAISE EXCEPTION 'query must not be empty' USING ERRCODE = '22023';
    END IF;
    IF k IS NULL OR k < 1 THEN
        RAISE EXCEPTION 'k must be >= 1, got %', k USING ERRCODE = '22023';
    END IF;
    terms := tsvector_to_array(to_tsvector('english'::regconfig, query));
    SELECT sum(c.n_docs), sum(c.total_len)::double precision / nullif(sum(c.n_docs), 0)
      INTO n, avgdl
      FROM memory.corpus_stats c WHERE pid IS NULL OR c.project_id = pid;
    IF cardinality(terms) = 0 OR coalesce(n, 0) = 0 THEN
        RETURN;  -- only stop words, or an empty corpus: nothing can match
    END IF;
    RETURN QUERY
    WITH idf AS (
        SELECT t.lexeme, ln(1 + (n - sum(t.df) + 0.5) / (sum(t.df) + 0.5)) AS w
        FROM memory.term_stats t
        WHERE t.lexeme = ANY (terms) AND (pid IS NULL OR t.project_id = pid)
        GROUP BY t.lexeme
    ), scored AS (
        SELECT p.node_id AS id,
               sum(idf.w * p.tf * (k1 + 1) / (p.tf + k1 * (1 - b + b * p.dl / avgdl))) AS score
        FROM idf JOIN memory.postings p ON p.lexeme = idf.lexeme
        WHERE (pid IS NULL OR p.project_id = pid) AND (lv IS NULL OR p.level = ANY (lv))
        GROUP BY p.node_id
    )
    SELECT s.id, (row_number() OVER (ORDER BY s.score DESC, s.id))::integer, s.score
    FROM scored s
    ORDER BY s.score DESC, s.id
    LIMIT k;
END $$;
COMMENT ON FUNCTION memory.lexical_search(text, text, text[], integer, double precision, double precision) IS
    'BM25 (Okapi, k1/b tunable, Lucene IDF) over title, breadcrumb and text with per-project statistics. Disjunctive: any query term can match. Returns node ids ranked 1..k.';
