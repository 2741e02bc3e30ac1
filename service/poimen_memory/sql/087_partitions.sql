-- Partitioning by project (docs/scaling.md). A choice, not the default: nodes and what hangs
-- off them (edges, postings, term and corpus statistics) become LIST partitions, one per
-- project, so a query that names a project reads only that project's heap, B-trees and its
-- own HNSW graph. memory.partition_by_project() moves an existing database over in one
-- transaction; from then on a new project gets its partitions when its row is inserted.
-- Every retrieval function works unchanged on both layouts: the keys carry the project in
-- both (migration 0009) and the statements filter by project_id, which PostgreSQL prunes.

CREATE OR REPLACE FUNCTION memory.partitioned()
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_partitioned_table t
                   WHERE t.partrelid = 'memory.nodes'::regclass)
$$;
COMMENT ON FUNCTION memory.partitioned() IS
    'true when memory.nodes (with edges, postings, term_stats, corpus_stats) is LIST-partitioned by project: see memory.partition_by_project().';

CREATE OR REPLACE FUNCTION memory.partition_tables()
RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- Referenced before referencing: edges' foreign keys point at nodes.
RETURN ARRAY['nodes', 'edges', 'postings', 'term_stats', 'corpus_stats'];
COMMENT ON FUNCTION memory.partition_tables() IS
    'The tables memory.partition_by_project() partitions by project_id, in dependency order.';

