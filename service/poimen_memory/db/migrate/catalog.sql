-- Every statement migrate sends of its own (the files it applies are migrations/ and sql/),
-- by name: read as db/queries.sql is (layout.catalog). `{name}` is filled in by
-- psycopg.sql's format: identifiers, literals or another statement of this file.

-- name: relation_exists
SELECT pg_catalog.to_regclass(%s) IS NOT NULL;

-- name: function_exists
SELECT pg_catalog.to_regprocedure(%s) IS NOT NULL;


-- name: ledger_create
CREATE SCHEMA IF NOT EXISTS memory;
CREATE TABLE IF NOT EXISTS memory.schema_migrations (
    version    text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: ledger_recorded
SELECT version, checksum FROM memory.schema_migrations;

-- name: ledger_record
INSERT INTO memory.schema_migrations (version, checksum) VALUES (%s, %s);


-- name: vector_schema
SELECT n.nspname FROM pg_catalog.pg_extension e
JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'vector';

-- name: set_search_path
SET LOCAL search_path = {path};

-- name: our_functions
-- The functions sql/ owns: everything in schema memory and the public.memory_* aliases.
SELECT p.oid::regprocedure::text AS signature, p.prosecdef, p.proconfig
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'memory'
   OR (n.nspname = 'public' AND p.proname IN ('memory_query', 'memory_optimize_query'));

-- name: touched_functions
-- Functions (re)created by this transaction: their pg_proc row carries its xid, like the
-- marker table created at its start. A DBA's own functions in the schema are left alone.
SELECT f.* FROM ({functions}) f
JOIN pg_catalog.pg_proc p ON p.oid = f.signature::regprocedure
WHERE p.xmin = (SELECT c.xmin FROM pg_catalog.pg_class c WHERE c.oid = {mark}::regclass);

-- name: mark_transaction
CREATE TEMP TABLE IF NOT EXISTS {mark} () ON COMMIT DROP;

-- name: load_pgvector
SELECT '[1]'::vector;

-- name: pin_search_path
ALTER FUNCTION {function} SET search_path = {path};

-- name: grant_vector_schema
GRANT USAGE ON SCHEMA {schema} TO {role};


-- name: plpython_status
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'plpython3u'),
       EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'plpython3u')
       OR ((SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
           AND EXISTS (SELECT 1 FROM pg_catalog.pg_available_extensions
                       WHERE name = 'plpython3u'));

-- name: modules_remove_others
DELETE FROM memory._plpython_modules WHERE NOT (name = ANY(%s));

-- name: modules_write
INSERT INTO memory._plpython_modules (name, source, checksum) VALUES (%s, %s, %s)
ON CONFLICT (name) DO UPDATE SET source = EXCLUDED.source, checksum = EXCLUDED.checksum
WHERE memory._plpython_modules.source IS DISTINCT FROM EXCLUDED.source;

-- name: modules_read
SELECT name, source, checksum FROM memory._plpython_modules;

-- name: config_set
-- A product key of memory.config as migrate sets it; a row already right is not rewritten.
INSERT INTO memory.config (key, value) VALUES (%s, %s)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
WHERE memory.config.value IS DISTINCT FROM EXCLUDED.value;

-- name: config_delete
DELETE FROM memory.config WHERE key = %s;

-- name: config_plpython
SELECT key, value FROM memory.config WHERE key IN ('plpython_path', 'plpython_checksum');


-- name: legacy_roles_here
SELECT CASE WHEN pg_catalog.to_regrole('memory_reader') IS NULL THEN false
            ELSE pg_catalog.has_schema_privilege('memory_reader', 'memory', 'USAGE') END;

-- name: recorded_prefix
SELECT value FROM memory.config WHERE key = 'role_prefix';

-- name: record_prefix
INSERT INTO memory.config (key, value) VALUES ('role_prefix', %s);

-- name: current_database
SELECT pg_catalog.current_database();

-- name: role_exists
SELECT pg_catalog.to_regrole(%s);

-- name: role_members
SELECT m.rolname FROM pg_catalog.pg_auth_members a
JOIN pg_catalog.pg_roles m ON m.oid = a.member
WHERE a.roleid = pg_catalog.to_regrole(%s) AND m.rolname <> ALL (%s)
ORDER BY 1;

-- name: grant_role
GRANT {role} TO {member};

-- name: move_project_grants
INSERT INTO memory.project_grants (role_name, project, can_write, granted_at)
SELECT %s, g.project, g.can_write, g.granted_at FROM memory.project_grants g
WHERE g.role_name = %s ON CONFLICT DO NOTHING;

-- name: drop_project_grants
DELETE FROM memory.project_grants WHERE role_name = %s;

-- name: revoke_all_in_schema
REVOKE ALL ON ALL {kind} IN SCHEMA memory FROM {role};

-- name: revoke_schema
REVOKE ALL ON SCHEMA memory FROM {role};

-- name: public_aliases
SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
WHERE p.pronamespace = 'public'::regnamespace
  AND p.proname IN ('memory_query', 'memory_optimize_query');

-- name: revoke_function
REVOKE ALL ON FUNCTION {function} FROM {role};

-- name: revoke_vector_schema
REVOKE USAGE ON SCHEMA {schema} FROM {role};

-- name: shared_roles
SELECT DISTINCT r.rolname::text, d.datname::text
FROM pg_catalog.pg_shdepend s
JOIN pg_catalog.pg_roles r ON r.oid = s.refobjid
JOIN pg_catalog.pg_database d ON d.oid = s.dbid
WHERE s.refclassid = 'pg_catalog.pg_authid'::regclass
  AND r.rolname = ANY (%s) AND d.datname <> pg_catalog.current_database()
ORDER BY 1, 2;


-- name: set_lock_timeout
SET LOCAL lock_timeout = {timeout};

-- name: transaction_lock
SELECT pg_advisory_xact_lock(%s);

-- name: lock_holders
-- Who holds a lock on the memory schema's relations (or migrate's advisory lock): named
-- when an attempt gave up, so the operator knows what it waited for.
SELECT coalesce(l.relation::regclass::text, 'the advisory lock of another migrate'), l.mode,
       a.pid, a.usename, a.state,
       extract(epoch FROM (now() - coalesce(a.xact_start, a.query_start)))::integer,
       left(regexp_replace(a.query, '\s+', ' ', 'g'), 120)
FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.pid <> pg_catalog.pg_backend_pid()
  AND ((l.locktype = 'relation' AND l.database = (SELECT oid FROM pg_catalog.pg_database
                                                   WHERE datname = current_database())
        AND l.relation IN (SELECT c.oid FROM pg_catalog.pg_class c
                           WHERE c.relnamespace = 'memory'::regnamespace))
       OR (l.locktype = 'advisory' AND l.objid = %s))
ORDER BY 1, 3;


-- name: scale_warnings
SELECT project, what, hint FROM memory.scale_warnings();

-- name: missing_graphs
SELECT index_name, project_id, state, statement FROM memory._missing_project_graphs();

-- name: session_timeouts
SELECT current_setting('lock_timeout'), current_setting('statement_timeout');

-- name: set_session_timeouts
SELECT set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false);

-- name: drop_index_concurrently
DROP INDEX CONCURRENTLY IF EXISTS memory.{index};

-- name: build_lock_try
SELECT pg_try_advisory_lock(%s);

-- name: build_lock
SELECT pg_advisory_lock(%s);

-- name: build_unlock
SELECT pg_advisory_unlock(%s);

-- name: build_lock_holders
SELECT string_agg(pid::text, ', ') FROM pg_catalog.pg_locks
WHERE locktype = 'advisory' AND granted AND objid = %s AND pid <> pg_backend_pid();


-- name: ledger_versions
SELECT version FROM memory.schema_migrations;

-- name: check_mark
-- Nothing is dropped for a rollback either (sql/088_indexes.sql reads this).
SELECT set_config('poimen.migrate_check', 'on', true);

