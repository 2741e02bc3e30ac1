-- Grants last, after every function exists. Least privilege, listed object by object, to
-- this database's own three roles (service/poimen_memory/db/roles.py: migrate renders the
-- @role.*@ markers with <prefix>_memory_reader, _writer and _service, the prefix recorded
-- in memory.config at the first migrate):
--   reader   runs the query functions and reads the tables they read;
--   writer   is a reader that may also write content (never derived columns) and
--            call memory.add_nodes (SECURITY INVOKER: its grants and RLS apply);
--   service  is the HTTP service's writer: it may also read the API keys, record the
--            embedding model, and assert its caller's projects (sql/085_tenants.sql);
--   the owner keeps everything else: DDL-ish functions (configure_embedding,
--            reset_embedding, set_policy, reset_policy, refresh_lexical_bounds,
--            configure_embedding_server, clear_embedding_server), the
--            trigger functions, memory.config writes, the statistics and API keys.
-- Only objects named here are granted: a table or function a DBA adds to the schema stays
-- the DBA's to grant. PUBLIC has nothing, not even CONNECT to the database. After
-- pg_dump/pg_restore into a cluster without these roles, `poimen-memory migrate`
-- re-creates the roles and re-applies this file.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = '@role.reader@') THEN
        CREATE ROLE @role.reader@ NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = '@role.writer@') THEN
        CREATE ROLE @role.writer@ NOLOGIN IN ROLE @role.reader@;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = '@role.service@') THEN
        CREATE ROLE @role.service@ NOLOGIN IN ROLE @role.writer@;
    END IF;
END $$;

