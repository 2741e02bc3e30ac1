-- Tenants apart in Postgres: which roles may read (and write) which projects, and
-- row-level security on every table that holds project data. The policies and the
-- functions they call live in sql/085_tenants.sql (re-applied on every migrate).
-- Owners and superusers bypass RLS; every other role sees no project until
-- memory.grant_project names it ('*' = every project).
-- Roles are kept by name, not oid: pg_dump/pg_restore into another cluster (roles made
-- first, by name) must keep the grants, and an oid there may belong to another role.
CREATE TABLE memory.project_grants (
    role_name name NOT NULL,
    project   text NOT NULL
              CHECK (project = '*' OR project ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$'),
    can_write boolean NOT NULL DEFAULT false,
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role_name, project)
);

ALTER TABLE memory.project_grants ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.projects ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.nodes ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.edges ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.postings ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.term_stats ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.corpus_stats ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory.opensearch_outbox ENABLE ROW LEVEL SECURITY;

-- Until now a member of memory_reader or memory_writer saw every project; from here on it
-- sees none until granted one, and its queries return no rows without an error. Name those
-- roles to whoever migrates (`poimen-memory migrate` prints this notice). The table above is
-- new, so none of them has a grant yet. Not listed: the product's own group roles, members of
-- memory_service (the service asserts its caller's projects), and roles RLS does not apply
-- to (superusers, BYPASSRLS, the owner). On a fresh database the roles do not exist yet
-- (sql/900_grants.sql makes them): to_regrole gives NULL and nobody is listed.
DO $$
DECLARE
    ungranted text;
BEGIN
    SELECT string_agg(quote_ident(r.rolname), ', ' ORDER BY r.rolname) INTO ungranted
    FROM pg_catalog.pg_roles r
    WHERE r.rolname NOT IN ('memory_reader', 'memory_writer', 'memory_service')
      AND NOT r.rolsuper AND NOT r.rolbypassrls
      AND coalesce(pg_catalog.pg_has_role(r.oid, pg_catalog.to_regrole('memory_reader'), 'MEMBER')
                   OR pg_catalog.pg_has_role(r.oid, pg_catalog.to_regrole('memory_writer'), 'MEMBER'),
                   false)
      AND NOT coalesce(pg_catalog.pg_has_role(r.oid, pg_catalog.to_regrole('memory_service'), 'MEMBER'),
                       false)
      AND NOT pg_catalog.pg_has_role(r.oid, (SELECT c.relowner FROM pg_catalog.pg_class c
                                             WHERE c.oid = 'memory.nodes'::regclass), 'USAGE');
    IF ungranted IS NOT NULL THEN
        RAISE NOTICE 'row-level security is on: these roles now see no project until one is granted: %', ungranted
            USING DETAIL = 'They are members of memory_reader or memory_writer with no row in memory.project_grants: their queries now return no rows, without an error.',
                  HINT = 'For each: SELECT memory.grant_project(''role'', ''project'') (''*'' = every project; write => true to write). See docs/security.md.';
    END IF;
END $$;
