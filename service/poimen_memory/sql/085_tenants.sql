-- Tenants apart, enforced by PostgreSQL: row-level security on every table that holds
-- project data (migration 0008 enables it), driven by memory.project_grants.
--
-- A role sees the projects granted to it (or to a role whose privileges it has) with
-- memory.grant_project; '*' grants every project. The HTTP service's role (a member of
-- @role.service@) instead asserts, per transaction, the projects of the API key it is
-- serving: set_config('poimen.read_projects' / 'poimen.write_projects', 'a,b', true); while
-- it asserts any, it sees those alone, whatever is granted to it. Anyone can set those
-- settings; the policies honour them only for @role.service@ members, so a plain SQL user
-- gains nothing by it.
--
-- Every query function is SECURITY INVOKER, so the policies apply inside them and top-k
-- is computed over the visible rows only. The statistics and outbox triggers are SECURITY
-- DEFINER (the owner bypasses RLS): a writer who sees one project still keeps every
-- project's BM25 statistics exact. BM25 statistics are per project; a query over several
-- projects sums the statistics of the projects its caller can see, so nothing about a
-- hidden project reaches a score.

-- The names migrate renders for this database (service/poimen_memory/db/roles.py), for
-- DBAs and tests to read rather than spell.
CREATE OR REPLACE FUNCTION memory.roles(OUT reader name, OUT writer name, OUT service name)
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT '@role.reader@'::name, '@role.writer@'::name, '@role.service@'::name $$;
COMMENT ON FUNCTION memory.roles() IS
    'This database''s own roles: reader (the query functions and the tables they read), writer (a reader that may write content) and service (the HTTP service''s writer). Roles are the cluster''s, so each product database has its own three (<prefix>_memory_reader, _writer, _service; the prefix chosen at the first migrate: POIMEN_ROLE_PREFIX or the database''s name).';

-- Whether the caller is the service asserting projects: a member of @role.service@ with
-- poimen.read_projects (write: poimen.write_projects) set. By oid: pg_has_role with the
-- name raises when the role does not exist (a restore without globals), and every policy
-- would then fail. No role: no member. An empty setting asserts nothing: the service's
-- grants then apply (none), so a path that forgets to assert sees nothing.
-- Inlined (migrate.INLINED: no SET clause, everything named by schema): every row-level
-- security check (memory._granted_ids, once per statement and table, 20 to 30 times an
-- answer) asks it once or twice, and as a call with a SET clause each asking cost more
-- than the test (issue 42).
CREATE OR REPLACE FUNCTION memory._asserting(write boolean DEFAULT false)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT coalesce(pg_catalog.current_setting(CASE WHEN write THEN 'poimen.write_projects'
                                                ELSE 'poimen.read_projects' END, true), '')
           OPERATOR(pg_catalog.<>) ''
       AND coalesce(pg_catalog.pg_has_role(CURRENT_USER, pg_catalog.to_regrole('@role.service@'),
                                           'MEMBER'), false)
$$;
COMMENT ON FUNCTION memory._asserting(boolean) IS
    'Whether the current user is a member of @role.service@ asserting projects in poimen.read_projects (write => true: poimen.write_projects): then those projects alone apply, not the grants.';

