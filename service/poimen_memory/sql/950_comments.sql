-- A COMMENT on every table, type and column, so \d+ explains itself to a DBA. Applied last
-- (after the files that create the types), re-applied on every migrate. Function comments
-- stay beside their functions.

-- Table comments as data too, written only when they differ: COMMENT locks the table SHARE
-- UPDATE EXCLUSIVE (it would wait behind a VACUUM), and a deploy that changes nothing takes
-- no lock beyond a query's.
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT v.tbl, v.note FROM (VALUES
        ('schema_migrations', 'Ledger of applied versioned migrations (migrations/*.sql), frozen by checksum. Written by `poimen-memory migrate` only.'),
        ('_plpython_modules', 'The poimen_core package''s source files (and the tokenizer), written by `poimen-memory migrate` on every deploy: memory.plpython_load() imports from here when memory.config has no plpython_path, so a database on another host needs none of the service''s files. Read by @role.reader@ (a reader''s query imports from it); written by the owner only.'),
        ('config', 'Owner-only key/value settings read by the SQL layer: the retrieval policy (memory.set_policy), the PL/Python module path, the OpenSearch outbox switch, the remote embedding server (memory.configure_embedding_server). Readable by @role.reader@: it holds no secret.'),
        ('projects', 'Projects partition memory: every node belongs to one; statistics are per project.'),
        ('embedding_model', 'The one embedding model and dimension this database stores (a single row); nodes.embedding is typed vector(dim) to match.'),
        ('nodes', 'Memory nodes: L0 raw evidence, L1 memories, L2 syntheses. Content-addressed by sha256. tsv and lex_len are derived by triggers and cannot be written by hand.'),
        ('edges', 'Provenance: child was derived from parent (L2 -> L1 -> L0).'),
        ('postings', 'Derived BM25 postings, one row per (lexeme, node); maintained by triggers on memory.nodes.'),
        ('term_stats', 'Derived BM25 document frequencies per project and lexeme; maintained by triggers.'),
        ('corpus_stats', 'Derived BM25 corpus sizes per project; maintained by triggers.'),
        ('grant_sets', 'Each role''s grants (memory.project_grants) as one row: the project names it may read and write, and the ids of those that exist. Derived by the triggers of memory.project_grants and memory.projects and rebuilt by every migrate, so that row-level security reads one row per role whatever the number of projects. Each role sees its own row.'),
        ('opensearch_outbox', 'Queue of node changes to mirror into OpenSearch, filled by triggers while opensearch_outbox = on and drained by the service.')
        ) AS v(tbl, note)
        -- to_regclass: this file also runs on a schema before 0017 made _plpython_modules.
        WHERE pg_catalog.to_regclass(pg_catalog.format('memory.%I', v.tbl)) IS NOT NULL
          AND pg_catalog.obj_description(pg_catalog.to_regclass(pg_catalog.format('memory.%I', v.tbl)), 'pg_class')
              IS DISTINCT FROM v.note
    LOOP
        EXECUTE pg_catalog.format('COMMENT ON TABLE memory.%I IS %L', c.tbl, c.note);
    END LOOP;
END $$;

COMMENT ON TYPE memory.query_row IS
    'One row of memory.query and public.memory_query: the node, its scores and ranks per leg, the strategy that ran, and its provenance down to L0. Each column is described in docs/sql-api.md (Result columns).';

COMMENT ON TYPE memory.fused_row IS
    'One row of memory.fuse and memory.fuse_legs: a node id, its rank and score in each input list (NULL where it is absent), the fused score and the fusion method.';

COMMENT ON TYPE memory.evidence_row IS
    'One cited L0 turn as memory.select_evidence, memory.evidence and memory._evidence return it: its rank in the list, the node, its score, its own direct rank (NULL: only cited), the ranks of the results that cite it, the score its neighbours lent it and its metadata.';

COMMENT ON TYPE memory.evidence_candidate IS
    'One candidate of memory.select_evidence between its statements (an array of them, not JSON: the scores stay double precision): the L0 turn id, its score s, its direct rank pos, the ranks of the results citing it (by_rank), the score its neighbours lent it (beside) and its session (project_id, title). Internal.';

