-- Catalog hygiene: the schema version and a COMMENT on the schema, every table and every
-- column, so \d+ and \df+ explain themselves to a DBA. Re-applied on every migrate.

CREATE OR REPLACE FUNCTION memory.version()
RETURNS TABLE (schema_version text, migrations text[], plpython_checksum text)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT max(m.version), array_agg(m.version ORDER BY m.version),
           (SELECT c.value FROM memory.config c WHERE c.key = 'plpython_checksum')
    FROM memory.schema_migrations m
$$;
COMMENT ON FUNCTION memory.version() IS
    'The installed schema: the newest applied migration, all applied migrations, and the checksum of the PL/Python module recorded by the last migrate.';

COMMENT ON SCHEMA memory IS
    'poimen-memory: L0 evidence, L1 memories and L2 syntheses with provenance edges, in-database BM25 and vector retrieval. Entry point: memory.query (alias public.memory_query). See docs/sql-api.md.';

COMMENT ON TABLE memory.schema_migrations IS
    'Ledger of applied versioned migrations (migrations/*.sql), frozen by checksum. Written by `poimen-memory migrate` only.';
COMMENT ON COLUMN memory.schema_migrations.version IS 'migration file name without .sql, e.g. 0001_initial';
COMMENT ON COLUMN memory.schema_migrations.checksum IS 'sha256 of the migration file when it was applied';
COMMENT ON COLUMN memory.schema_migrations.applied_at IS 'when the migration ran';

COMMENT ON TABLE memory.config IS
    'Owner-only key/value settings read by the SQL layer: the retrieval policy (memory.set_policy), the PL/Python module path, the OpenSearch outbox switch.';
COMMENT ON COLUMN memory.config.key IS 'setting name, e.g. fusion, rrf_k, plpython_path, opensearch_outbox';
COMMENT ON COLUMN memory.config.value IS 'setting value as text, validated by the function that writes it';
COMMENT ON COLUMN memory.config.updated_at IS 'when the value last changed';

COMMENT ON TABLE memory.projects IS 'Projects partition memory: every node belongs to one; statistics are per project.';
COMMENT ON COLUMN memory.projects.id IS 'surrogate key';
COMMENT ON COLUMN memory.projects.name IS 'unique project name ([A-Za-z0-9][A-Za-z0-9_.:-]{0,127}) used by every query function';
COMMENT ON COLUMN memory.projects.created_at IS 'when the project was first written';

COMMENT ON TABLE memory.embedding_model IS
    'The one embedding model and dimension this database stores (a single row); nodes.embedding is typed vector(dim) to match.';
COMMENT ON COLUMN memory.embedding_model.singleton IS 'always true: at most one row';
COMMENT ON COLUMN memory.embedding_model.model IS 'embedding model name, e.g. sentence-transformers/all-MiniLM-L6-v2';
COMMENT ON COLUMN memory.embedding_model.dim IS 'vector dimension';
COMMENT ON COLUMN memory.embedding_model.configured_at IS 'when memory.configure_embedding recorded it';

COMMENT ON TABLE memory.nodes IS
    'Memory nodes: L0 raw evidence, L1 memories, L2 syntheses. Content-addressed by sha256. tsv and lex_len are derived by triggers and cannot be written by hand.';
COMMENT ON COLUMN memory.nodes.id IS 'node id (the node_id of every query result)';
COMMENT ON COLUMN memory.nodes.sha256 IS 'sha256 of the node content: the idempotence key of ingest';
COMMENT ON COLUMN memory.nodes.project_id IS 'owning project (memory.projects.id)';
COMMENT ON COLUMN memory.nodes.level IS 'L0 evidence, L1 memory, L2 synthesis';
COMMENT ON COLUMN memory.nodes.external_id IS 'caller-chosen id, unique within the project';
COMMENT ON COLUMN memory.nodes.title IS 'optional title (indexed by BM25)';
COMMENT ON COLUMN memory.nodes.breadcrumb IS 'path of headings or context (indexed by BM25)';
COMMENT ON COLUMN memory.nodes.text IS 'the node body (indexed by BM25 and embedded)';
COMMENT ON COLUMN memory.nodes.source IS 'where the content came from (file, URL, conversation)';
COMMENT ON COLUMN memory.nodes.ts IS 'when the content was written (the timestamp of query results)';
COMMENT ON COLUMN memory.nodes.metadata IS 'free-form JSON kept with the node';
COMMENT ON COLUMN memory.nodes.embedding IS 'embedding of the text with the model in memory.embedding_model';
COMMENT ON COLUMN memory.nodes.tsv IS 'derived: BM25 document (memory.lexical_document), set by trigger';
COMMENT ON COLUMN memory.nodes.lex_len IS 'derived: BM25 document length in tokens, set by trigger';
COMMENT ON COLUMN memory.nodes.created_at IS 'when the row was inserted';