-- SECURITY DEFINER: writers create projects (ingest, memory.add_nodes) but may not create
-- tables; a partition belongs to the schema's owner, and no other role is granted on it, so
-- rows are reached only through the parent, under its row-level security.
CREATE OR REPLACE FUNCTION memory.add_project_partitions(project_id integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    t text;
    made integer := 0;
BEGIN
    FOREACH t IN ARRAY memory.partition_tables() LOOP
        CONTINUE WHEN NOT EXISTS (
            SELECT 1 FROM pg_catalog.pg_partitioned_table p
            WHERE p.partrelid = pg_catalog.to_regclass(pg_catalog.format('memory.%I', t)));
        CONTINUE WHEN pg_catalog.to_regclass(
            pg_catalog.format('memory.%I', t || '_p' || project_id)) IS NOT NULL;
        EXECUTE pg_catalog.format('CREATE TABLE memory.%I PARTITION OF memory.%I FOR VALUES IN (%s)',
                                  t || '_p' || project_id, t, project_id);
        -- Without a policy: a role that reaches a partition directly (a DBA's ALTER DEFAULT
        -- PRIVILEGES ... GRANT SELECT ON TABLES) sees no row; through the parent its
        -- policies apply, never these.
        EXECUTE pg_catalog.format('ALTER TABLE memory.%I ENABLE ROW LEVEL SECURITY',
                                  t || '_p' || project_id);
        made := made + 1;
    END LOOP;
    RETURN made;
END $$;
COMMENT ON FUNCTION memory.add_project_partitions(integer) IS
    'Creates the project''s partition of each partitioned table (named <table>_p<project id>) that lacks one; their indexes (HNSW included) come from the parents. Returns how many it made. Called by the trigger on memory.projects; a no-op on the unpartitioned layout.';

-- SECURITY DEFINER: it runs as the owner, who alone may call add_project_partitions, and
-- its delete stands in for a foreign key's cascade, which also reaches rows the deleting
-- role may not see.
CREATE OR REPLACE FUNCTION memory.projects_partitions()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        -- CREATE TABLE ... PARTITION OF locks the parents ACCESS EXCLUSIVE until this
        -- transaction ends: a new project waits for running statements on them, and every
        -- statement on them (any project) waits for the transaction that creates a project.
        PERFORM memory.add_project_partitions(NEW.id);
    ELSIF memory.partitioned() THEN
        -- The partitioned nodes have no foreign key to memory.projects (see
        -- partition_by_project); edges and statistics follow the nodes.
        DELETE FROM memory.nodes n WHERE n.project_id = OLD.id;
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION memory.projects_partitions() IS
    'Row trigger on memory.projects: gives a new project its partitions (memory.add_project_partitions) and, on the partitioned layout, deletes a deleted project''s nodes (the ON DELETE CASCADE of the foreign key memory.partition_by_project() does not carry over).';

SELECT memory._ensure_trigger('memory.projects', 'projects_partitions',
    'CREATE TRIGGER projects_partitions AFTER INSERT OR DELETE ON memory.projects
     FOR EACH ROW EXECUTE FUNCTION memory.projects_partitions()');

-- The move. Everything a table carries is read from the catalog before the tables are
-- swapped and replayed on the new ones, so nothing is written twice here and a DBA's own
-- index, trigger, policy or grant on these tables survives: indexes, constraints, triggers,
-- row-level security and its policies, table and column privileges, comments, and the
-- functions whose SQL-standard bodies (BEGIN ATOMIC) are bound to the old tables. Anything
-- else that depends on them (a DBA's view) stops the move with PostgreSQL's own error,
-- naming it, and the transaction leaves the database as it was.
CREATE OR REPLACE FUNCTION memory.partition_by_project()
RETURNS TABLE (table_name text, partitions integer, rows_before bigint, rows_after bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    tabs text[] := memory.partition_tables();
    t text;
    stmt text;
    stmts text[] := '{}';  -- replayed in order on the new tables
    fks text[] := '{}';    -- after every primary key exists
    funcs text[] := '{}';
    counts bigint[] := '{}';  -- rows per table before the move
    n bigint;
    seq_value bigint;
    started timestamptz := clock_timestamp();
    step timestamptz;
BEGIN
    IF memory.partitioned() THEN
        RAISE NOTICE 'memory.nodes is already partitioned by project: nothing to do';
        RETURN QUERY
        SELECT x.t, (SELECT count(*)::integer FROM pg_catalog.pg_inherits i
                     WHERE i.inhparent = pg_catalog.format('memory.%I', x.t)::regclass),
               NULL::bigint, NULL::bigint
        FROM unnest(tabs) AS x(t);
        RETURN;
    END IF;
    -- No project may appear, and nobody may read or write the tables, while they move.
    LOCK TABLE memory.projects IN SHARE ROW EXCLUSIVE MODE;
    FOREACH t IN ARRAY tabs LOOP
        EXECUTE pg_catalog.format('LOCK TABLE memory.%I IN ACCESS EXCLUSIVE MODE', t);
    END LOOP;

    FOREACH t IN ARRAY tabs LOOP
        -- Indexes not behind a constraint, then the constraints LIKE does not copy.
        stmts := stmts || ARRAY(
            SELECT pg_catalog.pg_get_indexdef(i.indexrelid)
            FROM pg_catalog.pg_index i
            WHERE i.indrelid = pg_catalog.format('memory.%I', t)::regclass
              AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint c WHERE c.conindid = i.indexrelid)
              -- a large project's own graphs (memory._project_graphs): on the partitioned
              -- layout each partition's graph is its project's already, and a copy would
              -- give every partition an empty pair per large project
              AND NOT memory._is_project_graph(
                  (SELECT c.relname::text FROM pg_catalog.pg_class c WHERE c.oid = i.indexrelid))
            ORDER BY i.indexrelid);
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('ALTER TABLE memory.%I ADD CONSTRAINT %I %s', t, c.conname,
                                     pg_catalog.pg_get_constraintdef(c.oid))
            FROM pg_catalog.pg_constraint c
            WHERE c.conrelid = pg_catalog.format('memory.%I', t)::regclass AND c.contype IN ('p', 'u', 'x')
            ORDER BY c.contype, c.conname);
        -- Not nodes' key to memory.projects: each new partition would copy it and so lock
        -- memory.projects SHARE ROW EXCLUSIVE from the trigger on memory.projects, whose
        -- INSERT already holds ROW EXCLUSIVE there; two projects created at once would
        -- deadlock. A partition exists only for a project, and memory.projects_partitions
        -- does the ON DELETE CASCADE.
        fks := fks || ARRAY(
            SELECT pg_catalog.format('ALTER TABLE memory.%I ADD CONSTRAINT %I %s', t, c.conname,
                                     pg_catalog.pg_get_constraintdef(c.oid))
            FROM pg_catalog.pg_constraint c
            WHERE c.conrelid = pg_catalog.format('memory.%I', t)::regclass AND c.contype = 'f'
              AND c.confrelid <> 'memory.projects'::regclass
            ORDER BY c.conname);
        stmts := stmts || ARRAY(
            SELECT pg_catalog.pg_get_triggerdef(g.oid)
            FROM pg_catalog.pg_trigger g
            WHERE g.tgrelid = pg_catalog.format('memory.%I', t)::regclass AND NOT g.tgisinternal
            ORDER BY g.tgname);
        -- CREATE TRIGGER makes it enabled: a trigger a DBA disabled (or set to fire on
        -- replicas) stays so.
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('ALTER TABLE memory.%I %s TRIGGER %I', t,
                       CASE g.tgenabled WHEN 'D' THEN 'DISABLE' WHEN 'R' THEN 'ENABLE REPLICA'
                                        ELSE 'ENABLE ALWAYS' END, g.tgname)
            FROM pg_catalog.pg_trigger g
            WHERE g.tgrelid = pg_catalog.format('memory.%I', t)::regclass AND NOT g.tgisinternal
              AND g.tgenabled <> 'O'
            ORDER BY g.tgname);
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('ALTER TABLE memory.%I %s ROW LEVEL SECURITY', t, x.mode)
            FROM pg_catalog.pg_class c,
                 LATERAL (VALUES (c.relrowsecurity, 'ENABLE'), (c.relforcerowsecurity, 'FORCE')) x(flag, mode)
            WHERE c.oid = pg_catalog.format('memory.%I', t)::regclass AND x.flag);
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('CREATE POLICY %I ON memory.%I AS %s FOR %s TO %s%s%s',
                       p.policyname, t, p.permissive, p.cmd,
                       (SELECT string_agg(CASE WHEN r = 'public' THEN 'PUBLIC' ELSE quote_ident(r) END, ', ')
                        FROM unnest(p.roles) r),
                       ' USING (' || p.qual || ')', ' WITH CHECK (' || p.with_check || ')')
            FROM pg_catalog.pg_policies p
            WHERE p.schemaname = 'memory' AND p.tablename = t
            ORDER BY p.policyname);
        -- Privileges, the owner's own included (harmless) and column privileges apart.
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('GRANT %s%s ON memory.%I TO %s%s', a.privilege_type,
                       coalesce(' (' || quote_ident(col.attname) || ')', ''), t,
                       CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END,
                       CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
            FROM pg_catalog.pg_class c
            CROSS JOIN LATERAL (SELECT NULL::name AS attname, c.relacl AS acl
                                UNION ALL
                                SELECT at.attname, at.attacl FROM pg_catalog.pg_attribute at
                                WHERE at.attrelid = c.oid AND at.attnum > 0
                                  AND NOT at.attisdropped AND at.attacl IS NOT NULL) col
            CROSS JOIN LATERAL pg_catalog.aclexplode(col.acl) a
            WHERE c.oid = pg_catalog.format('memory.%I', t)::regclass);
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('COMMENT ON TABLE memory.%I IS %L', t, d.description)
            FROM pg_catalog.pg_description d
            WHERE d.classoid = 'pg_catalog.pg_class'::regclass
              AND d.objoid = pg_catalog.format('memory.%I', t)::regclass AND d.objsubid = 0);
        stmts := stmts || ARRAY(
            SELECT pg_catalog.format('COMMENT ON COLUMN memory.%I.%I IS %L', t, at.attname, d.description)
            FROM pg_catalog.pg_description d
            JOIN pg_catalog.pg_attribute at ON at.attrelid = d.objoid AND at.attnum = d.objsubid
            WHERE d.classoid = 'pg_catalog.pg_class'::regclass
              AND d.objoid = pg_catalog.format('memory.%I', t)::regclass AND d.objsubid > 0);
    END LOOP;
    -- Functions with SQL-standard bodies are bound to the tables' OIDs: recreated from
    -- their definitions as they read now (naming memory.nodes, which will be the new one).
    funcs := ARRAY(
        SELECT DISTINCT pg_catalog.pg_get_functiondef(d.objid)
        FROM pg_catalog.pg_depend d
        WHERE d.classid = 'pg_catalog.pg_proc'::regclass
          AND d.refclassid = 'pg_catalog.pg_class'::regclass
          AND d.refobjid = ANY (ARRAY(SELECT pg_catalog.format('memory.%I', x)::regclass::oid
                                      FROM unnest(tabs) x)));
    -- NULL when no id was ever drawn: the new sequence then starts afresh, as the old would.
    SELECT s.last_value INTO seq_value
    FROM pg_catalog.pg_sequences s
    WHERE (s.schemaname || '.' || s.sequencename)::regclass
          = pg_catalog.pg_get_serial_sequence('memory.nodes', 'id')::regclass;

    -- Swap: the old tables step aside, the new ones take their names and the rows.
    FOREACH t IN ARRAY tabs LOOP
        EXECUTE pg_catalog.format('ALTER TABLE memory.%I RENAME TO %I', t, t || '_unpartitioned');
        EXECUTE pg_catalog.format(
            'CREATE TABLE memory.%I (LIKE memory.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
            'INCLUDING IDENTITY INCLUDING GENERATED INCLUDING STORAGE INCLUDING COMPRESSION) '
            'PARTITION BY LIST (project_id)', t, t || '_unpartitioned');
    END LOOP;
    PERFORM memory.add_project_partitions(p.id) FROM memory.projects p ORDER BY p.id;
    FOREACH t IN ARRAY tabs LOOP
        step := clock_timestamp();
        EXECUTE pg_catalog.format('INSERT INTO memory.%I %s SELECT * FROM memory.%I', t,
                                  CASE WHEN t = 'nodes' THEN 'OVERRIDING SYSTEM VALUE' ELSE '' END,
                                  t || '_unpartitioned');
        EXECUTE pg_catalog.format('SELECT count(*) FROM memory.%I', t || '_unpartitioned') INTO n;
        counts := counts || n;
        RAISE NOTICE 'partition_by_project: copied % rows of memory.% in % s', n, t,
            round(extract(epoch FROM clock_timestamp() - step)::numeric, 1);
    END LOOP;
    FOREACH stmt IN ARRAY funcs LOOP
        EXECUTE stmt;
    END LOOP;
    EXECUTE 'DROP TABLE ' || (SELECT string_agg(pg_catalog.format('memory.%I', x || '_unpartitioned'), ', ')
                              FROM unnest(tabs) x);
    IF seq_value IS NOT NULL THEN
        PERFORM pg_catalog.setval(pg_catalog.pg_get_serial_sequence('memory.nodes', 'id'), seq_value);
    END IF;
    EXECUTE pg_catalog.format('ALTER SEQUENCE %s RENAME TO nodes_id_seq',
                              pg_catalog.pg_get_serial_sequence('memory.nodes', 'id'));
    -- Indexes (HNSW included: one graph per partition) are built after the rows are in.
    FOREACH stmt IN ARRAY stmts || fks LOOP
        step := clock_timestamp();
        EXECUTE stmt;
        IF stmt LIKE 'CREATE%INDEX%' OR stmt LIKE '%PRIMARY KEY%' OR stmt LIKE '%UNIQUE%' THEN
            RAISE NOTICE 'partition_by_project: % (% s)', left(stmt, 120),
                round(extract(epoch FROM clock_timestamp() - step)::numeric, 1);
        END IF;
    END LOOP;
    FOREACH t IN ARRAY tabs LOOP
        EXECUTE pg_catalog.format('ANALYZE memory.%I', t);
    END LOOP;
    RAISE NOTICE 'partition_by_project: done in % s',
        round(extract(epoch FROM clock_timestamp() - started)::numeric, 1);
    FOR i IN 1 .. array_length(tabs, 1) LOOP
        EXECUTE pg_catalog.format('SELECT count(*) FROM memory.%I', tabs[i]) INTO n;
        table_name := tabs[i];
        partitions := (SELECT count(*)::integer FROM pg_catalog.pg_inherits h
                       WHERE h.inhparent = pg_catalog.format('memory.%I', tabs[i])::regclass);
        rows_before := counts[i];
        rows_after := n;
        RETURN NEXT;
    END LOOP;
END $$;
COMMENT ON FUNCTION memory.partition_by_project() IS
    'Moves nodes, edges, postings, term_stats and corpus_stats to LIST partitions by project (one per project, <table>_p<id>), in one transaction that locks them: rows, ids and the id sequence, indexes (one HNSW graph per partition), constraints (but nodes'' key to memory.projects, whose cascade a trigger does), triggers, row-level security, privileges and comments all carry over. Returns per table its partitions and rows before and after. A no-op when already partitioned. Owner only; set maintenance_work_mem for the HNSW builds first. See docs/scaling.md.';