-- CONNECT is the cluster's first line between databases: only this database's roles (and
-- its owner, and superusers) may connect, not PUBLIC, so a role made for another product
-- database of the cluster cannot even log in here. Only the database's owner may change
-- its privileges; a schema owner who is not (a DBA's split of duties) is told so by
-- `migrate --check`, which reports PUBLIC's CONNECT.
DO $$
BEGIN
    IF pg_catalog.pg_has_role(current_user,
                              (SELECT d.datdba FROM pg_catalog.pg_database d
                               WHERE d.datname = pg_catalog.current_database()), 'USAGE') THEN
        -- Only what differs: a migrate that changes nothing writes no catalog row.
        IF pg_catalog.has_database_privilege('public', pg_catalog.current_database(), 'CONNECT') THEN
            EXECUTE pg_catalog.format('REVOKE CONNECT ON DATABASE %I FROM PUBLIC',
                                      pg_catalog.current_database());
        END IF;
        IF NOT pg_catalog.has_database_privilege('@role.reader@', pg_catalog.current_database(),
                                                 'CONNECT') THEN
            EXECUTE pg_catalog.format('GRANT CONNECT ON DATABASE %I TO @role.reader@',
                                      pg_catalog.current_database());
        END IF;
    END IF;
END $$;

REVOKE ALL ON SCHEMA memory FROM PUBLIC;
-- Functions the owner creates in the schema later are not executable by PUBLIC either. The
-- default that lets PUBLIC execute every new function is global: "IN SCHEMA memory" can
-- only add to it, never take it away, so it is revoked for the role that migrates (the
-- owner, who creates the product's functions and whose later functions these are) and for
-- the schema's owner if that is another role this one may act for. For those roles it holds
-- in every schema of this database (default privileges are per database): a function they
-- create is then executable by its owner only until granted. Nor may a default grant
-- anything here to the product's roles or PUBLIC: what they get is listed below.
DO $$
DECLARE
    r name;
BEGIN
    FOR r IN SELECT DISTINCT x.rolname FROM pg_catalog.pg_roles x
             WHERE x.rolname IN (current_user,
                                 (SELECT pg_catalog.pg_get_userbyid(n.nspowner) FROM pg_catalog.pg_namespace n
                                  WHERE n.nspname = 'memory'))
               AND pg_catalog.pg_has_role(current_user, x.oid, 'USAGE') LOOP
        EXECUTE pg_catalog.format(
            'ALTER DEFAULT PRIVILEGES FOR ROLE %I REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC', r);
        EXECUTE pg_catalog.format(
            'ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA memory REVOKE ALL ON TABLES'
            ' FROM PUBLIC, @role.reader@, @role.writer@, @role.service@', r);
        EXECUTE pg_catalog.format(
            'ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA memory REVOKE ALL ON FUNCTIONS'
            ' FROM PUBLIC, @role.reader@, @role.writer@, @role.service@', r);
        EXECUTE pg_catalog.format(
            'ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA memory REVOKE ALL ON SEQUENCES'
            ' FROM PUBLIC, @role.reader@, @role.writer@, @role.service@', r);
    END LOOP;
END $$;
GRANT USAGE ON SCHEMA memory TO @role.reader@;

DO $$
DECLARE
    -- Functions the reader may call (every overload of each name).
    reader_functions text[] := ARRAY[
        'memory.version', 'memory.roles', 'memory.capabilities', 'memory.project_id', 'memory.check_levels', 'memory.check_embedding', 'memory.require_embedding',
        'memory.check_query', 'memory.check_weight', 'memory._valid_at', 'memory.check_instant',
        'memory._visible', 'memory._visibility', 'memory._leg_visibility', 'memory._with_grammar',
        'memory._grammar_required', 'memory._versions_at', 'memory._plan_visibility',
        'memory._listing_visibility',
        'memory.policy', 'memory._policy_keys', 'memory._policy_defaults', 'memory._policy_value', 'memory.lexical_document', 'memory.lexical_search',
        'memory.lexical_kth', 'memory._bm25_score', 'memory.lexical_query', 'memory.semantic_search', 'memory._semantic_stage',
        'memory._vector_stage', 'memory._semantic_exact_current', 'memory._current_only',
        'memory._semantic_ef', 'memory.scale_warnings', 'memory._project_graphs', 'memory._project_graph_names',
        'memory.exact_search', 'memory.search_by_ids', 'memory.fuse', 'memory._fuse_lists', 'memory.fuse_legs',
        'memory.provenance_walk', 'memory._provenance_reach', 'memory._rests_on', 'memory._check_walk',
        'memory.provenance_tree', 'memory.provenance',
        'memory.provenance_forest', 'memory.hydrate', 'memory._hydrate', 'memory._support_rows',
        'memory.select_evidence', 'memory.evidence', 'memory._evidence', 'memory._deeper',
        'memory._plan', 'memory.plan_query', 'memory._request', 'memory._request_instant', 'memory.strategies',
        'memory.check_k', 'memory.check_within', 'memory._leg',
        'memory._opensearch_leg', 'memory._stage_time', 'memory._run_legs', 'memory._after_fusion',
        'memory._cited_only', 'memory._plan_cache_mode', 'memory._finish',
        'memory._execute', 'memory._prepare', 'memory.answer', 'memory._only', 'memory._serve_start',
        'memory._lexical_calls', 'memory._lexical_call',
        'memory._serve', 'memory._serve_finish', 'memory._assert_projects',
        'memory._carry_plan', 'memory._carried_plan',
        'memory.check_evidence_budget', 'memory.check_fusion', 'memory.check_filter',
        'memory.parse_query', 'memory._grammar_item', 'memory._grammar_pattern',
        'memory._grammar_doc', 'memory._grammar_has', 'memory._grammar_match',
        'memory._grammar_constraints', 'memory._grammar_compile', 'memory.check_grammar',
        'memory.plpython_path', 'memory.plpython_load', 'memory.optimize_query', 'memory._optimize_query',
        'memory.check_reference_time', 'memory.embed', 'memory._embed', 'memory._plain_error',
        'memory.stage_sql', 'memory.explain_query', 'memory._explain', 'memory._explained', 'memory._explain_vector',
        'memory._without_counts', 'memory._answer', 'memory.query',
        'public.memory_query', 'public.memory_optimize_query', 'memory.granted_projects',
        'memory.granted_project_ids', 'memory._granted_ids', 'memory._asserted_ids', 'memory.granted_all', 'memory._asserted_all',
        'memory._asserting', 'memory._role_grants', 'memory.time_bound',
        'memory.time_range', 'memory.partitioned', 'memory.partition_tables',
        'memory.history', 'memory.support',
        'memory.support_status', 'memory.parents_present', 'memory._links_max',
        'memory.get_node', 'memory._get_node', 'memory._node_cursor', 'memory._node_after',
        'memory.list_nodes', 'memory._list_nodes', 'memory.count_nodes', 'memory._count_nodes',
        'memory._nodes_where', 'memory.retention',
        'memory._rested_parents', 'memory._support_at', 'memory._support_valid_at',
        'memory._cites_superseded', 'memory.review_list', 'memory._review_rows',
        'memory._review_limit', 'memory._project_summary'];
    -- Functions that write content: the writer's (and so the service's, a writer).
    writer_functions text[] := ARRAY[
        'memory.add_nodes', 'memory._add_nodes', 'memory._write_nodes', 'memory._ensure_projects',
        'memory._stored_nodes', 'memory._stored_hashes', 'memory._vector_missing',
        'memory._writer', 'memory._same_version', 'memory.forget', 'memory._forget', 'memory._forget_max_nodes',
        'memory.check_note',
        'memory.set_retention', 'memory.expire',
        'memory._review_changes', 'memory.review_claim', 'memory.review_confirm',
        'memory._rest_on_current'];
    -- Functions nobody but the owner runs (DDL-ish, policy changes, triggers).
    owner_functions text[] := ARRAY[
        'memory.configure_embedding', 'memory.reset_embedding', 'memory.set_policy',
        'memory.reset_policy', 'memory.refresh_lexical_bounds', 'memory.nodes_lexical_row',
        'memory.nodes_lexical_statement',
        'memory.enqueue_opensearch', 'memory.grant_project', 'memory.revoke_project',
        'memory.enable_outbox', 'memory.configure_embedding_server',
        'memory.clear_embedding_server', 'memory.add_project_partitions',
        'memory.projects_partitions', 'memory.partition_by_project',
        'memory._ensure_trigger', 'memory._ensure_statement_triggers', 'memory._probe', 'memory._ensure_indexes', 'memory._is_project_graph', 'memory._declare_row',
        'memory._project_graph_defs', 'memory._index_state', 'memory._missing_project_graphs',
        'memory._refresh_grant_sets', 'memory._grants_changed', 'memory._projects_changed',
        'memory._writer_recorded', 'memory._asserted_project_ids'];
    reader_tables text[] := ARRAY[
        'memory.schema_migrations', 'memory.config', 'memory.projects',
        'memory.embedding_model', 'memory.nodes', 'memory.edges', 'memory.postings',
        'memory.term_stats', 'memory.corpus_stats', 'memory.opensearch_outbox',
        'memory.project_grants', 'memory.grant_sets', 'memory.review_queue', 'memory.retention',
        -- poimen_core's source and the tokenizer: a reader's query imports them from here
        -- (memory.plpython_load, memory.embed) when the server has no directory of them.
        'memory._plpython_modules'];
    f regprocedure;
    g record;
    t text;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname || '.' || p.proname = ANY (reader_functions || writer_functions || owner_functions)
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, @role.reader@, @role.writer@, @role.service@', f);
    END LOOP;
    FOR g IN SELECT * FROM (VALUES ('@role.reader@', reader_functions),
                                   ('@role.writer@', writer_functions)) AS v(grantee, names)
    LOOP
        FOR f IN
            SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
            JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname || '.' || p.proname = ANY (g.names)
        LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, g.grantee);
        END LOOP;
    END LOOP;
    FOREACH t IN ARRAY reader_tables || ARRAY['memory.api_keys'] LOOP
        IF to_regclass(t) IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON TABLE %s FROM PUBLIC, @role.reader@, @role.writer@, @role.service@', t);
        END IF;
    END LOOP;
    FOREACH t IN ARRAY reader_tables LOOP
        IF to_regclass(t) IS NOT NULL THEN  -- project_grants: from migration 0008 on
            EXECUTE format('GRANT SELECT ON TABLE %s TO @role.reader@', t);
        END IF;
    END LOOP;
