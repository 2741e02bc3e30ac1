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
-- The projects that get HNSW graphs of their own (issue 28): past the exact stage
-- (exact_scan_max_nodes) and past project_graph_min_nodes, holding under half of the store.
-- Such a project's filtered scan of the shared graph walks mostly other projects' nodes and,
-- on the realistic corpus at 100k nodes, found 0.83-0.92 of the true top 10 at ef_search 200
-- (docs/benchmarks.md, "Recall at scale"). A partial index per filter value is pgvector's own
-- answer for a filter over a few values; the planner picks the smallest graph whose predicate
-- the query's project implies. Zipf-sized tenants keep the list short: the projects past
-- 5,000 nodes are few, whatever the store's size. A store partitioned by project has a graph
-- per partition already.
-- A large project's own pair of graphs, named by its id so a rename keeps them: the one
-- place their names are made (memory._project_graph_defs, scale_warnings) and recognised
-- (migrate's index pass, memory.reset_embedding, memory.partition_by_project).
CREATE OR REPLACE FUNCTION memory._project_graph_names(project_id integer)
RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT ARRAY['nodes_embedding_hnsw_p' || project_id, 'nodes_embedding_hnsw_l1_l2_p' || project_id] $$;
COMMENT ON FUNCTION memory._project_graph_names(integer) IS
    'The names of a project''s own HNSW graphs (memory._project_graphs): nodes_embedding_hnsw_p<id> (every level) and nodes_embedding_hnsw_l1_l2_p<id> (the default levels).';

CREATE OR REPLACE FUNCTION memory._is_project_graph(index_name text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT index_name ~ '^nodes_embedding_hnsw(_l1_l2)?_p[0-9]+$' $$;
COMMENT ON FUNCTION memory._is_project_graph(text) IS
    'Whether an index name is one of memory._project_graph_names'' (a project''s own HNSW graph).';

-- At most project_graphs_max projects have them (issue 42): each pair is two more indexes
-- every statement on memory.nodes plans and every insert checks the predicate of. When more
-- qualify, the largest by current nodes get them, ties by id.
-- hold: the looser bounds a project that has its graphs (its first one exists, valid or
-- not) keeps them under (past 80% of the size threshold, under 60% of the store), and in the
-- ranking for the cap it counts 1.25x its size, so one that hovers at a threshold, or at the
-- cap beside a project of about its size, is not built and dropped on alternate migrates.
CREATE OR REPLACE FUNCTION memory._project_graphs(hold boolean DEFAULT false)
RETURNS TABLE (project_id integer, n_docs bigint)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.project_id, r.n_docs
    FROM (SELECT c.project_id, c.n_docs::bigint AS n_docs,
                 hold AND pg_catalog.to_regclass(pg_catalog.format(
                     'memory.%I', (memory._project_graph_names(c.project_id))[1])) IS NOT NULL AS has,
                 p.least_nodes, p.total
          FROM memory.corpus_stats c,
               (SELECT greatest(memory._policy_value('exact_scan_max_nodes')::bigint,
                                memory._policy_value('project_graph_min_nodes')::bigint) AS least_nodes,
                       memory._policy_value('project_graph_min_nodes')::bigint AS on_at,
                       memory._policy_value('project_graphs_max')::bigint AS most,
                       (SELECT coalesce(sum(s.n_docs), 0) FROM memory.corpus_stats s) AS total) p
          WHERE p.on_at > 0 AND p.most > 0 AND NOT memory.partitioned()
            AND c.n_docs > p.least_nodes * 0.8 AND 2 * c.n_docs * 0.8 < p.total) r
    WHERE (r.n_docs > r.least_nodes AND 2 * r.n_docs < r.total) OR r.has
    ORDER BY r.n_docs * CASE WHEN r.has THEN 1.25 ELSE 1 END DESC, r.project_id
    LIMIT memory._policy_value('project_graphs_max')::bigint
$$;
COMMENT ON FUNCTION memory._project_graphs(boolean) IS
    'The projects migrate gives HNSW graphs of their own (nodes_embedding_hnsw_p<id>, nodes_embedding_hnsw_l1_l2_p<id>: partial indexes WHERE project_id = <id>): more current nodes than both exact_scan_max_nodes and project_graph_min_nodes (policy; 0: none), under half of the store, on a store not partitioned by project; at most project_graphs_max of them (policy; 0: none), the largest by current nodes, ties by id. hold => true: one that has them keeps them within the looser bounds (80% of the size, 60% of the store) and counts 1.25x its size in the ranking. Largest first. Over the projects the caller may see.';

-- The one definition of a large project's own pair of graphs (what follows "CREATE INDEX
-- name ON memory.nodes"), for each project that is to have them: memory._project_graphs(true),
-- which keeps one that has them (its first graph exists, valid or not) within the looser
-- bounds, and at most project_graphs_max. memory._ensure_indexes keeps these and drops the others; migrate builds the
-- missing ones after its transaction (memory._missing_project_graphs). None before an
-- embedding model is configured: the column has no dimension to build a graph on.
CREATE OR REPLACE FUNCTION memory._project_graph_defs()
RETURNS TABLE (project_id integer, index_name text, definition text)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT g.project_id, n.name, pg_catalog.format(
               'USING hnsw (embedding %I.vector_cosine_ops) WITH (m = 16, ef_construction = 64) WHERE project_id = %s%s',
               (SELECT s.nspname FROM pg_catalog.pg_extension e
                JOIN pg_catalog.pg_namespace s ON s.oid = e.extnamespace WHERE e.extname = 'vector'),
               g.project_id, CASE n.k WHEN 2 THEN ' AND level IN (''L1'', ''L2'')' ELSE '' END)
    FROM memory._project_graphs(true) g
    CROSS JOIN LATERAL pg_catalog.unnest(memory._project_graph_names(g.project_id)) WITH ORDINALITY n(name, k)
    WHERE EXISTS (SELECT 1 FROM memory.embedding_model)
    ORDER BY g.project_id, n.k
$$;
COMMENT ON FUNCTION memory._project_graph_defs() IS
    'The HNSW graphs of their own the large projects are to have (memory._project_graphs(true): one that has them keeps them within the looser bounds; at most project_graphs_max projects): project, index name (memory._project_graph_names) and its definition after "ON memory.nodes". Empty before an embedding model is configured.';

-- How an index of tbl stands against the definition sql/ wants: missing, invalid (a
-- CREATE INDEX CONCURRENTLY that failed or was interrupted leaves one behind, and the
-- planner never reads it), differs (compared with the same index built on a probe table
-- first), or ok. The one comparison memory._ensure_indexes and memory._missing_project_graphs
-- share.
CREATE OR REPLACE FUNCTION memory._index_state(tbl regclass, index_name text, definition text)
RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    have oid;
    valid boolean;
    probe regclass;
BEGIN
    SELECT i.indexrelid, i.indisvalid INTO have, valid FROM pg_catalog.pg_index i
    JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
    WHERE i.indrelid = tbl AND c.relname = index_name;
    IF have IS NULL THEN
        RETURN 'missing';
    ELSIF NOT valid THEN
        RETURN 'invalid';
    END IF;
    probe := memory._probe(tbl);
    -- A second pass in one transaction finds the first one's probe index.
    IF pg_catalog.to_regclass(pg_catalog.format('pg_temp.%I', index_name)) IS NOT NULL THEN
        EXECUTE pg_catalog.format('DROP INDEX pg_temp.%I', index_name);
    END IF;
    EXECUTE pg_catalog.format('CREATE INDEX %I ON %s %s', index_name, probe, definition);
    -- The definitions compared from USING on: the table's name differs, and a partitioned
    -- table's index reads ON ONLY.
    RETURN CASE WHEN pg_catalog.substring(pg_catalog.pg_get_indexdef(have), ' USING .*$')
                     = (SELECT pg_catalog.substring(pg_catalog.pg_get_indexdef(i.indexrelid), ' USING .*$')
                        FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
                        WHERE i.indrelid = probe AND c.relname = index_name)
                THEN 'ok' ELSE 'differs' END;
END $$;
COMMENT ON FUNCTION memory._index_state(regclass, text, text) IS
    'How the index index_name of tbl stands against definition (what follows "CREATE INDEX name ON tbl"): missing, invalid (pg_index.indisvalid false: a failed or interrupted concurrent build), differs (compared with the same index built on a probe table, memory._probe), or ok.';

-- A project's own graphs are not built in migrate's transaction: a plain CREATE INDEX holds
-- writes off memory.nodes for the whole build (about 8 minutes for 26 projects at 1M nodes).
-- migrate runs these statements after its commit, one at a time, where CREATE INDEX
-- CONCURRENTLY lets writes go on (db/migrate.py, build_project_graphs); an invalid or
-- different one it drops (DROP INDEX CONCURRENTLY) first.
CREATE OR REPLACE FUNCTION memory._missing_project_graphs()
RETURNS TABLE (index_name text, project_id integer, state text, statement text)
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.index_name, d.project_id, s.state,
           pg_catalog.format('CREATE INDEX CONCURRENTLY %I ON memory.nodes %s', d.index_name, d.definition)
    FROM memory._project_graph_defs() d
    CROSS JOIN LATERAL memory._index_state('memory.nodes'::regclass, d.index_name, d.definition) s(state)
    WHERE s.state <> 'ok'
    ORDER BY d.project_id, pg_catalog.array_position(memory._project_graph_names(d.project_id), d.index_name)
$$;
COMMENT ON FUNCTION memory._missing_project_graphs() IS
    'The large projects'' own HNSW graphs (memory._project_graph_defs) that are missing, invalid or differ from their definition: index name, project, state (memory._index_state) and the CREATE INDEX CONCURRENTLY statement that builds it, which migrate runs after its transaction has committed (outside any transaction block) so that writes go on meanwhile.';

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
        -- A question's statistics (memory.lexical_search, memory._plan) are read by
        -- lexeme within a key range of projects (one project, or all of them): lexeme
        -- first, then the project, so that either is a few descents. Under the primary key
        -- (project_id, lexeme) the range came first, and a plan made before ANALYZE read
        -- every lexeme of the project per question (SciFact: 8.9 of 13 ms a search).
        ['0004_lexical_bounds', 'term_stats', 'term_stats_lexeme_idx',
         '(lexeme, project_id) INCLUDE (df, max_tf, min_dl_per_tf)'],
        ['0013_query_grammar', 'nodes', 'nodes_metadata_gin', 'USING gin (metadata jsonb_path_ops)'],
        ['0018_valid_time', 'nodes', 'nodes_valid_bounded',
         '(project_id) WHERE expired_at IS NULL AND (valid_from IS NOT NULL OR valid_to IS NOT NULL)'],
        -- issue 40: list, count and forget by metadata read current versions only
        ['0021_scope_expiry', 'nodes', 'nodes_metadata_current_gin',
         'USING gin (metadata jsonb_path_ops) WHERE expired_at IS NULL'],
        -- The evidence's neighbours (memory.select_evidence): the nearest L0 turn of the
        -- same project and title in ingest order is one descent, where the primary key read
        -- up to 64 rows a side and a corpus of one document a title always read them all.
        -- A title over 2,000 bytes stays out: a btree entry holds at most 2,704.
        ['0001_initial', 'nodes', 'nodes_l0_session',
         '(project_id, title, id) WHERE level = ''L0'' AND octet_length(title) <= 2000']];
    w text[];
    rel regclass;
    own name;
    -- The large projects' own graphs are kept here, not built: migrate builds the missing
    -- ones concurrently after its commit (memory._missing_project_graphs).
    own_graphs text[] := ARRAY(SELECT d.index_name FROM memory._project_graph_defs() d);
    checking boolean := coalesce(pg_catalog.current_setting('poimen.migrate_check', true), '') = 'on';
    made text[] := '{}';
BEGIN
    -- Migration 0021 widened nodes_valid_bounded to the nodes with an expiry (memory._valid_at).
    IF EXISTS (SELECT 1 FROM memory.schema_migrations m WHERE m.version = '0021_scope_expiry') THEN
        wanted[7][4] := '(project_id) WHERE expired_at IS NULL AND (valid_from IS NOT NULL OR valid_to IS NOT NULL OR expires_at IS NOT NULL)';
    END IF;
    IF hnsw THEN
        wanted := wanted || ARRAY[
            ['0001_initial', 'nodes', 'nodes_embedding_hnsw', pg_catalog.format(
                'USING hnsw (embedding %I.vector_cosine_ops) WITH (m = 16, ef_construction = 64)', vs)],
            ['0001_initial', 'nodes', 'nodes_embedding_hnsw_l1_l2', pg_catalog.format(
                'USING hnsw (embedding %I.vector_cosine_ops) WITH (m = 16, ef_construction = 64) WHERE level IN (''L1'', ''L2'')', vs)]];
    END IF;
    -- A project's own graphs that are no longer wanted (it shrank, grew past half of the
    -- store, was deleted, or the policy changed) go: the shared graph serves it again. A
    -- drop is quick; not under migrate --check (poimen.migrate_check), which changes nothing.
    FOR own IN
        SELECT c.relname FROM pg_catalog.pg_index i
        JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'memory.nodes'::regclass
          AND memory._is_project_graph(c.relname)
          AND NOT c.relname = ANY (own_graphs)
          AND NOT checking
    LOOP
        EXECUTE pg_catalog.format('DROP INDEX memory.%I', own);
        made := made || ('-' || own);
    END LOOP;
    FOREACH w SLICE 1 IN ARRAY wanted LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM memory.schema_migrations m WHERE m.version = w[1]);
        rel := pg_catalog.format('memory.%I', w[2])::regclass;
        CONTINUE WHEN memory._index_state(rel, w[3], w[4]) = 'ok';
        EXECUTE pg_catalog.format('DROP INDEX IF EXISTS memory.%I', w[3]);
        EXECUTE pg_catalog.format('CREATE INDEX %I ON %s %s', w[3], rel, w[4]);
        made := made || w[3];
    END LOOP;
    RETURN made;
