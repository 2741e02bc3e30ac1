-- The capability report (issue 27): what this database has of what poimen-memory uses,
-- and, for each capability that is off, why and what it costs. `poimen-memory doctor` is
-- a thin CLI over it. The names, which are required and the costs are poimen_core's
-- vocabulary (CAPABILITIES), which docs/managed-postgres.md shows: one definition.
--
-- Written so that it also runs where schema memory does not exist (`poimen-memory doctor`
-- creates this same function in pg_temp there): it names nothing of the schema before it
-- has checked that it is there, and needs neither pgvector nor PL/Python.
--
-- Granted to the reader role: everything it reports a reader can already read (pg_extension,
-- pg_class, pg_roles, memory.config, memory.schema_migrations) or run (memory.embed,
-- memory.optimize_query), and what it runs is what a reader may run anyway: the embedder
-- probe loads the model in the calling backend (about 1 s and 180 MB, once per backend).
CREATE OR REPLACE FUNCTION memory.capabilities()
RETURNS TABLE (name text, required boolean, status text, detail text, cost text)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    facts constant jsonb := @vocabulary.capabilities@;
    probes jsonb := '{}';  -- name -> {"on": boolean, "detail": text}
    has_schema boolean := pg_catalog.to_regclass('memory.schema_migrations') IS NOT NULL;
    is_super boolean;
    may_create_roles boolean;
    bypasses_rls boolean;
    ver text;
    avail text;
    sch text;
    owner_oid oid;
    lang text;
    py_installed boolean;
    py_works boolean := false;
    loaded text;
    py_probe text;  -- one of the probes that need PL/Python
    py_detail text;
    url text;
    deps text;
    n integer;
    t text;
    msg text;
    det text;
    hin text;
    member_of text;