END $$;

-- Writers change content only. Column lists keep the derived columns (tsv, lex_len: set
-- by trigger) and ids out of their reach; memory.config holds the path PL/Python imports
-- code from (as the server's OS user), so it, the ledger and the statistics stay
-- owner-only; the statistics and outbox triggers are SECURITY DEFINER for that reason.
-- What a writer may set: the node's content; parents_declared (migration 0014), which
-- memory._write_nodes sets from the parents a node names and raises when a later write
-- links more; a version's revision and who wrote it, and its end (migration 0012:
-- expired_at and the rest); created_at stays the database's clock. Each grant waits for
-- its columns, so sql/ applies on a schema between migrations.
DO $$
DECLARE
    cols text := 'sha256, project_id, level, external_id, title, breadcrumb, text, source, ts, '
                 'metadata, embedding'
                 || CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                                      WHERE a.attrelid = 'memory.nodes'::regclass
                                        AND a.attname = 'parents_declared' AND NOT a.attisdropped)
                         THEN ', parents_declared' ELSE '' END
                 -- valid time (migration 0018): content, blanked by an erase
                 || CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                                      WHERE a.attrelid = 'memory.nodes'::regclass
                                        AND a.attname = 'valid_to' AND NOT a.attisdropped)
                         THEN ', valid_from, valid_to' ELSE '' END;