-- plpgsql, not sql: its body is not resolved at creation, so the sql/ files still apply
-- over a schema migrated only up to an earlier version (before memory.project_grants).
CREATE OR REPLACE FUNCTION memory.granted_projects(write boolean DEFAULT false)
RETURNS text[]
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    asserted text[];
BEGIN
    -- The service asserting projects (the API key's, or '*' in anonymous mode) sees those
    -- and no others: a key is the tenant, so a grant made to the service's own role does
    -- not widen every key. Every policy reaches this function once per statement and table
    -- (memory._granted_ids), dozens of times a query, so the service's path reads no table.
    IF memory._asserting(write) THEN
        asserted := string_to_array(current_setting(
            CASE WHEN write THEN 'poimen.write_projects' ELSE 'poimen.read_projects' END, true), ',');
        RETURN CASE WHEN cardinality(asserted) = 1 THEN asserted
                    ELSE ARRAY(SELECT DISTINCT g.project FROM unnest(asserted) AS g(project)
                               ORDER BY g.project) END;
    END IF;
    RETURN (SELECT g.names FROM memory._role_grants(write) g);
END $$;
COMMENT ON FUNCTION memory.granted_projects(boolean) IS
    'Names of the projects the current user may read (write => true: write); ''*'' means every project. For a member of @role.service@ that asserts projects in the transaction''s poimen.read_projects / poimen.write_projects settings (the HTTP service: its API key''s, or ''*'' in anonymous mode), those projects alone; otherwise memory.project_grants for the user''s roles.';

-- One row per role (memory.grant_sets), not one per granted project: what a policy reads
-- of the grants does not grow with the projects a role may see, and other roles' rows cost
-- a membership test each, not one per grant (issue 42).
CREATE OR REPLACE FUNCTION memory._role_grants(write boolean DEFAULT false,
                                               OUT names text[], OUT ids integer[])
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- memory.projects' policy calls this inside memory.project_id, which turns sequential scans
-- off; planned so, the scan of these few rows cost 10^10, which started JIT: 300 ms a call,
-- every query of a role (the service's path reads no table and never paid it).
SET enable_seqscan = on
AS $$
DECLARE
    r record;
    many boolean := false;
BEGIN
    -- memory.grant_sets shows each role only its own row (policy below); the test is
    -- repeated here because the owner bypasses the policy. A dropped role grants nothing:
    -- to_regrole gives NULL, and so does pg_has_role. Not a join with pg_roles: that view's
    -- plan read pg_authid whole at every call.
    FOR r IN SELECT CASE WHEN write THEN s.write_names ELSE s.read_names END AS n,
                    CASE WHEN write THEN s.write_ids ELSE s.read_ids END AS i
             FROM memory.grant_sets s
             WHERE pg_catalog.pg_has_role(current_user,
                       pg_catalog.to_regrole(pg_catalog.quote_ident(s.role_name)), 'USAGE') LOOP
        IF names IS NULL THEN
            names := r.n;
            ids := r.i;
        ELSE
            names := names || r.n;
            ids := ids || r.i;
            many := true;
        END IF;
    END LOOP;
    -- Each row's arrays are sorted and distinct already; only a union needs doing again.
    IF many THEN
        names := ARRAY(SELECT DISTINCT x FROM unnest(names) x ORDER BY x);
        ids := ARRAY(SELECT DISTINCT x FROM unnest(ids) x ORDER BY x);
    END IF;
    names := coalesce(names, '{}');
    ids := coalesce(ids, '{}');
END $$;
COMMENT ON FUNCTION memory._role_grants(boolean) IS
    'The project names memory.project_grants gives the current user''s roles (write => true: for writing), and the ids of those that exist (none for ''*''), read from memory.grant_sets: one row per role, whatever the number of projects.';

-- The ids of the projects the service asserts by name. SECURITY DEFINER, so that the lookup
-- skips memory.projects' own policy (two more InitPlans and their calls: 57 against 6 us a
-- lookup); it returns no more than that policy would, since the service asserting names sees
-- exactly those projects. Only the owner and the service's role may run it: to any other
-- caller it would tell which project names exist.
CREATE OR REPLACE FUNCTION memory._asserted_project_ids(names text[])
RETURNS integer[]
LANGUAGE plpgsql STABLE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- One plan a session whatever the caller's mode: an answer's stages run under generic
-- plans on one table, the partitioned layout under custom ones, planned at every call
-- (64-85 us here, 15-20 with its own plan).
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- The few names of a request: one probe of the unique index each. "name = ANY (names)"
    -- planned without the names (a generic plan) was a sequential scan that compared every
    -- project with them: 169 us a call at 1,000 projects, against 15 now, and 10-19 calls
    -- an answer (every policy's InitPlan; docs/benchmarks.md, "Two tenant checks that grew
    -- with the tenants").
    IF cardinality(names) <= 64 THEN
        RETURN array_remove(ARRAY(SELECT DISTINCT (SELECT p.id FROM memory.projects p
                                                   WHERE p.name::text = n.name)
                                  FROM unnest(names) AS n(name) ORDER BY 1), NULL);
    END IF;
    -- A key's every name (listing its projects, or its nodes without naming one, asserts
    -- them all): past a few dozen names, one pass over the projects joined with the names
    -- costs less than a probe a name.
    RETURN ARRAY(SELECT DISTINCT p.id FROM unnest(names) AS n(name)
                 JOIN memory.projects p ON p.name::text = n.name ORDER BY 1);
END $$;
COMMENT ON FUNCTION memory._asserted_project_ids(text[]) IS
    'The ids of the named projects that exist, ascending, read past memory.projects'' row-level security: memory._granted_ids'' lookup of the names the service (a member of @role.service@) asserts, which it may see. The owner''s and the service role''s only.';

CREATE OR REPLACE FUNCTION memory._granted_ids(write boolean DEFAULT false)
RETURNS integer[]
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    asserted text := current_setting(CASE WHEN write THEN 'poimen.write_projects'
                                          ELSE 'poimen.read_projects' END, true);
    every boolean;
    names text[];
    role_ids integer[];
    read_ids integer[];
    ids integer[];
BEGIN
    -- What each row-level security policy compares a row's project with, as one InitPlan
    -- (NULL: every project, and the policy passes the row on that alone). A query runs it
    -- once per statement and table it reads, 20 to 30 times, so it reads one row per role
    -- (memory.grant_sets), or the service's asserted names (which a request keeps to the
    -- projects it names: service/poimen_memory/db/tenant.py).
    IF memory._asserting(write) THEN
        -- The service asserting projects: its names, read once (this is the service's
        -- every statement, and each nested call costs its own SET clause).
        names := string_to_array(asserted, ',');
    ELSE
        SELECT g.names, g.ids INTO names, role_ids FROM memory._role_grants(write) g;
    END IF;
    every := '*' = ANY (names);
    -- Writing a project also needs reading it: what the caller reads, where it can
    -- narrow what it writes (not for a role's own grants, which hold it row by row).
    IF write AND (every OR role_ids IS NULL OR memory._asserting(false)) THEN
        read_ids := memory._granted_ids(false);
    END IF;
    IF every AND (NOT write OR read_ids IS NULL) THEN
        RETURN NULL;
    END IF;
    -- memory.projects is itself filtered by the read grants (its policy), so reading needs
    -- no second look at them.
    IF every THEN
        RETURN ARRAY(SELECT p.id FROM memory.projects p ORDER BY p.id);
    END IF;
    -- A role's grants carry their ids. Writing also needs reading, which for a role's own
    -- grants holds row by row, but the service may assert what it reads and not what it
    -- writes: then its role's write grants count only where the asserted reads reach.
    IF role_ids IS NOT NULL THEN
        IF write AND memory._asserting(false) THEN
            RETURN ARRAY(SELECT x FROM (SELECT unnest(role_ids) INTERSECT SELECT unnest(read_ids)) AS i(x)
                         ORDER BY x);
        END IF;
        RETURN role_ids;
    END IF;
    -- The service's names, looked up by name (memory.projects' unique index) past that
    -- table's policy; for writing, only where its reads reach, as that policy would keep.
    ids := memory._asserted_project_ids(names);
    IF write AND read_ids IS NOT NULL THEN
        RETURN ARRAY(SELECT x FROM unnest(ids) AS i(x) WHERE x = ANY (read_ids) ORDER BY x);
    END IF;
    RETURN ids;
