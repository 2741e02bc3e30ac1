-- Comments for the BM25 trigger functions of 020_lexical.sql, written only where that file
-- sets none (so its own wording wins once it has one; then this file can go).
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN SELECT * FROM (VALUES
        ('memory.nodes_lexical_row()', 'Row trigger: computes a node''s tsvector and BM25 length (lex_len) from title, breadcrumb and text.'),
        ('memory.nodes_lexical_insert()', 'Statement trigger: adds the inserted nodes'' postings, document frequencies and corpus sizes.'),
        ('memory.nodes_lexical_delete()', 'Statement trigger: removes the deleted nodes'' postings and statistics.'),
        ('memory.nodes_lexical_update()', 'Statement trigger: replaces the statistics of nodes whose lexical content, project or level changed.'),
        ('memory.nodes_lexical_truncate()', 'Statement trigger: empties the BM25 statistics with the nodes.')
    ) AS v(fn, txt)
    LOOP
        IF to_regprocedure(c.fn) IS NOT NULL
           AND obj_description(to_regprocedure(c.fn), 'pg_proc') IS NULL THEN
            EXECUTE format('COMMENT ON FUNCTION %s IS %L', c.fn, c.txt);
        END IF;
    END LOOP;
END $$;
