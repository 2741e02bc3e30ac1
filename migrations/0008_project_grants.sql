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