END
$$;
COMMENT ON FUNCTION memory._granted_ids(boolean) IS
    'The ids of the projects the current user may read (write => true: write, which also needs reading), or NULL when that is every project: the one InitPlan of each row-level security policy, coalesce(project_id = ANY (...), true).';

CREATE OR REPLACE FUNCTION memory.granted_project_ids(write boolean DEFAULT false)
RETURNS integer[]
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN coalesce(memory._granted_ids(write),
                    ARRAY(SELECT p.id FROM memory.projects p ORDER BY p.id));
END
$$;
COMMENT ON FUNCTION memory.granted_project_ids(boolean) IS
    'Ids of the projects memory.granted_projects(write) names (writing also needs reading), every project''s when it names ''*'': memory._granted_ids, with the NULL of "every project" spelled out.';

CREATE OR REPLACE FUNCTION memory._asserted_all(write boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- The service asserting every project (anonymous mode) is told by one setting and one
    -- membership, without reading the grants table.
    RETURN memory._asserting(write)
           AND current_setting(CASE WHEN write THEN 'poimen.write_projects'
                                    ELSE 'poimen.read_projects' END, true) = '*';
END $$;
COMMENT ON FUNCTION memory._asserted_all(boolean) IS
    'Whether the service (a member of @role.service@) asserts every project (''*'') in poimen.read_projects (write: poimen.write_projects): the first, cheap half of memory.granted_all, which memory.projects'' policy tests before reading the grants.';

-- The service's asserted projects as ids, for the functions that keep to them beside
-- row-level security: a service connected as a role that bypasses it (a superuser, which
-- `serve` allows with a warning) would otherwise let a key see another project's rows.
CREATE OR REPLACE FUNCTION memory._asserted_ids(write boolean DEFAULT false)
RETURNS integer[]
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT memory._asserting(write) THEN
        RETURN NULL;
    END IF;
    RETURN memory._granted_ids(write);
END $$;
COMMENT ON FUNCTION memory._asserted_ids(boolean) IS
    'The ids of the projects the service asserts (poimen.read_projects; write => true: poimen.write_projects), or NULL when it asserts none or every one (''*''): what a function filters by beside row-level security, which a superuser or BYPASSRLS connection skips.';

CREATE OR REPLACE FUNCTION memory.granted_all(write boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory._asserted_all(write) OR '*' = ANY (memory.granted_projects(write));
END $$;
COMMENT ON FUNCTION memory.granted_all(boolean) IS
    'Whether memory.granted_projects(write) grants every project (''*''): the row-level security policies test it once per statement before comparing a row''s project.';

CREATE OR REPLACE FUNCTION memory.grant_project(role regrole, project text, write boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL OR project IS NULL OR write IS NULL THEN
        RAISE EXCEPTION 'role, project and write must not be NULL' USING ERRCODE = '22023';
    END IF;
    IF project <> '*' THEN
        BEGIN
            PERFORM project::memory.project_name;  -- the domain's CHECK (migration 0015)
        EXCEPTION WHEN check_violation THEN
            RAISE EXCEPTION 'invalid project name "%"', project
                USING ERRCODE = '22023',
                      DETAIL = 'A project name matches ' || @vocabulary.project_name_pattern@
                               || ', or is * for every project.',
                      HINT = 'The project need not exist yet: the grant applies once it does.';
        END;
    END IF;
    INSERT INTO memory.project_grants AS g (role_name, project, can_write)
    VALUES ((SELECT r.rolname FROM pg_catalog.pg_roles r WHERE r.oid = role::oid), project, write)
    ON CONFLICT ON CONSTRAINT project_grants_pkey
        DO UPDATE SET can_write = EXCLUDED.can_write, granted_at = now();
END $$;
COMMENT ON FUNCTION memory.grant_project(regrole, text, boolean) IS
    'Lets a role (and every role that has its privileges) read one project, or every project with ''*''; write => true also lets it insert, update and delete the project''s nodes and edges. Re-granting replaces the write flag. Row access only: the role still needs @role.reader@ or @role.writer@ for the functions and tables.';

CREATE OR REPLACE FUNCTION memory.revoke_project(role regrole, project text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE removed integer;
BEGIN
    DELETE FROM memory.project_grants g
    WHERE g.role_name = (SELECT r.rolname FROM pg_catalog.pg_roles r WHERE r.oid = role::oid)
      AND g.project = revoke_project.project;
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed > 0;
END $$;
COMMENT ON FUNCTION memory.revoke_project(regrole, text) IS
    'Removes a grant made by memory.grant_project; true when there was one. Revoke a role''s grants before dropping the role: grants are kept by role name, so a new role of the same name would inherit them.';

-- memory.grant_sets follows memory.project_grants and memory.projects: each change
-- rebuilds the rows of the roles it touches, from the two tables as they then are.
-- Grant changes and project creations on the same names are made to wait for each other
-- (advisory locks on 64 buckets of names: a grant change takes its buckets exclusively, a
-- project made or dropped shares them), so a grant of a project being made at the same
-- moment is not left without its id; under READ COMMITTED each statement below then sees
-- what the other committed. Two rebuilds of one role lock its row. SECURITY DEFINER: the
-- rows are the owner's to write, and a writer making a project refreshes them.
CREATE OR REPLACE FUNCTION memory._refresh_grant_sets(roles name[], projects text[], exclusive boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b integer;
BEGIN
    IF to_regclass('memory.grant_sets') IS NULL THEN
        RETURN;  -- before migration 0027
    END IF;
    FOR b IN SELECT DISTINCT pg_catalog.abs(pg_catalog.hashtext(x) % 64)
             FROM unnest(coalesce(projects, '{}'::text[])) x ORDER BY 1 LOOP
        IF exclusive THEN
            PERFORM pg_catalog.pg_advisory_xact_lock(@vocabulary.lock_grant_sets@, b);
        ELSE
            PERFORM pg_catalog.pg_advisory_xact_lock_shared(@vocabulary.lock_grant_sets@, b);
        END IF;
    END LOOP;
    -- The roles that name the projects (a project made or dropped), or every role with a
    -- row or a grant (NULL: migrate's rebuild, which also mends a row edited by hand).
    IF roles IS NULL THEN
        roles := ARRAY(SELECT g.role_name FROM memory.project_grants g
                       WHERE projects IS NULL OR g.project = ANY (projects)
                       UNION SELECT s.role_name FROM memory.grant_sets s WHERE projects IS NULL);
    END IF;
    IF cardinality(roles) = 0 THEN
        RETURN;
    END IF;
    INSERT INTO memory.grant_sets AS s (role_name, read_names, write_names, read_ids, write_ids)
    SELECT r, '{}', '{}', '{}', '{}' FROM unnest(roles) r ON CONFLICT (role_name) DO NOTHING;
    PERFORM 1 FROM memory.grant_sets s WHERE s.role_name = ANY (roles) ORDER BY s.role_name
        FOR UPDATE;
    UPDATE memory.grant_sets s
    SET read_names = c.read_names, write_names = c.write_names,
        read_ids = c.read_ids, write_ids = c.write_ids
    FROM (SELECT g.role_name,
                 array_agg(g.project ORDER BY g.project) AS read_names,
                 coalesce(array_agg(g.project ORDER BY g.project) FILTER (WHERE g.can_write), '{}') AS write_names,
                 coalesce(array_agg(p.id ORDER BY p.id) FILTER (WHERE p.id IS NOT NULL), '{}') AS read_ids,
                 coalesce(array_agg(p.id ORDER BY p.id) FILTER (WHERE p.id IS NOT NULL AND g.can_write), '{}') AS write_ids
          FROM memory.project_grants g
          LEFT JOIN memory.projects p ON p.name::text = g.project
          WHERE g.role_name = ANY (roles)
          GROUP BY g.role_name) c
    WHERE s.role_name = c.role_name
      AND (s.read_names, s.write_names, s.read_ids, s.write_ids)
          IS DISTINCT FROM (c.read_names, c.write_names, c.read_ids, c.write_ids);
    DELETE FROM memory.grant_sets s
    WHERE s.role_name = ANY (roles)
      AND NOT EXISTS (SELECT 1 FROM memory.project_grants g WHERE g.role_name = s.role_name);
END $$;
COMMENT ON FUNCTION memory._refresh_grant_sets(name[], text[], boolean) IS
    'Rebuilds the memory.grant_sets rows of roles (NULL: of the roles granted one of projects; both NULL: of every role) from memory.project_grants and memory.projects, after waiting for any concurrent change to the grants of the same project names (exclusive => true for a grant change, false for a project made or dropped).';

CREATE OR REPLACE FUNCTION memory._grants_changed()
RETURNS trigger
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM memory.grant_sets;
    ELSIF TG_OP = 'INSERT' THEN
        PERFORM memory._refresh_grant_sets(ARRAY(SELECT DISTINCT n.role_name FROM new_rows n),
                                           ARRAY(SELECT DISTINCT n.project FROM new_rows n), true);
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM memory._refresh_grant_sets(ARRAY(SELECT DISTINCT o.role_name FROM old_rows o),
                                           ARRAY(SELECT DISTINCT o.project FROM old_rows o), true);
    ELSE
        PERFORM memory._refresh_grant_sets(
            ARRAY(SELECT n.role_name FROM new_rows n UNION SELECT o.role_name FROM old_rows o),
            ARRAY(SELECT n.project FROM new_rows n UNION SELECT o.project FROM old_rows o), true);
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION memory._grants_changed() IS
    'Statement trigger on memory.project_grants: rebuilds the memory.grant_sets rows of the roles a change touched.';

CREATE OR REPLACE FUNCTION memory._projects_changed()
RETURNS trigger
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM memory._refresh_grant_sets(NULL, NULL, true);
    ELSIF TG_OP = 'INSERT' THEN
        PERFORM memory._refresh_grant_sets(NULL, ARRAY(SELECT n.name::text FROM new_rows n), false);
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM memory._refresh_grant_sets(NULL, ARRAY(SELECT o.name::text FROM old_rows o), false);
    ELSE
        PERFORM memory._refresh_grant_sets(
            NULL, ARRAY(SELECT n.name::text FROM new_rows n UNION SELECT o.name::text FROM old_rows o), false);
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION memory._projects_changed() IS
    'Statement trigger on memory.projects: a project made, renamed or dropped rebuilds the memory.grant_sets rows of the roles granted it by name (their ids).';

DO $$
BEGIN
    IF to_regclass('memory.grant_sets') IS NULL THEN
        RETURN;  -- before migration 0027
    END IF;
    PERFORM memory._ensure_statement_triggers('memory.project_grants', 'project_grants_sets',
                                              'memory._grants_changed');
    PERFORM memory._ensure_trigger('memory.project_grants', 'project_grants_sets_truncate',
        'CREATE TRIGGER project_grants_sets_truncate AFTER TRUNCATE ON memory.project_grants FOR EACH STATEMENT EXECUTE FUNCTION memory._grants_changed()');
    PERFORM memory._ensure_statement_triggers('memory.projects', 'projects_grant_sets',
                                              'memory._projects_changed');
    PERFORM memory._ensure_trigger('memory.projects', 'projects_grant_sets_truncate',
        'CREATE TRIGGER projects_grant_sets_truncate AFTER TRUNCATE ON memory.projects FOR EACH STATEMENT EXECUTE FUNCTION memory._projects_changed()');
    -- Every migrate rebuilds the rows: a restore, or a row edited by hand, comes out right.
    PERFORM memory._refresh_grant_sets(NULL, NULL, true);
END $$;

-- A scratch copy of a table's columns, for this transaction only: the policies (here) and
-- indexes (sql/088_indexes.sql) sql/ wants are made on it first, so what PostgreSQL stores
-- for them can be compared with what the real table has before anything there is touched.
CREATE OR REPLACE FUNCTION memory._probe(tbl regclass)
RETURNS regclass
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    probe text := 'pg_temp.' || pg_catalog.quote_ident(
        'poimen_probe_' || (SELECT c.relname FROM pg_catalog.pg_class c WHERE c.oid = tbl));
BEGIN
    IF pg_catalog.to_regclass(probe) IS NULL THEN
        EXECUTE pg_catalog.format('CREATE TEMP TABLE %s (LIKE %s) ON COMMIT DROP', probe, tbl);
    END IF;
    RETURN probe::regclass;
END $$;
COMMENT ON FUNCTION memory._probe(regclass) IS
    'A temporary table with the columns of tbl (dropped at commit), on which migrate builds the policies and indexes sql/ wants in order to compare them with the real ones.';

-- Row-level security on, and exactly the policies below on the tables that hold project
-- data: a policy sql/ does not make (a DBA's "FOR SELECT USING (true)" would open every
-- project: permissive policies are OR-ed) is dropped, a changed one re-created. Each policy
-- is compared first, on a probe table: CREATE and DROP POLICY lock the table ACCESS
-- EXCLUSIVE, so a deploy that changes nothing must not run them. The (SELECT ...) around
-- each helper makes it an InitPlan, computed once per statement rather than once per row.
DO $$
DECLARE
    pol record;
    t text;
    w text[];
    rel regclass;
    probe regclass;
    -- A caller granted every project ('*', the service in anonymous mode) passes on the
    -- first, once-per-statement test: otherwise every row would be compared with the ids of
    -- every project, and a query's cost would grow with the number of projects.
    -- memory._granted_ids is NULL for every project, so `project_id = ANY (NULL)` is NULL
    -- and the coalesce passes the row.
    readable text := 'COALESCE(project_id = ANY ((SELECT memory._granted_ids(false))::integer[]), true)';
    -- Writing a project also needs reading it, as memory._granted_ids(true) says.
    writable text := 'COALESCE(project_id = ANY ((SELECT memory._granted_ids(true))::integer[]), true)';
    -- Every table that holds project data (migration 0008 turned row-level security on).
    tables text[] := ARRAY['project_grants', 'grant_sets', 'projects', 'nodes', 'edges', 'postings',
                           'term_stats', 'corpus_stats', 'opensearch_outbox', 'review_queue',
                           'retention'];
    wanted text[] := '{}';  -- (table, policy, clause) rows
    notes text[] := ARRAY[
        'role_name', 'the grantee, by name (kept across pg_dump/pg_restore); every role that has its privileges inherits the grant',
        'project', 'project name, or * for every project (the name need not exist yet)',
        'can_write', 'the role may also insert, update and delete the project''s nodes and edges',
        'granted_at', 'when the grant was made or last changed'];
    note text := 'Which roles may read (and write) which projects, enforced by row-level security on every table holding project data. Managed with memory.grant_project / memory.revoke_project; each role sees only its own rows.';
BEGIN
    IF to_regclass('memory.project_grants') IS NULL THEN
        RETURN;  -- migration 0008 not applied yet
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = 'memory.edges'::regclass AND a.attname = 'project_id') THEN
        -- 0008 without 0009: only a deploy that stops between them (tests apply one
        -- migration per deploy); the policies below need edges.project_id.
        RETURN;
    END IF;
    IF to_regclass('memory.review_queue') IS NULL THEN
        tables := array_remove(tables, 'review_queue');  -- before migration 0019
    END IF;
    -- memory.retention comes with migration 0021: not before (tests apply one migration
    -- per deploy).
    IF to_regclass('memory.retention') IS NULL THEN
        tables := array_remove(tables, 'retention');
    END IF;
    IF to_regclass('memory.grant_sets') IS NULL THEN
        tables := array_remove(tables, 'grant_sets');  -- before migration 0027
    END IF;
    FOREACH t IN ARRAY tables LOOP
        IF NOT (SELECT c.relrowsecurity FROM pg_catalog.pg_class c
                WHERE c.oid = pg_catalog.format('memory.%I', t)::regclass) THEN
            EXECUTE pg_catalog.format('ALTER TABLE memory.%I ENABLE ROW LEVEL SECURITY', t);
        END IF;
    END LOOP;
    -- FORCE off, and held: the policies bind the product's roles, never the owner, whose
    -- SECURITY DEFINER functions (the statistics and outbox triggers, grant_project, the
    -- partitions' upkeep) act on every project's rows; forced, they would see only the
    -- projects granted to the owner and the statistics would drift. Partitions too.
    FOR rel IN
        SELECT c.oid::regclass FROM pg_catalog.pg_class c
        WHERE c.relforcerowsecurity
          AND (c.oid = ANY (SELECT pg_catalog.to_regclass(pg_catalog.format('memory.%I', x))
                            FROM pg_catalog.unnest(tables) x)
               OR c.oid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i
                            WHERE i.inhparent = ANY (
                                SELECT pg_catalog.to_regclass(pg_catalog.format('memory.%I', x))
                                FROM pg_catalog.unnest(tables) x)))
    LOOP
        EXECUTE pg_catalog.format('ALTER TABLE %s NO FORCE ROW LEVEL SECURITY', rel);
    END LOOP;

    wanted := ARRAY[
        -- By to_regrole (NULL for a dropped role, and pg_has_role of NULL is NULL): an
        -- EXISTS over pg_roles was planned as a scan of pg_authid at every statement that
        -- read the grants, and every policy reads them (memory.granted_projects).
        ['project_grants', 'own_grants', 'FOR SELECT USING (pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole(pg_catalog.quote_ident(role_name)), ''USAGE''))'],
        ['grant_sets', 'own_grants', 'FOR SELECT USING (pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole(pg_catalog.quote_ident(role_name)), ''USAGE''))'],
        -- Anonymous mode passes on the setting alone (memory._asserted_all): every query looks
        -- its project up by name several times, and memory.granted_projects reads the grants
        -- each time. Not memory.granted_all, which with a key would read them twice.
        ['projects', 'granted_read', 'FOR SELECT USING ((SELECT memory._asserted_all(false)) OR (SELECT memory.granted_projects(false)) && ARRAY[name::text, ''*''])'],
        ['projects', 'granted_insert', 'FOR INSERT WITH CHECK ((SELECT memory.granted_projects(true)) && ARRAY[name, ''*''])'],
        ['projects', 'granted_delete', 'FOR DELETE USING ((SELECT memory.granted_projects(true)) && ARRAY[name, ''*''])'],
        -- The outbox names nodes of every project, deleted ones included: only a role
        -- granted every project (the service's drain asserts '*') sees or changes it.
        ['opensearch_outbox', 'all_projects', 'USING (''*'' = ANY ((SELECT memory.granted_projects(false))::text[])) WITH CHECK (''*'' = ANY ((SELECT memory.granted_projects(true))::text[]))']];
    -- One rule for every table that holds a project's rows: a row is seen in the projects
    -- granted for reading, written in those granted for writing. Edges obey it too: an
    -- edge stays within one project (its foreign keys carry the project, migration 0009).
    -- The statistics are written by the owner's triggers only, so they get no write policy.
    -- A project's retention (migration 0021) is its data too: read and set as its nodes;
    -- so is its review queue (migration 0019), worked by its writers.
    FOREACH t IN ARRAY ARRAY['nodes', 'edges', 'postings', 'term_stats', 'corpus_stats',
                             'review_queue', 'retention'] LOOP
        CONTINUE WHEN NOT t = ANY (tables);
        wanted := wanted || ARRAY[[t, 'granted_read', pg_catalog.format('FOR SELECT USING (%s)', readable)]];
        CONTINUE WHEN t NOT IN ('nodes', 'edges', 'review_queue', 'retention');
        wanted := wanted || ARRAY[
            [t, 'granted_insert', pg_catalog.format('FOR INSERT WITH CHECK (%s)', writable)],
            [t, 'granted_update', pg_catalog.format('FOR UPDATE USING (%s) WITH CHECK (%s)', writable, writable)],
            [t, 'granted_delete', pg_catalog.format('FOR DELETE USING (%s)', writable)]];
    END LOOP;

    FOR pol IN SELECT p.polname, p.polrelid FROM pg_catalog.pg_policy p
               JOIN pg_catalog.pg_class c ON c.oid = p.polrelid
               WHERE c.relnamespace = 'memory'::regnamespace AND c.relname = ANY (tables)
                 AND NOT EXISTS (SELECT 1 FROM generate_subscripts(wanted, 1) i
                                 WHERE wanted[i][1] = c.relname AND wanted[i][2] = p.polname) LOOP
        EXECUTE pg_catalog.format('DROP POLICY %I ON %s', pol.polname, pol.polrelid::regclass);
    END LOOP;
    FOREACH w SLICE 1 IN ARRAY wanted LOOP
        CONTINUE WHEN NOT w[1] = ANY (tables);  -- a table a later migration makes
        rel := pg_catalog.format('memory.%I', w[1])::regclass;
        probe := memory._probe(rel);
        EXECUTE pg_catalog.format('CREATE POLICY %I ON %s %s', w[2], probe, w[3]);
        -- A column of the table inside a subquery is printed qualified by the table's name.
        CONTINUE WHEN (SELECT ROW(p.polcmd, p.polpermissive, p.polroles,
                                  pg_catalog.replace(pg_catalog.pg_get_expr(p.polqual, p.polrelid),
                                                     'poimen_probe_' || w[1] || '.', w[1] || '.'),
                                  pg_catalog.replace(pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid),
                                                     'poimen_probe_' || w[1] || '.', w[1] || '.'))
                       FROM pg_catalog.pg_policy p WHERE p.polrelid = probe AND p.polname = w[2])
                      IS NOT DISTINCT FROM
                      (SELECT ROW(p.polcmd, p.polpermissive, p.polroles,
                                  pg_catalog.pg_get_expr(p.polqual, p.polrelid),
                                  pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid))
                       FROM pg_catalog.pg_policy p WHERE p.polrelid = rel AND p.polname = w[2]);
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_policy p WHERE p.polrelid = rel AND p.polname = w[2]) THEN
            EXECUTE pg_catalog.format('DROP POLICY %I ON %s', w[2], rel);
        END IF;
        EXECUTE pg_catalog.format('CREATE POLICY %I ON %s %s', w[2], rel, w[3]);
    END LOOP;

    -- COMMENT locks the table SHARE UPDATE EXCLUSIVE: only when the text changed.
    IF pg_catalog.obj_description('memory.project_grants'::regclass, 'pg_class') IS DISTINCT FROM note THEN
        EXECUTE pg_catalog.format('COMMENT ON TABLE memory.project_grants IS %L', note);
    END IF;
    FOR i IN 1 .. pg_catalog.array_length(notes, 1) BY 2 LOOP
        IF pg_catalog.col_description('memory.project_grants'::regclass,
               (SELECT a.attnum FROM pg_catalog.pg_attribute a
                WHERE a.attrelid = 'memory.project_grants'::regclass AND a.attname = notes[i]))
           IS DISTINCT FROM notes[i + 1] THEN
            EXECUTE pg_catalog.format('COMMENT ON COLUMN memory.project_grants.%I IS %L',
                                      notes[i], notes[i + 1]);
        END IF;
    END LOOP;
END $$;