-- name: function_snapshot
-- Bodies and settings only: who may run a function is compared apart (protection, as the
-- set of privileges PUBLIC and the product's roles hold), so an ACL that differs only in
-- its grantor or its order (a restore into another cluster) is no finding.
SELECT f.signature,
       md5(pg_catalog.pg_get_functiondef(f.signature::regprocedure)
           || coalesce(p.proparallel::text, '')
           || coalesce(pg_catalog.obj_description(p.oid, 'pg_proc'), ''))
FROM ({functions}) f JOIN pg_catalog.pg_proc p ON p.oid = f.signature::regprocedure
WHERE p.prokind <> 'a';

-- name: protection
-- What protects the data, as (kind, object, state) rows: compared before and after sql/
-- is applied, so the files are the one source of truth for what it should be. Grants are
-- the privileges of PUBLIC and the product's roles (grantees) only (the owner's and a
-- DBA's own roles' are the DBA's), one row per privilege, grantor and order ignored; the
-- default privileges are those of the roles that create the product's objects (the one
-- migrating, the schema's owner), which is what a function such a role adds later gets.
WITH grantee(oid, name) AS (
    SELECT 0::oid, 'PUBLIC'
    UNION ALL
    SELECT r.oid, r.rolname::text FROM pg_catalog.pg_roles r
    WHERE r.rolname IN ({grantees})
), rels AS (
    SELECT c.oid, c.relname, c.relkind, c.relacl, c.relowner, c.relrowsecurity,
           c.relforcerowsecurity
    FROM pg_catalog.pg_class c
    WHERE c.relnamespace = 'memory'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
), creators AS (
    SELECT r.oid, r.rolname FROM pg_catalog.pg_roles r
    WHERE r.rolname = current_user
       OR r.oid = (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'memory')
)
SELECT 'row-level security', 'memory.' || c.relname,
       CASE WHEN c.relrowsecurity THEN 'enabled' ELSE 'disabled' END
       || CASE WHEN c.relforcerowsecurity THEN ', forced' ELSE '' END
FROM rels c WHERE c.relkind IN ('r', 'p')
UNION ALL
SELECT 'policy', p.polname || ' on memory.' || c.relname,
       pg_catalog.format('%s FOR %s TO %s USING (%s) WITH CHECK (%s)',
           CASE WHEN p.polpermissive THEN 'PERMISSIVE' ELSE 'RESTRICTIVE' END, p.polcmd,
           (SELECT pg_catalog.string_agg(CASE WHEN r = 0 THEN 'PUBLIC'
                                              ELSE pg_catalog.pg_get_userbyid(r)::text END, ', ')
            FROM pg_catalog.unnest(p.polroles) r),
           pg_catalog.pg_get_expr(p.polqual, p.polrelid),
           pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid))
FROM pg_catalog.pg_policy p JOIN rels c ON c.oid = p.polrelid
UNION ALL
SELECT 'index', 'memory.' || ic.relname,
       pg_catalog.pg_get_indexdef(i.indexrelid)
       || CASE WHEN i.indisvalid THEN '' ELSE ' (invalid)' END
FROM pg_catalog.pg_index i JOIN rels c ON c.oid = i.indrelid
JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
UNION ALL
SELECT 'trigger', t.tgname || ' on memory.' || c.relname,
       pg_catalog.pg_get_triggerdef(t.oid)
       || CASE t.tgenabled WHEN 'O' THEN '' WHEN 'D' THEN ' (disabled)'
                           WHEN 'R' THEN ' (replica only)' ELSE ' (always)' END
FROM pg_catalog.pg_trigger t JOIN rels c ON c.oid = t.tgrelid
WHERE NOT t.tgisinternal AND t.tgparentid = 0
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON %s memory.%I%s TO %s',
           a.privilege_type, CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
           c.relname, coalesce(' (' || pg_catalog.quote_ident(x.col) || ')', ''), g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM rels c
CROSS JOIN LATERAL (
    SELECT NULL::name AS col,
           coalesce(c.relacl, pg_catalog.acldefault(
               CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner)) AS acl
    UNION ALL
    SELECT at.attname, at.attacl FROM pg_catalog.pg_attribute at
    WHERE at.attrelid = c.oid AND at.attnum > 0 AND NOT at.attisdropped
      AND at.attacl IS NOT NULL) x
