-- The product's indexes, restored by every migrate: one dropped by hand (say the HNSW index
-- over L1/L2 that memory.query's default levels use) makes queries fall back to exact scans
-- and sorts. Each index sql/ wants is built first on a probe table (memory._probe) and
-- compared with the real one by its definition; only a missing, invalid or different index
-- is (re)built, so a deploy that changes nothing locks no table. A DBA's own indexes are
-- left alone; indexes behind constraints (primary keys, unique) are not listed here.
-- Each index is wanted once the migration that created it is recorded (tests apply one
-- migration per deploy), the HNSW ones once an embedding model is configured
-- (memory.configure_embedding calls this then). m=16, ef_construction=64 are pgvector's
-- defaults, written out so DBAs can see them; the L1/L2 graph is the default levels' own
-- (migration 0007 explains why).
CREATE OR REPLACE FUNCTION memory._ensure_indexes()
RETURNS text[]
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    vs name := (SELECT n.nspname FROM pg_catalog.pg_extension e
                JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
                WHERE e.extname = 'vector');
    hnsw boolean := EXISTS (SELECT 1 FROM memory.embedding_model);
    -- (since migration, table, index, what follows "CREATE INDEX name ON table")
    wanted text[] := ARRAY[
        ['0001_initial', 'nodes', 'nodes_project_level_idx', '(project_id, level)'],
        ['0001_initial', 'nodes', 'nodes_tsv_gin', 'USING gin (tsv)'],
        ['0001_initial', 'edges', 'edges_parent_idx', '(parent_id)'],
        ['0001_initial', 'postings', 'postings_node_idx', '(node_id)'],
        ['0004_lexical_bounds', 'term_stats', 'term_stats_lexeme_idx',
         '(lexeme) INCLUDE (project_id, df, max_tf, min_dl_per_tf)'],
        ['0013_query_grammar', 'nodes', 'nodes_metadata_gin', 'USING gin (metadata jsonb_path_ops)'],
        ['0018_valid_time', 'nodes', 'nodes_valid_bounded',
         '(project_id) WHERE expired_at IS NULL AND (valid_from IS NOT NULL OR valid_to IS NOT NULL)']];
    w text[];
    rel regclass;
    probe regclass;
    have oid;
    made text[] := '{}';
BEGIN
    IF hnsw THEN
        wanted := wanted || ARRAY[
            ['0001_initial', 'nodes', 'nodes_embedding_hnsw', pg_catalog.format(
                'USING hnsw (embedding %I.vector_cosine_ops) WITH (m = 16, ef_construction = 64)', vs)],
            ['0001_initial', 'nodes', 'nodes_embedding_hnsw_l1_l2', pg_catalog.format(
                'USING hnsw (embedding %I.vector_cosine_ops) WITH (m = 16, ef_construction = 64) WHERE level IN (''L1'', ''L2'')', vs)]];
    END IF;
    FOREACH w SLICE 1 IN ARRAY wanted LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM memory.schema_migrations m WHERE m.version = w[1]);
        rel := pg_catalog.format('memory.%I', w[2])::regclass;
        probe := memory._probe(rel);
        EXECUTE pg_catalog.format('CREATE INDEX %I ON %s %s', w[3], probe, w[4]);
        SELECT i.indexrelid INTO have FROM pg_catalog.pg_index i
        JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = rel AND c.relname = w[3] AND i.indisvalid;
        -- The definitions compared from USING on: the table's name differs, and a
        -- partitioned table's index reads ON ONLY.
        CONTINUE WHEN pg_catalog.substring(pg_catalog.pg_get_indexdef(have), ' USING .*$')
                      = (SELECT pg_catalog.substring(pg_catalog.pg_get_indexdef(i.indexrelid), ' USING .*$')
                         FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
                         WHERE i.indrelid = probe AND c.relname = w[3]);
        EXECUTE pg_catalog.format('DROP INDEX IF EXISTS memory.%I', w[3]);
        EXECUTE pg_catalog.format('CREATE INDEX %I ON %s %s', w[3], rel, w[4]);
        made := made || w[3];
    END LOOP;
    RETURN made;
END $$;
COMMENT ON FUNCTION memory._ensure_indexes() IS
    'Builds the product''s indexes that are missing, invalid or differ from their definition here (compared on a probe table first); returns the names it built. Run by migrate; a DBA''s own indexes are left alone.';

SELECT memory._ensure_indexes();