BEGIN
    SELECT r.rolsuper, r.rolcreaterole, r.rolbypassrls
      INTO is_super, may_create_roles, bypasses_rls
      FROM pg_catalog.pg_roles r WHERE r.rolname = current_user;

    -- pgvector: installed here, and at least 0.8 (iterative index scans).
    SELECT e.extversion, ns.nspname INTO ver, sch
      FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace ns ON ns.oid = e.extnamespace
     WHERE e.extname = 'vector';
    SELECT a.default_version INTO avail FROM pg_catalog.pg_available_extensions a
     WHERE a.name = 'vector';
    IF ver IS NULL THEN
        probes := probes || jsonb_build_object('pgvector', jsonb_build_object('on', false,
            'detail', 'not installed in this database' || CASE WHEN avail IS NULL
                THEN '; the server does not offer it'
                ELSE pg_catalog.format('; the server offers %s', avail) END));
    ELSIF pg_catalog.string_to_array(pg_catalog.regexp_replace(ver, '[^0-9.].*$', ''), '.')::int[]
          < ARRAY[0, 8] THEN
        probes := probes || jsonb_build_object('pgvector', jsonb_build_object('on', false,
            'detail', pg_catalog.format('%s in schema %s: 0.8 or newer is needed', ver, sch)
                      || CASE WHEN avail IS DISTINCT FROM ver
                              THEN pg_catalog.format(' (the server offers %s)', avail) ELSE '' END));
    ELSE
        probes := probes || jsonb_build_object('pgvector', jsonb_build_object('on', true,
            'detail', pg_catalog.format('%s in schema %s; iterative index scans: yes', ver, sch)));
    END IF;

    -- The schema and its migration level (`poimen-memory doctor` compares it with its code's).
    IF has_schema THEN
        EXECUTE 'SELECT max(m.version), count(*)::integer FROM memory.schema_migrations m'
           INTO t, n;
        probes := probes || jsonb_build_object('schema', jsonb_build_object('on', n > 0,
            'detail', CASE WHEN n > 0
                THEN pg_catalog.format('%s (%s migrations applied)', t, n)
                ELSE 'schema memory has no migration applied' END));
    ELSE
        probes := probes || jsonb_build_object('schema', jsonb_build_object('on', false,
            'detail', CASE WHEN pg_catalog.to_regnamespace('memory') IS NULL
                THEN 'schema memory is not installed in this database'
                ELSE 'schema memory exists, without the migration ledger memory.schema_migrations' END));
    END IF;

    -- Row-level security on every table of the schema that holds a project's rows: those
    -- with a project_id column or a policy (partitions answer through their parent).
    IF has_schema THEN
        SELECT count(*)::integer,
               pg_catalog.string_agg(c.relname::text, ', ' ORDER BY c.relname)
                   FILTER (WHERE NOT c.relrowsecurity)
          INTO n, t
          FROM pg_catalog.pg_class c
         WHERE c.relnamespace = 'memory'::regnamespace AND c.relkind IN ('r', 'p')
           AND NOT c.relispartition
           AND (EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                        WHERE a.attrelid = c.oid AND a.attname = 'project_id' AND NOT a.attisdropped)
                OR EXISTS (SELECT 1 FROM pg_catalog.pg_policy p WHERE p.polrelid = c.oid));
        probes := probes || jsonb_build_object('row_level_security', jsonb_build_object(
            'on', n > 0 AND t IS NULL,
            'detail', CASE
                WHEN n = 0 THEN 'no table of schema memory holds project rows yet'
                WHEN t IS NOT NULL THEN pg_catalog.format('disabled on memory.%s', pg_catalog.replace(t, ', ', ', memory.'))
                ELSE pg_catalog.format('enabled on the %s tables that hold project rows', n) END
                || CASE
                WHEN is_super THEN '; this role bypasses it (a superuser)'
                WHEN bypasses_rls THEN '; this role bypasses it (BYPASSRLS)'
                WHEN pg_catalog.pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c
                                                           WHERE c.oid = 'memory.schema_migrations'::regclass), 'USAGE')
                    THEN '; this role bypasses it (it owns the tables)'
                ELSE '; this role sees the projects granted to it (memory.grant_project)' END));
    ELSE
        probes := probes || jsonb_build_object('row_level_security', jsonb_build_object(
            'on', false, 'detail', 'needs the schema (`poimen-memory migrate`)'));
    END IF;

    -- PL/Python: the extension, and whether the schema's functions were made with it (a
    -- schema migrated before the extension was created has the PM503 stubs).
    SELECT e.extversion INTO ver FROM pg_catalog.pg_extension e WHERE e.extname = 'plpython3u';
    py_installed := ver IS NOT NULL;
    IF has_schema THEN
        SELECT l.lanname INTO lang FROM pg_catalog.pg_proc p
          JOIN pg_catalog.pg_language l ON l.oid = p.prolang
         WHERE p.oid = pg_catalog.to_regprocedure('memory.plpython_load()');
    END IF;
    py_works := py_installed AND has_schema AND lang = 'plpython3u';
    IF py_installed AND (py_works OR NOT has_schema) THEN
        probes := probes || jsonb_build_object('plpython3u', jsonb_build_object('on', true,
            'detail', pg_catalog.format('%s in this database', ver)));
    ELSIF py_installed THEN
        probes := probes || jsonb_build_object('plpython3u', jsonb_build_object('on', false,
            'detail', 'installed, but the schema was migrated without it (its PL/Python functions raise PM503): run `poimen-memory migrate` again'));
    ELSE
        probes := probes || jsonb_build_object('plpython3u', jsonb_build_object('on', false,
            'detail', 'not in this database; ' || CASE
                WHEN NOT EXISTS (SELECT 1 FROM pg_catalog.pg_available_extensions a WHERE a.name = 'plpython3u')
                    THEN 'the server does not offer it (a managed service, or its package is not installed)'
                WHEN is_super THEN 'the server offers it and this role is a superuser: `poimen-memory migrate` creates it'
                ELSE 'the server offers it, but only a superuser may create it' END));
    END IF;

    -- What needs PL/Python working in this database, each probed once in turn:
    -- plpython_module, poimen_core importable inside the server, and from where; embedder,
    -- memory.embed (the local model's packages import in the server, or the remote
    -- embedding server answers). A failure reports its error without PL/Python's prefix.
    FOREACH py_probe IN ARRAY ARRAY['plpython_module', 'embedder'] LOOP
        IF NOT py_works THEN
            probes := probes || jsonb_build_object(py_probe, jsonb_build_object('on', false,
                'detail', CASE WHEN has_schema THEN 'needs plpython3u' ELSE 'needs the schema (`poimen-memory migrate`)' END));
            CONTINUE;
        END IF;
        IF py_probe = 'embedder' THEN
            EXECUTE 'SELECT (SELECT c.value FROM memory.config c WHERE c.key = ''embedding_server_url''),'
                    ' (SELECT c.value FROM memory.config c WHERE c.key = ''plpython_deps'')' INTO url, deps;
        END IF;
        BEGIN
            IF py_probe = 'plpython_module' THEN
                EXECUTE 'SELECT memory.plpython_load()' INTO loaded;
                EXECUTE 'SELECT memory.optimize_query($1)' USING 'poimen-memory doctor';
                py_detail := CASE WHEN loaded LIKE 'database:%'
                    THEN pg_catalog.format('imported from memory._plpython_modules, in the database (checksum %s)',
                                           pg_catalog.left(pg_catalog.split_part(loaded, ':', 2), 16))
                    ELSE pg_catalog.format('imported from the directory %s on the database host', loaded) END;
            ELSE
                EXECUTE 'SELECT memory.embed($1) IS NOT NULL' USING 'poimen-memory doctor';
                py_detail := CASE WHEN url IS NOT NULL
                    THEN pg_catalog.format('memory.embed works, with the remote embedding server %s', url)
                    ELSE pg_catalog.format('memory.embed works, with the local model (its packages from %s)',
                                           coalesce(deps, 'the server''s own site-packages')) END;
            END IF;
            probes := probes || jsonb_build_object(py_probe, jsonb_build_object('on', true, 'detail', py_detail));
        EXCEPTION WHEN OTHERS THEN
            -- The hint too: on another database host it says what to install there.
            GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT, det = PG_EXCEPTION_DETAIL,
                                    hin = PG_EXCEPTION_HINT;
            probes := probes || jsonb_build_object(py_probe, jsonb_build_object('on', false,
                'detail', pg_catalog.regexp_replace(msg, '^plpy\.\w+: ', '')
                          || coalesce(' (' || nullif(det, '') || ')', '')
                          || coalesce('. ' || nullif(hin, ''), '')));
        END;
    END LOOP;

    -- pg_stat_statements: created here, and its library loaded (shared_preload_libraries).
    ver := NULL;
    SELECT e.extversion, ns.nspname INTO ver, sch
      FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace ns ON ns.oid = e.extnamespace
     WHERE e.extname = 'pg_stat_statements';
    IF ver IS NULL THEN
        probes := probes || jsonb_build_object('pg_stat_statements', jsonb_build_object('on', false,
            'detail', 'not installed in this database' || CASE
                WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_available_extensions a WHERE a.name = 'pg_stat_statements')
                THEN ' (the server offers it)' ELSE ' (the server does not offer it)' END));
    ELSE
        BEGIN
            EXECUTE pg_catalog.format('SELECT count(*) FROM (SELECT 1 FROM %I.pg_stat_statements LIMIT 1) s', sch) INTO n;
            probes := probes || jsonb_build_object('pg_stat_statements', jsonb_build_object('on', true,
                'detail', pg_catalog.format('%s in schema %s, loaded', ver, sch)));
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT;
            probes := probes || jsonb_build_object('pg_stat_statements', jsonb_build_object('on', false,
                'detail', pg_catalog.format('%s in schema %s, but: %s', ver, sch, msg)));
        END;
    END IF;

    -- The role running this: the schema's owner (or a superuser) may migrate and configure;
    -- and which of this database's roles (memory.roles()) it has.
    SELECT ns.nspowner INTO owner_oid FROM pg_catalog.pg_namespace ns WHERE ns.nspname = 'memory';
    IF has_schema AND pg_catalog.to_regprocedure('memory.roles()') IS NOT NULL AND NOT is_super THEN
        EXECUTE 'SELECT ''member of '' || pg_catalog.string_agg(r.rolname::text, '', '' ORDER BY r.rolname)'
                ' FROM memory.roles() d, pg_catalog.pg_roles r'
                ' WHERE r.rolname IN (d.reader, d.writer, d.service)'
                '   AND pg_catalog.pg_has_role(current_user, r.oid, ''USAGE'')' INTO member_of;
    END IF;
    probes := probes || jsonb_build_object('owner', jsonb_build_object(
        'on', is_super OR (owner_oid IS NOT NULL AND pg_catalog.pg_has_role(current_user, owner_oid, 'USAGE'))
              OR (owner_oid IS NULL AND pg_catalog.has_database_privilege(pg_catalog.current_database(), 'CREATE')),
        'detail', pg_catalog.concat_ws('; ', current_user::text || ': ' || CASE
                WHEN owner_oid IS NULL THEN CASE
                    WHEN pg_catalog.has_database_privilege(pg_catalog.current_database(), 'CREATE')
                    THEN 'may create schema memory' ELSE 'may not create schemas in this database' END
                WHEN (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = current_user) = owner_oid
                    THEN 'owns schema memory'
                WHEN pg_catalog.pg_has_role(current_user, owner_oid, 'USAGE')
                    THEN pg_catalog.format('a member of %s, which owns schema memory', pg_catalog.pg_get_userbyid(owner_oid))
                ELSE pg_catalog.format('not the owner of schema memory (%s is)', pg_catalog.pg_get_userbyid(owner_oid)) END,
            CASE WHEN is_super THEN 'a superuser' ELSE 'not a superuser' END,
            CASE WHEN may_create_roles THEN 'may create roles' END,
            member_of)));

    RETURN QUERY
    SELECT f.j->>'name', (f.j->>'required')::boolean,
           CASE WHEN (probes->(f.j->>'name')->>'on')::boolean THEN 'on' ELSE 'off' END,
           probes->(f.j->>'name')->>'detail',
           CASE WHEN (probes->(f.j->>'name')->>'on')::boolean THEN NULL ELSE f.j->>'cost' END
      FROM jsonb_array_elements(facts) WITH ORDINALITY AS f(j, ord)
     ORDER BY f.ord;
END
$$;
COMMENT ON FUNCTION memory.capabilities() IS
    'The capability report (`poimen-memory doctor` prints it): one row per capability poimen-memory uses (pgvector >= 0.8, the schema and its migration level, row-level security, plpython3u, where poimen_core imports from, memory.embed, pg_stat_statements, whether this role owns the schema), in that order: required (doctor exits 1 when a required one is off), status on or off, detail (the version, path or error found) and, when off, cost: what is missing without it (docs/managed-postgres.md). Probes as the calling role; calls memory.optimize_query and memory.embed once (loading the model in this backend).';