CROSS JOIN LATERAL pg_catalog.aclexplode(x.acl) a
JOIN grantee g ON g.oid = a.grantee
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON FUNCTION %s TO %s', a.privilege_type,
                                  p.oid::regprocedure, g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))) a
JOIN grantee g ON g.oid = a.grantee
WHERE n.nspname = 'memory'
   OR (n.nspname = 'public' AND p.proname IN ('memory_query', 'memory_optimize_query'))
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON SCHEMA memory TO %s', a.privilege_type, g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM pg_catalog.pg_namespace n
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a
JOIN grantee g ON g.oid = a.grantee
WHERE n.nspname = 'memory'
UNION ALL
SELECT 'grant', pg_catalog.format('%s ON DATABASE %I TO %s', a.privilege_type, d.datname, g.name),
       CASE WHEN a.is_grantable THEN 'granted with grant option' ELSE 'granted' END
FROM pg_catalog.pg_database d
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(d.datacl, pg_catalog.acldefault('d', d.datdba))) a
JOIN grantee g ON g.oid = a.grantee
WHERE d.datname = pg_catalog.current_database() AND a.privilege_type = 'CONNECT'
UNION ALL
SELECT 'default privilege',
       pg_catalog.format('%s on the %s %I creates%s: %s', a.privilege_type, k.kind, r.rolname,
                         CASE WHEN d.defaclnamespace = 0 THEN '' ELSE ' in schema memory' END,
                         g.name),
       'granted'
FROM creators r
CROSS JOIN (VALUES ('f'::"char", 'f'::"char", 'functions'), ('r', 'r', 'tables'),
                   ('S', 's', 'sequences'), ('T', 'T', 'types')) k(objtype, acltype, kind)
JOIN pg_catalog.pg_namespace m ON m.nspname = 'memory'
-- The global entry (or, without one, the built-in default), then the schema's additions.
CROSS JOIN LATERAL (
    SELECT 0::oid AS defaclnamespace,
           coalesce((SELECT d0.defaclacl FROM pg_catalog.pg_default_acl d0
                     WHERE d0.defaclrole = r.oid AND d0.defaclnamespace = 0
                       AND d0.defaclobjtype = k.objtype),
                    pg_catalog.acldefault(k.acltype, r.oid)) AS acl
    UNION ALL
    SELECT d1.defaclnamespace, d1.defaclacl FROM pg_catalog.pg_default_acl d1
    WHERE d1.defaclrole = r.oid AND d1.defaclnamespace = m.oid AND d1.defaclobjtype = k.objtype
) d
CROSS JOIN LATERAL pg_catalog.aclexplode(d.acl) a
JOIN grantee g ON g.oid = a.grantee
UNION ALL
SELECT 'config', 'memory.config ' || c.key, c.value FROM memory.config c
WHERE c.key IN ('plpython_path', 'plpython_checksum', 'plpython_deps', 'role_prefix');


-- name: current_role
SELECT current_user::text;

-- name: wrong_owners
-- The product's tables (migrations/ makes them), their partitions, and the functions sql/
-- defines (by name), where the owner is not schema memory's.
WITH s AS (
    SELECT n.oid, n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'memory'
), product AS (
    SELECT c.oid FROM pg_catalog.pg_class c JOIN s ON s.oid = c.relnamespace
    WHERE c.relkind IN ('r', 'p') AND c.relname = ANY (%(tables)s)
), rels AS (
    SELECT oid FROM product
    UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN product p ON p.oid = i.inhparent
)
SELECT 'TABLE', c.oid::regclass::text, pg_catalog.pg_get_userbyid(c.relowner)::text,
       pg_catalog.pg_get_userbyid(s.nspowner)::text
FROM rels r JOIN pg_catalog.pg_class c ON c.oid = r.oid CROSS JOIN s
WHERE c.relowner <> s.nspowner
UNION ALL
SELECT 'FUNCTION', p.oid::regprocedure::text, pg_catalog.pg_get_userbyid(p.proowner)::text,
       pg_catalog.pg_get_userbyid(s.nspowner)::text
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace CROSS JOIN s
WHERE n.nspname IN ('memory', 'public') AND p.proowner <> s.nspowner
  AND n.nspname || '.' || p.proname = ANY (%(functions)s)