COMMENT ON TYPE memory.rested_parent IS
    'One parent a node rests on, as memory._rested_parents returns it, held by memory._support_at between its statements (an array of them, not JSON): the child, the parent version it rests on (parent_id, external_id, level, revision, precedence), its state and the id''s current version (current_id, current_revision). Internal.';

COMMENT ON TYPE memory.node_row IS
    'One node as memory.get_node returns it: its columns, its parents and children (at most memory._links_max() each, with the totals), parents_declared, support and versions.';

COMMENT ON TYPE memory.node_list_row IS
    'One node of a memory.list_nodes page: its columns, support and the cursor to page on from it.';

COMMENT ON TYPE memory.visibility IS
    'What a caller may see (sql/019_visibility.sql), the one value memory._visible tests every node row with: project_id, levels, since/before (the ts window), filter (metadata containment), the compiled grammar (ex_tsq, ex_re, req_tsq, req_re), as_of (transaction time; NULL: current versions), every_version (no transaction-time test), valid_at (valid time) and live_at (expiry); a NULL field tests nothing.';

-- The domain came with migration 0015: this file also runs on a schema before it.
DO $$
BEGIN
    IF pg_catalog.to_regtype('memory.project_name') IS NOT NULL THEN
        EXECUTE pg_catalog.format('COMMENT ON DOMAIN memory.project_name IS %L',
            'A project''s name: ' || @vocabulary.project_name_pattern@
            || ' (poimen_core/vocabulary.py PROJECT_NAME; sql/005_catalog.sql keeps the CHECK equal to it). The type of memory.projects.name.');
    END IF;
END $$;

