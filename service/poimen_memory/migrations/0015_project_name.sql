-- A project's name as a type: memory.project_name, a domain over text whose CHECK is the
-- pattern of poimen_core/vocabulary.py (PROJECT_NAME). sql/005_catalog.sql keeps that CHECK
-- equal to the vocabulary on every migrate (it is written here as migration 0001 wrote the
-- column's CHECK, so every name already stored satisfies it); the SQL checks of a project
-- name (memory.grant_project) test a value by casting it to the domain.
CREATE DOMAIN memory.project_name AS text
    CONSTRAINT project_name_check CHECK (VALUE ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$');

-- The column's type cannot change under a policy that reads it: sql/085_tenants.sql, applied
-- after the migrations in the same transaction, makes them again. (Not DROP POLICY IF
-- EXISTS: its notice, when applied with 0008 before sql/ made them, would reach the report.)
DO $$
DECLARE
    pol name;
BEGIN
    FOR pol IN SELECT p.polname FROM pg_catalog.pg_policy p
               WHERE p.polrelid = 'memory.projects'::regclass LOOP
        EXECUTE pg_catalog.format('DROP POLICY %I ON memory.projects', pol);
    END LOOP;
END $$;

-- text to a domain over text is binary-coercible: no table rewrite and the UNIQUE index is
-- kept; the rows are checked against the domain once (a scan under ACCESS EXCLUSIVE).
ALTER TABLE memory.projects
    ALTER COLUMN name TYPE memory.project_name,
    DROP CONSTRAINT projects_name_check;