ORDER BY 1, 2;

-- name: alter_owner
ALTER {kind} {name} OWNER TO {owner};

-- name: foreign_usable
-- Relations (not the product's tables, their partitions, or what depends on them: owned
-- sequences, indexes) and functions in schema memory on which PUBLIC or one of the product's
-- roles holds a privilege: (kind, name, who, owner, how it reads around
-- row-level security or NULL). The caller leaves out the functions sql/ made.
WITH grantee(oid, name) AS (
    SELECT 0::oid, 'PUBLIC'
    UNION ALL
    SELECT r.oid, r.rolname::text FROM pg_catalog.pg_roles r WHERE r.rolname = ANY (%(grantees)s)
), s AS (
    SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname = 'memory'
), product AS (
    SELECT c.oid FROM pg_catalog.pg_class c JOIN s ON s.oid = c.relnamespace
    WHERE c.relname = ANY (%(tables)s)
), mine AS (
    SELECT oid FROM product
    UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN product p ON p.oid = i.inhparent
    UNION SELECT d.objid FROM pg_catalog.pg_depend d JOIN product p ON p.oid = d.refobjid
          WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.deptype IN ('a', 'i')
), rels AS (
    SELECT c.oid, c.relkind, c.relacl, c.relowner, c.reloptions
    FROM pg_catalog.pg_class c JOIN s ON s.oid = c.relnamespace
    WHERE c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
      AND NOT EXISTS (SELECT 1 FROM mine WHERE mine.oid = c.oid)
), used AS (
    SELECT c.oid, pg_catalog.string_agg(DISTINCT g.name, ', ' ORDER BY g.name) AS users
    FROM rels c
    CROSS JOIN LATERAL (
        SELECT coalesce(c.relacl, pg_catalog.acldefault(
                   CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner)) AS acl
        UNION ALL
        SELECT a.attacl FROM pg_catalog.pg_attribute a
        WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
          AND a.attacl IS NOT NULL) x
    CROSS JOIN LATERAL pg_catalog.aclexplode(x.acl) e
    JOIN grantee g ON g.oid = e.grantee
    GROUP BY c.oid
)
SELECT CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                      WHEN 'S' THEN 'SEQUENCE' WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END,
       c.oid::regclass::text, u.users, pg_catalog.pg_get_userbyid(c.relowner)::text,
       -- A view reads its tables as its owner (unless security_invoker); a materialized
       -- view holds what its owner read.
       CASE WHEN c.relkind = 'm' OR NOT EXISTS (
                SELECT 1 FROM pg_catalog.unnest(c.reloptions) o
                WHERE o ~* '^security_invoker=(true|on|yes|1)$') THEN
           (SELECT 'reads ' || pg_catalog.string_agg(DISTINCT t.oid::regclass::text, ', ')
                   || ' (row-level security) as its owner, around row-level security'
            FROM pg_catalog.pg_rewrite w
            JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_rewrite'::regclass
                                       AND d.objid = w.oid
            JOIN pg_catalog.pg_class t ON t.oid = d.refobjid AND t.relrowsecurity
            WHERE w.ev_class = c.oid AND t.oid <> c.oid)
       END
FROM used u JOIN rels c ON c.oid = u.oid
UNION ALL
SELECT 'FUNCTION', p.oid::regprocedure::text,
       pg_catalog.string_agg(DISTINCT g.name, ', ' ORDER BY g.name),
       pg_catalog.pg_get_userbyid(p.proowner)::text,
       CASE WHEN p.prosecdef THEN 'SECURITY DEFINER: runs as its owner, around row-level security' END
FROM pg_catalog.pg_proc p JOIN s ON s.oid = p.pronamespace
CROSS JOIN LATERAL pg_catalog.aclexplode(
    coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))) e
JOIN grantee g ON g.oid = e.grantee
GROUP BY p.oid
ORDER BY 1, 2;