BEGIN
    EXECUTE pg_catalog.format('GRANT INSERT (%s), UPDATE (%s), DELETE ON memory.nodes TO @role.writer@',
                              cols, cols);
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
               WHERE a.attrelid = 'memory.nodes'::regclass AND a.attname = 'revision') THEN
        GRANT INSERT (revision, written_by),
              UPDATE (expired_at, end_reason, ended_by, end_note, erased_at)
            ON memory.nodes TO @role.writer@;
    END IF;
    -- Expiry and retention (migration 0021): a writer sets a node's expiry (the writer,
    -- memory.set_retention) and its projects' retention; row-level security keeps both to
    -- the projects it may write.
    IF to_regclass('memory.retention') IS NOT NULL THEN
        GRANT INSERT (expires_at), UPDATE (expires_at) ON memory.nodes TO @role.writer@;
        GRANT INSERT, UPDATE, DELETE ON memory.retention TO @role.writer@;
    END IF;
END $$;
GRANT INSERT, UPDATE, DELETE ON memory.edges TO @role.writer@;
GRANT INSERT (name), DELETE ON memory.projects TO @role.writer@;
GRANT INSERT, UPDATE, DELETE ON memory.opensearch_outbox TO @role.writer@;
-- The review queue (migration 0019): writers fill it (the writer, forget) and work it
-- (claim, confirm); row-level security keeps each to its projects.
DO $$
BEGIN
    IF to_regclass('memory.review_queue') IS NOT NULL THEN
        GRANT INSERT, UPDATE ON memory.review_queue TO @role.writer@;
    END IF;
END $$;

-- The service checks API keys, records the embedding model on the first ingest into a
-- fresh database and switches the OpenSearch outbox on (both SECURITY DEFINER for it).
DO $$
BEGIN
    IF to_regclass('memory.api_keys') IS NOT NULL THEN  -- from migration 0005 on
        GRANT SELECT ON memory.api_keys TO @role.service@;
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION memory.configure_embedding(text, integer) TO @role.service@;
GRANT EXECUTE ON FUNCTION memory.enable_outbox() TO @role.service@;
-- memory._granted_ids runs it for the service asserting projects, and for no other caller:
-- it reads project names past row-level security (sql/085_tenants.sql).
GRANT EXECUTE ON FUNCTION memory._asserted_project_ids(text[]) TO @role.service@;
