-- Each role's grants as one row (issue 42): row-level security resolved the caller's
-- projects by reading a grant row per project, and every role's rows (pg_has_role on each),
-- about 30 times a query, so a role granted 1,000 projects paid for 1,000 and every reader
-- paid for other roles' grants. memory.grant_sets is derived from memory.project_grants and
-- memory.projects by their triggers (sql/085_tenants.sql) and rebuilt by every migrate.
CREATE TABLE memory.grant_sets (
    role_name   name PRIMARY KEY,
    read_names  text[] NOT NULL,
    write_names text[] NOT NULL,
    read_ids    integer[] NOT NULL,
    write_ids   integer[] NOT NULL
);
ALTER TABLE memory.grant_sets ENABLE ROW LEVEL SECURITY;

-- A project made or dropped refreshes the roles that name it: found by name.
CREATE INDEX project_grants_project ON memory.project_grants (project);