-- Column comments as data, one row per column: a column that a migration has not yet created
-- (or has dropped) is skipped rather than failing, so this file runs on every schema version;
-- tests/test_sql_hygiene.py fails on any column left without a comment.
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT v.tbl, v.col, v.note
        FROM (VALUES
        ('schema_migrations', 'version',       'migration file name without .sql, e.g. 0001_initial'),
        ('schema_migrations', 'checksum',      'sha256 of the migration file when it was applied'),
        ('schema_migrations', 'applied_at',    'when the migration ran'),
        ('_plpython_modules', 'name',          'file name inside poimen_core, e.g. optimizer.py, or tokenizer.json'),
        ('_plpython_modules', 'source',        'the file''s text as migrate read it'),
        ('_plpython_modules', 'checksum',      'sha256 of source: migrate --check reports a row that differs'),
        ('config',            'key',           'setting name, e.g. fusion, rrf_k, plpython_path, opensearch_outbox'),
        ('config',            'value',         'setting value as text, validated by the function that writes it'),
        ('config',            'updated_at',    'when the value last changed'),
        ('grant_sets', 'role_name',   'the grantee, as in memory.project_grants'),
        ('grant_sets', 'read_names',  'the project names it may read (* for every project), sorted'),
        ('grant_sets', 'write_names', 'the project names it may write, sorted'),
        ('grant_sets', 'read_ids',    'ids of the named projects that exist, sorted (none for *)'),
        ('grant_sets', 'write_ids',   'ids of the projects it may write that exist, sorted'),
        ('projects',          'id',            'surrogate key'),
        ('projects',          'name',          'unique project name (a memory.project_name) used by every query function'),
        ('projects',          'created_at',    'when the project was first written'),
        ('embedding_model',   'singleton',     'always true: at most one row'),
        ('embedding_model',   'model',         'embedding model name, e.g. sentence-transformers/all-MiniLM-L6-v2'),
        ('embedding_model',   'dim',           'vector dimension'),
        ('embedding_model',   'configured_at', 'when memory.configure_embedding recorded it'),
        ('nodes',             'id',            'node id (the node_id of every query result)'),
        ('nodes',             'sha256',        'sha256 of the node content: the idempotence key of ingest'),
        ('nodes',             'project_id',    'owning project (memory.projects.id)'),
        ('nodes',             'level',         'L0 evidence, L1 memory, L2 synthesis'),
        ('nodes',             'external_id',   'caller-chosen id, unique within the project'),
        ('nodes',             'title',         'optional title (indexed by BM25)'),
        ('nodes',             'breadcrumb',    'path of headings or context (indexed by BM25)'),
        ('nodes',             'text',          'the node body (indexed by BM25 and embedded)'),
        ('nodes',             'source',        'where the content came from (file, URL, conversation)'),
        ('nodes',             'ts',            'when the content was written (the timestamp of query results)'),
        ('nodes',             'metadata',      'free-form JSON kept with the node'),
        ('nodes',             'embedding',     'embedding of the text with the model in memory.embedding_model'),
        ('nodes',             'tsv',           'derived: BM25 document (memory.lexical_document), set by trigger'),
        ('nodes',             'lex_len',       'derived: BM25 document length in tokens, set by trigger'),
        ('nodes',             'created_at',    'when the row was inserted'),
        ('nodes',             'parents_declared', 'the parents the node was written with (never lowered by a delete; lowered to those left when a review confirms the node, memory._rest_on_current): what memory._support_at compares with the parents still there'),
        ('edges',             'child_id',      'the derived node'),
        ('edges',             'parent_id',     'the node it was derived from'),
        ('edges',             'precedence',    'orders a child''s parents (lower first)'),
        ('edges',             'project_id',    'the project of both ends: an edge never crosses projects (migration 0009)'),
        ('postings',          'lexeme',        'stemmed term'),
        ('postings',          'project_id',    'project of the node'),
        ('postings',          'node_id',       'the node containing the term'),
        ('postings',          'level',         'level of the node (filter without a heap fetch)'),
        ('postings',          'tf',            'term frequency in the node'),
        ('postings',          'dl',            'document length of the node'),
        ('term_stats',        'project_id',    'project'),
        ('term_stats',        'lexeme',        'stemmed term'),
        ('term_stats',        'df',            'number of nodes of the project containing the term'),
        ('term_stats',        'max_tf',        'derived: largest tf of the term in the project (BM25 upper bound)'),
        ('term_stats',        'min_dl_per_tf', 'derived: smallest dl/tf of the term in the project (BM25 upper bound)'),
        ('corpus_stats',      'project_id',    'project'),
        ('corpus_stats',      'n_docs',        'number of nodes'),
        ('corpus_stats',      'total_len',     'sum of lex_len over the nodes (average length = total_len / n_docs)'),
        ('opensearch_outbox', 'id',            'queue order'),
        ('opensearch_outbox', 'node_id',       'the changed node (may be gone for a delete)'),
        ('opensearch_outbox', 'op',            'index or delete'),
        ('opensearch_outbox', 'enqueued_at',   'when the change was queued'),
        ('opensearch_outbox', 'attempts',      'delivery attempts so far'),
        ('opensearch_outbox', 'last_error',    'the last delivery error, if any'),
        ('opensearch_outbox', 'sha256',        'sha256 of the node (the OpenSearch _id), copied by the trigger; needed for deletes'),
        ('api_keys',          'id',            'surrogate key'),
        ('api_keys',          'key_hash',      'sha256 of the whole key; the key itself is never stored'),
        ('api_keys',          'prefix',        'the first characters of the key, to tell keys apart in listings'),
        ('api_keys',          'projects',      'project names the key may query (and write to, with can_write)'),
        ('api_keys',          'revoked_at',    'set by `poimen-memory keys revoke`; a revoked key is refused'),
        ('api_keys',          'can_write',     'the key may write to its projects'),
        ('api_keys',          'note',          'free text from `poimen-memory keys create --note`'),
        ('api_keys',          'created_at',    'when the key was created')
        ) AS v(tbl, col, note)
        JOIN pg_catalog.pg_attribute a
          ON a.attrelid = pg_catalog.to_regclass('memory.' || v.tbl) AND a.attname = v.col
         AND NOT a.attisdropped
        WHERE pg_catalog.col_description(a.attrelid, a.attnum) IS DISTINCT FROM v.note
    LOOP
        EXECUTE pg_catalog.format('COMMENT ON COLUMN memory.%I.%I IS %L', c.tbl, c.col, c.note);
    END LOOP;
END $$;