COMMENT ON TABLE memory.edges IS 'Provenance: child was derived from parent (L2 -> L1 -> L0).';
COMMENT ON COLUMN memory.edges.child_id IS 'the derived node';
COMMENT ON COLUMN memory.edges.parent_id IS 'the node it was derived from';
COMMENT ON COLUMN memory.edges.precedence IS 'orders a child''s parents (lower first)';

COMMENT ON TABLE memory.postings IS 'Derived BM25 postings, one row per (lexeme, node); maintained by triggers on memory.nodes.';
COMMENT ON COLUMN memory.postings.lexeme IS 'stemmed term';
COMMENT ON COLUMN memory.postings.project_id IS 'project of the node';
COMMENT ON COLUMN memory.postings.node_id IS 'the node containing the term';
COMMENT ON COLUMN memory.postings.level IS 'level of the node (filter without a heap fetch)';
COMMENT ON COLUMN memory.postings.tf IS 'term frequency in the node';
COMMENT ON COLUMN memory.postings.dl IS 'document length of the node';

COMMENT ON TABLE memory.term_stats IS 'Derived BM25 document frequencies per project and lexeme; maintained by triggers.';
COMMENT ON COLUMN memory.term_stats.project_id IS 'project';
COMMENT ON COLUMN memory.term_stats.lexeme IS 'stemmed term';
COMMENT ON COLUMN memory.term_stats.df IS 'number of nodes of the project containing the term';

COMMENT ON TABLE memory.corpus_stats IS 'Derived BM25 corpus sizes per project; maintained by triggers.';
COMMENT ON COLUMN memory.corpus_stats.project_id IS 'project';
COMMENT ON COLUMN memory.corpus_stats.n_docs IS 'number of nodes';
COMMENT ON COLUMN memory.corpus_stats.total_len IS 'sum of lex_len over the nodes (average length = total_len / n_docs)';

COMMENT ON TABLE memory.opensearch_outbox IS
    'Queue of node changes to mirror into OpenSearch, filled by triggers while opensearch_outbox = on and drained by the service.';
COMMENT ON COLUMN memory.opensearch_outbox.id IS 'queue order';
COMMENT ON COLUMN memory.opensearch_outbox.node_id IS 'the changed node (may be gone for a delete)';
COMMENT ON COLUMN memory.opensearch_outbox.op IS 'index or delete';
COMMENT ON COLUMN memory.opensearch_outbox.enqueued_at IS 'when the change was queued';
COMMENT ON COLUMN memory.opensearch_outbox.attempts IS 'delivery attempts so far';
COMMENT ON COLUMN memory.opensearch_outbox.last_error IS 'the last delivery error, if any';

DO $$
BEGIN
    IF to_regclass('memory.api_keys') IS NOT NULL THEN
        COMMENT ON COLUMN memory.api_keys.id IS 'surrogate key';
        COMMENT ON COLUMN memory.api_keys.can_write IS 'the key may write to its projects';
        COMMENT ON COLUMN memory.api_keys.note IS 'free text from `poimen-memory keys create --note`';
        COMMENT ON COLUMN memory.api_keys.created_at IS 'when the key was created';
    END IF;
END $$;

DO $$
BEGIN
    -- Score bounds for pruned BM25 (migration 0004, issue 12), when present.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
               WHERE attrelid = 'memory.term_stats'::regclass AND attname = 'max_tf') THEN
        COMMENT ON COLUMN memory.term_stats.max_tf IS 'derived: largest tf of the term in the project (BM25 upper bound)';
        COMMENT ON COLUMN memory.term_stats.min_dl_per_tf IS 'derived: smallest dl/tf of the term in the project (BM25 upper bound)';
    END IF;
END $$;