END $$;
COMMENT ON FUNCTION memory._ensure_indexes() IS
    'Builds the product''s indexes that are missing, invalid or differ from their definition here (memory._index_state), and drops the large projects'' own HNSW graphs no longer wanted (memory._project_graph_defs; not under migrate --check); returns the names it built, and those it dropped prefixed with -. The projects'' graphs it does not build: migrate builds them after its commit with CREATE INDEX CONCURRENTLY (memory._missing_project_graphs). Run by migrate; a DBA''s own indexes are left alone.';

SELECT memory._ensure_indexes();

-- What a deployment must change as it grows (issue 28), as rows a DBA reads: migrate and
-- migrate --check print them, GET /healthz counts them. Over the projects the caller sees
-- (the owner, migrate: all of them).
-- - filtered_hnsw: a project past exact_scan_max_nodes holding under half of the store with
--   no graph of its own yet: its queries take the project-filtered HNSW scan of the shared
--   graph, whose recall falls as the rest of the store grows (docs/benchmarks.md, "Recall at
--   scale (issue 28)"). The next migrate builds it one when memory._project_graphs names it;
--   the hint says which. Not on a store partitioned by project: each project has its own
--   graph there.
-- - hnsw_graph: more than large_store_nodes (500,000) nodes on graphs built with m = 16.
CREATE OR REPLACE FUNCTION memory.scale_warnings()
RETURNS TABLE (project text, what text, hint text)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    cap integer := memory._policy_value('exact_scan_max_nodes')::integer;
    total bigint := (SELECT coalesce(sum(c.n_docs), 0) FROM memory.corpus_stats c);
    m integer;
BEGIN
    IF cap > 0 AND NOT memory.partitioned() THEN
        RETURN QUERY
        SELECT p.name::text, 'filtered_hnsw'::text,
               pg_catalog.format('project %s holds %s nodes (%s%% of %s), above exact_scan_max_nodes = %s: '
                                 'its semantic leg takes the project-filtered scan of the shared HNSW graph '
                                 '(hnsw.ef_search = filtered_ef_search, %s), whose recall falls as the store grows; ',
                                 p.name, c.n_docs, round(100.0 * c.n_docs / total, 1), total, cap,
                                 memory._policy_value('filtered_ef_search'))
               || CASE WHEN g.project_id IS NOT NULL THEN
                      'run poimen-memory migrate: it builds the project HNSW graphs of its own ('
                      || (memory._project_graph_names(c.project_id))[1] || ')'
                  ELSE
                      CASE WHEN memory._policy_value('project_graph_min_nodes')::bigint = 0
                           THEN 'turn project graphs on (project_graph_min_nodes is 0: off) and run poimen-memory migrate '
                           WHEN memory._policy_value('project_graphs_max')::bigint = 0
                           THEN 'turn project graphs on (project_graphs_max is 0: none) and run poimen-memory migrate '
                           WHEN c.n_docs > memory._policy_value('project_graph_min_nodes')::bigint
                           THEN pg_catalog.format('it is past project_graph_min_nodes, but the project_graphs_max = %s largest '
                                                  'have theirs: raise project_graphs_max (each pair '
                                                  'adds planning to every statement on memory.nodes and work to every '
                                                  'insert, docs/benchmarks.md) and run poimen-memory migrate ',
                                                  memory._policy_value('project_graphs_max'))
                           ELSE pg_catalog.format('set project_graph_min_nodes (now %s) below its size and run poimen-memory migrate ',
                                                  memory._policy_value('project_graph_min_nodes')) END
                      || 'to give it HNSW graphs of its own, raise exact_scan_max_nodes if an exact scan of it '
                         'is fast enough, or partition the store by project '
                         '(poimen-memory migrate --partition-by-project, docs/scaling.md)'
                  END
        FROM memory.corpus_stats c JOIN memory.projects p ON p.id = c.project_id
        LEFT JOIN memory._project_graphs(true) g ON g.project_id = c.project_id
        WHERE c.n_docs > cap AND 2 * c.n_docs < total
          AND (SELECT count(*) FROM pg_catalog.pg_index i
               JOIN pg_catalog.pg_class r ON r.oid = i.indexrelid
               WHERE i.indrelid = 'memory.nodes'::regclass AND i.indisvalid
                 AND r.relname = ANY (memory._project_graph_names(c.project_id))) < 2
        ORDER BY c.n_docs DESC, p.name;
    END IF;
    -- The measure memory._semantic_ef reads: the table's planner estimate, every row.
    IF (SELECT c.reltuples FROM pg_catalog.pg_class c
        WHERE c.oid = 'memory.nodes'::regclass AND c.relkind = 'r')
       > memory._policy_value('large_store_nodes')::bigint THEN
        FOR m IN
            SELECT coalesce((SELECT split_part(o, '=', 2)::integer FROM unnest(r.reloptions) o
                             WHERE o LIKE 'm=%'), 16)
            FROM pg_catalog.pg_class r
            WHERE r.relnamespace = 'memory'::regnamespace
              AND r.relname IN ('nodes_embedding_hnsw', 'nodes_embedding_hnsw_l1_l2')
        LOOP
            CONTINUE WHEN m > 16;
            project := NULL;
            what := 'hnsw_graph';
            hint := pg_catalog.format(
                'the store holds %s nodes on HNSW graphs built with m = %s, past large_store_nodes = %s: a scan '
                'naming no project runs at large_store_ef_search = %s (recall@10 0.966 at 1,000,000 nodes on the '
                'realistic corpus, against 0.928 at ef_search 100; docs/benchmarks.md), and a large project''s '
                'own graph at filtered_ef_search. Partition the store by project (docs/scaling.md) so each '
                'project''s search reads a graph of its own size; migrate builds every graph with m = 16, so a '
                'denser graph is not a setting yet', total, m, memory._policy_value('large_store_nodes'),
                memory._policy_value('large_store_ef_search'));
            RETURN NEXT;
            EXIT;
        END LOOP;
    END IF;
END $$;
COMMENT ON FUNCTION memory.scale_warnings() IS
    'What the store has outgrown, one row each (project, what, hint): filtered_hnsw, a project above the policy''s exact_scan_max_nodes holding under half of the store with no HNSW graph of its own yet (its project-filtered recall of the shared graph falls as the store grows; the hint says whether the next migrate builds one, memory._project_graphs, or why not: project_graph_min_nodes, or project_graphs_max larger projects have theirs; not on a store partitioned by project); hnsw_graph (project NULL), more than the policy''s large_store_nodes (500,000) nodes on HNSW graphs built with m = 16. Over the projects the caller may see. Printed by poimen-memory migrate and migrate --check, counted by GET /healthz.';
