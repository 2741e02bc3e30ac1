-- The proxy database (docs/scaling.md#pl-proxy): the public functions of a poimen-memory
-- database, with the same signatures, as PL/Proxy calls to the partition databases behind
-- it. Applied by `poimen-memory shard init | migrate` (service/poimen_memory/shard/), never
-- to a partition. The partitions themselves are PL/Proxy's SQL/MED cluster 'memory'
-- (CREATE SERVER memory FOREIGN DATA WRAPPER plproxy OPTIONS (p0 '...', p1 '...')): a
-- power of two of them, more than servers, each a database of its own, so a partition
-- moves to another server by copying its database and changing one option.
--
-- Routing: a call naming a project runs on partition hashtext(project) & (partitions - 1)
-- (PL/Proxy's RUN ON hashtext(project)); a call naming none runs on every partition and
-- the answers are merged (memory.query: by final_score, docs/scaling.md says how the
-- shards' scores compare).
--
-- The caller's projects travel with each call (memory_proxy._caller): only a member of
-- @proxy.service@ (the HTTP service's role on the proxy) has its asserted
-- poimen.read_projects / write_projects forwarded; anyone else's call asserts nothing and
-- sees nothing. The partitions honour them only from their own service role, which the
-- proxy logs in as (sql/proxy/shard.sql).
--
-- Types memory.query_row, memory.node_row, memory.node_list_row and memory.review_item, and
-- the relays' signatures (pg_temp.proxy_relays), are read from partition 0's catalog by the
-- command before this file runs. Rendered markers: @proxy.service@, @proxy.max_partitions@,
-- and the shared words of poimen_core.vocabulary, as in every sql/ file.

CREATE SCHEMA IF NOT EXISTS memory_proxy;
REVOKE ALL ON SCHEMA memory_proxy FROM PUBLIC;
GRANT USAGE ON SCHEMA memory_proxy TO @proxy.service@;
GRANT USAGE ON SCHEMA memory TO @proxy.service@;
COMMENT ON SCHEMA memory_proxy IS
    'PL/Proxy internals of the proxy database (sql/proxy/proxy.sql): partition lookup, the remote calls, the merge.';

CREATE OR REPLACE FUNCTION memory_proxy.partitions()
RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- The one home of the partition map is the foreign server's options; this counts them.
RETURN (SELECT count(*)::integer
        FROM pg_catalog.pg_foreign_server s, pg_catalog.unnest(s.srvoptions) AS o(opt)
        WHERE s.srvname = 'memory' AND o.opt ~ '^p[0-9]+=');
COMMENT ON FUNCTION memory_proxy.partitions() IS
    'How many partitions cluster ''memory'' has (the p<N> options of its foreign server).';

CREATE OR REPLACE FUNCTION memory_proxy.partition_of(project text)
RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- What PL/Proxy's RUN ON hashtext(project) picks: the hash masked by partitions - 1.
RETURN pg_catalog.hashtext(project) & (memory_proxy.partitions() - 1);
COMMENT ON FUNCTION memory_proxy.partition_of(text) IS
    'The partition holding a project: hashtext(project) & (partitions - 1), as PL/Proxy''s RUN ON hashtext(project).';

-- Ids of rows that several partitions answer (a review item, a reranker's candidate) are
-- each partition's own, so two partitions may give the same one. Through the proxy such an
-- id is global: the partition's id times @proxy.max_partitions@ (the cap on partitions,
-- shard.MAX_PARTITIONS) plus the partition's number. It keeps each partition's order, so a
-- keyset over global ids pages every partition at once.
CREATE OR REPLACE FUNCTION memory_proxy._global_id(part integer, id bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN id * @proxy.max_partitions@ + part;
COMMENT ON FUNCTION memory_proxy._global_id(integer, bigint) IS
    'A partition''s row id as the proxy hands it out: id * @proxy.max_partitions@ + part (memory_proxy._local_id undoes it).';

CREATE OR REPLACE FUNCTION memory_proxy._local_id(global_id bigint, OUT part integer, OUT id bigint)
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC SELECT (global_id % @proxy.max_partitions@)::integer, global_id / @proxy.max_partitions@; END;
COMMENT ON FUNCTION memory_proxy._local_id(bigint) IS
    'The partition and its own id behind a global id of memory_proxy._global_id.';

CREATE OR REPLACE FUNCTION memory_proxy._caller(OUT read_projects text, OUT write_projects text, OUT api_key text)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Forwarded for the proxy's service role alone (as a partition honours them for its
    -- own, sql/085_tenants.sql): anyone else asserts nothing.
    IF coalesce(pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole('@proxy.service@'), 'MEMBER'), false) THEN
        read_projects := current_setting('poimen.read_projects', true);
        write_projects := current_setting('poimen.write_projects', true);
        api_key := current_setting('poimen.api_key', true);
    END IF;
END $$;
COMMENT ON FUNCTION memory_proxy._caller() IS
    'The asserted projects and API key that travel with a call: the session''s poimen.read_projects, poimen.write_projects and poimen.api_key for a member of @proxy.service@, NULLs (nothing) for anyone else.';

CREATE OR REPLACE FUNCTION memory_proxy._lock_key()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN 1886351213;  -- 'pmpx' as an int4: the first key of the partition locks
COMMENT ON FUNCTION memory_proxy._lock_key() IS
    'First key of the advisory locks on partitions: writers hold (key, partition) shared for their call, `shard move` exclusively while it copies the partition.';

CREATE OR REPLACE FUNCTION memory_proxy._write_lock(part integer)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Waits while `shard move` copies the partition. Reading memory_proxy.moves afterwards
    -- takes a fresh lock on a relation, which makes this backend read the invalidations
    -- the move committed: PL/Proxy then sees the partition's new server.
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(memory_proxy._lock_key(), part);
    PERFORM 1 FROM memory_proxy.moves m WHERE m.partition = part;
END $$;
COMMENT ON FUNCTION memory_proxy._write_lock(integer) IS
    'Taken by every write before its remote call: waits while the partition is being moved (`poimen-memory shard move`), then routes to where it now is.';

CREATE TABLE IF NOT EXISTS memory_proxy.moves (
    partition integer NOT NULL,
    from_conninfo text NOT NULL,
    to_conninfo text NOT NULL,
    moved_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE memory_proxy.moves IS
    'Each partition move `poimen-memory shard move` made: from where, to where, when.';

-- The one-argument form of releases before the SQLSTATE was read: gone, so that calls with
-- one argument are not ambiguous.
DROP FUNCTION IF EXISTS memory_proxy._unreachable(text);
CREATE OR REPLACE FUNCTION memory_proxy._unreachable(message text, state text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- PL/Proxy reports a partition it cannot reach as XX000 "[p1] PQconnectStart: ..." (or a
-- connection lost mid-call); a remote error keeps its own SQLSTATE, or says REMOTE ERROR.
-- A server shutting down, starting or crashed ends the connections it had (57P01-57P03,
-- "terminating connection due to administrator command"): a proxy backend that held one
-- learns it on its next call there, which is the same partition out of reach. The one
-- rule: every handler catches OTHERS and re-raises what this does not call out of reach
-- (memory_proxy._down's own 08006 for a named project among them).
RETURN (message ~ '^PL/Proxy function [^\[]*\[[^]]*\] ' AND message !~ 'REMOTE ERROR')
    OR coalesce(state ~ '^57P0[123]$', false);
COMMENT ON FUNCTION memory_proxy._unreachable(text, text) IS
    'Whether a PL/Proxy error (its message and SQLSTATE) is a partition out of reach (connect failed, connection lost, the server shutting down or starting: 57P01-57P03) rather than a remote error.';

CREATE OR REPLACE FUNCTION memory_proxy._down(part integer, project text, message text)
RETURNS void
-- VOLATILE: it only raises, and must never be folded into a plan as a constant.
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- 08006 (connection_failure): the service answers 503 (its SQLSTATE table, class 08).
    RAISE EXCEPTION 'partition % holding project % is unreachable', part, project
        USING ERRCODE = '08006', DETAIL = message,
              HINT = '`poimen-memory shard status` names its server; retry once it is back (other projects answer meanwhile).';
END $$;
COMMENT ON FUNCTION memory_proxy._down(integer, text, text) IS
    'Raises the typed error of a partition out of reach (08006, HTTP 503), naming the partition and project.';

CREATE OR REPLACE FUNCTION memory_proxy._targets(read_projects text)
RETURNS integer[]
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- The partitions a call naming no project asks: those holding the asserted projects (an
-- API key's), or every partition for '*' (anonymous mode) and for a caller that asserts
-- nothing (it sees nothing, but is answered as a single database answers it).
RETURN CASE WHEN read_projects IS NULL OR read_projects IN ('', '*')
            THEN ARRAY(SELECT pg_catalog.generate_series(0, memory_proxy.partitions() - 1))
            ELSE ARRAY(SELECT DISTINCT memory_proxy.partition_of(btrim(p))
                       FROM pg_catalog.unnest(pg_catalog.string_to_array(read_projects, ',')) p
                       ORDER BY 1) END;
COMMENT ON FUNCTION memory_proxy._targets(text) IS
    'The partitions a call naming no project runs on: those of the asserted read projects (comma-separated), all of them for * or none asserted.';

CREATE OR REPLACE FUNCTION memory_proxy._none_reachable()
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'no partition is reachable'
        USING ERRCODE = '08006', HINT = '`poimen-memory shard status` names the servers.';
END $$;
COMMENT ON FUNCTION memory_proxy._none_reachable() IS
    'Raises 08006 (HTTP 503): every partition a call needs is out of reach.';

CREATE OR REPLACE FUNCTION memory_proxy._need_project(project text, hint text)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF project IS NULL THEN
        RAISE EXCEPTION 'project must not be NULL' USING ERRCODE = '22023', HINT = hint;
    END IF;
END $$;
COMMENT ON FUNCTION memory_proxy._need_project(text, text) IS
    'Raises 22023 (with hint) for a call that must name a project and names none.';

CREATE OR REPLACE FUNCTION memory_proxy._route(project text, read_projects text)
RETURNS integer[]
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN CASE WHEN project IS NOT NULL THEN ARRAY[memory_proxy.partition_of(project)]
            ELSE memory_proxy._targets(read_projects) END;
COMMENT ON FUNCTION memory_proxy._route(text, text) IS
    'The partitions a call runs on: the one holding project, else those of the read projects (memory_proxy._targets).';

-- PL/Proxy's SELECT reads an argument's plain name, not a quoted one ("limit" of the review
-- queue's): the remote calls pass the public function's arguments by position.
CREATE OR REPLACE FUNCTION memory_proxy._positional(call text, first integer)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT pg_catalog.string_agg('$' || (first + a.i - 1)::text, ', ' ORDER BY a.i)
        FROM pg_catalog.generate_subscripts(pg_catalog.string_to_array(call, ', '), 1) AS a(i));
COMMENT ON FUNCTION memory_proxy._positional(text, integer) IS
    'The arguments of a call list (a, b, ...) as positional references from $first: how a PL/Proxy remote call passes them (its SELECT does not read quoted names).';

-- The remote calls: one pair per relay of the partitions (sql/proxy/shard.sql), "on" a
-- given hash (RUN ON: PL/Proxy masks it to a partition) and, for the reads merged over
-- partitions, on all partitions at once (RUN ON ALL, in parallel). Their arguments: the
-- caller's three settings, then the public function's own. The relays' signatures are
-- read from partition 0's catalog by the command, into pg_temp.proxy_relays (name, args
-- and call after the three settings, result), so a remote call can never disagree with
-- its relay.
DO $$
DECLARE
    f record;
    old regprocedure;
BEGIN
    FOR f IN
        SELECT r.name, r.args, r.call, v.on_all,
               -- RUN ON ALL returns a set: one answer a partition. A relay returning void
               -- (configure_embedding) answers 1.
               CASE WHEN r.result = 'void' THEN 'integer'
                    WHEN v.on_all AND r.result !~ '^(SETOF|TABLE)' THEN 'SETOF ' || r.result
                    ELSE r.result END AS result,
               CASE WHEN r.result = 'void' THEN '1' ELSE '*' END AS pick
        FROM pg_temp.proxy_relays r,
             LATERAL (SELECT r.name IN ('query', 'answer', '_serve', '_stored_hashes') AS on_all) v
    LOOP
        -- A remote call whose result or argument names changed (a proxy made by an older
        -- proxy.sql, or a relay changed) cannot be replaced in place: dropped, made again.
        FOR old IN
            SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.pronamespace = 'memory_proxy'::regnamespace
              AND p.proname IN (f.name || '_on', f.name || '_all')
              AND p.pronargs = (p.proname LIKE '%\_on')::integer + 3
                               + coalesce(pg_catalog.cardinality(pg_catalog.string_to_array(f.call, ', ')), 0)
              AND (pg_catalog.pg_get_function_result(p.oid) IS DISTINCT FROM f.result
                   OR pg_catalog.array_to_string(p.proargnames[(p.proname LIKE '%\_on')::integer + 4:p.pronargs], ', ')
                      IS DISTINCT FROM coalesce(f.call, ''))
        LOOP
            EXECUTE pg_catalog.format('DROP FUNCTION %s', old);
        END LOOP;
        EXECUTE pg_catalog.format(
            'CREATE OR REPLACE FUNCTION memory_proxy.%I(hash integer, read_projects text, write_projects text, '
            'api_key text%s) RETURNS %s LANGUAGE plproxy AS %L',
            f.name || '_on', ', ' || f.args, f.result,
            pg_catalog.format('CLUSTER ''memory''; RUN ON hash; SELECT %s FROM memory_shard.%I(read_projects, write_projects, api_key%s);',
                              f.pick, f.name, ', ' || memory_proxy._positional(f.call, 5)));
        EXECUTE pg_catalog.format('COMMENT ON FUNCTION memory_proxy.%I(integer, text, text, text%s) IS %L',
            f.name || '_on', ', ' || f.args,
            pg_catalog.format('memory.%s on the partition hash & (partitions - 1) picks, through its relay memory_shard.%s.', f.name, f.name));
        -- The one remote call of the public functions: the caller's settings travel with
        -- it, and a partition out of reach is the typed error naming on_project's.
        EXECUTE pg_catalog.format($f$
CREATE OR REPLACE FUNCTION memory_proxy.%1$I(part integer, on_project text%2$s)
RETURNS %3$s
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    c record := memory_proxy._caller();
BEGIN
    %4$s memory_proxy.%5$I(part, c.read_projects, c.write_projects, c.api_key%6$s);
EXCEPTION WHEN OTHERS THEN
    IF on_project IS NULL OR NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
    PERFORM memory_proxy._down(part, on_project, SQLERRM);
END $body$ $f$,
            f.name || '_at', ', ' || f.args, f.result,
            CASE WHEN f.result ~ '^(SETOF|TABLE)' THEN 'RETURN QUERY SELECT * FROM' ELSE 'RETURN' END,
            f.name || '_on', ', ' || f.call);
        EXECUTE pg_catalog.format('COMMENT ON FUNCTION memory_proxy.%I(integer, text%s) IS %L',
            f.name || '_at', ', ' || f.args,
            pg_catalog.format('memory.%s on partition part with the caller''s settings (memory_proxy._caller); out of reach: 08006 naming on_project (memory_proxy._down), or PL/Proxy''s error when on_project is NULL.', f.name));
        IF f.on_all THEN
            EXECUTE pg_catalog.format(
                'CREATE OR REPLACE FUNCTION memory_proxy.%I(read_projects text, write_projects text, '
                'api_key text, %s) RETURNS %s LANGUAGE plproxy AS %L',
                f.name || '_all', f.args, f.result,
                pg_catalog.format('CLUSTER ''memory''; RUN ON ALL; SELECT * FROM memory_shard.%I(read_projects, write_projects, api_key, %s);',
                                  f.name, memory_proxy._positional(f.call, 4)));
            EXECUTE pg_catalog.format('COMMENT ON FUNCTION memory_proxy.%I(text, text, text, %s) IS %L',
                f.name || '_all', f.args,
                pg_catalog.format('memory.%s on every partition at once (RUN ON ALL), through its relay memory_shard.%s.', f.name, f.name));
        END IF;
        IF f.on_all AND f.result LIKE 'SETOF %' THEN
            -- The fan-out of a read over partitions (memory_proxy._route's): all at once
            -- when they are all of them, else (or when one is out of reach) each alone, to
            -- answer from the others and name the missing ones (08006 for a named project).
            EXECUTE pg_catalog.format($f$
CREATE OR REPLACE FUNCTION memory_proxy.%1$I(on_project text, parts integer[], %2$s,
    OUT got %3$s[], OUT missing integer[])
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    c record := memory_proxy._caller();
    part integer;
BEGIN
    got := '{}';
    missing := '{}';
    IF on_project IS NULL AND cardinality(parts) = memory_proxy.partitions() THEN
        BEGIN
            got := ARRAY(SELECT r FROM memory_proxy.%4$I(c.read_projects, c.write_projects, c.api_key, %6$s) r);
            RETURN;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
        END;
    END IF;
    FOREACH part IN ARRAY parts LOOP
        BEGIN
            got := got || ARRAY(SELECT r FROM memory_proxy.%5$I(part, on_project, %6$s) r);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
        END;
    END LOOP;
    IF cardinality(missing) = cardinality(parts) THEN
        PERFORM memory_proxy._none_reachable();
    END IF;
END $body$ $f$,
                f.name || '_gather', f.args, substr(f.result, 7), f.name || '_all', f.name || '_at', f.call);
            EXECUTE pg_catalog.format('COMMENT ON FUNCTION memory_proxy.%I(text, integer[], %s) IS %L',
                f.name || '_gather', f.args,
                pg_catalog.format('memory.%s on the partitions parts (memory_proxy._route''s; all at once when they are all of them), the answers in got and those out of reach in missing; 08006 when on_project''s is out of reach or all are.', f.name));
        END IF;
    END LOOP;
END $$;

DROP FUNCTION IF EXISTS memory_proxy.get_node_all(text, text, text, text, text);  -- unused (memory.get_node asks each partition)

-- memory.query: one partition when the call names a project, else all of them merged.
DROP FUNCTION IF EXISTS memory_proxy._query_rows(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text);  -- now memory_proxy.query_gather

CREATE OR REPLACE FUNCTION memory_proxy._merge(rows memory.query_row[], k integer)
RETURNS SETOF memory.query_row
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Each partition's top k, merged: the k best by final_score (ties: cosine, then the
    -- project and each partition's own rank), ranked again 1..k. docs/scaling.md says how
    -- the partitions' scores compare.
    SELECT (row_number() OVER w)::integer, u.node_id, u.external_id, u.level, u.sha256, u.project,
           u.title, u.text, u.source, u.breadcrumb, u."timestamp", u.query_score, u.lexical_score,
           u.final_score, u.semantic_rank, u.lexical_rank, u.fusion_method, u.search_strategy,
           u.provenance, u.provenance_truncated, u.metadata, u.support, u.changed_parents,
           u.uncited_reason
    FROM unnest(rows) AS u
    WINDOW w AS (ORDER BY u.final_score DESC NULLS LAST, u.query_score DESC NULLS LAST,
                 u.project, u.rank)
    ORDER BY u.final_score DESC NULLS LAST, u.query_score DESC NULLS LAST, u.project, u.rank
    LIMIT k;
$$;
COMMENT ON FUNCTION memory_proxy._merge(memory.query_row[], integer) IS
    'The k best of the partitions'' rows by final_score (ties: query_score, project, rank), ranked 1..k.';

CREATE OR REPLACE FUNCTION memory.query(
    query text,
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    levels text[] DEFAULT ARRAY['L1', 'L2'],
    k integer DEFAULT 5,
    strategy text DEFAULT NULL,
    fusion text DEFAULT NULL,
    rrf_k integer DEFAULT NULL,
    candidates integer DEFAULT NULL,
    dense_weight double precision DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    min_cosine double precision DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL,
    unsupported text DEFAULT NULL
)
RETURNS SETOF memory.query_row
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    got record;
BEGIN
    got := memory_proxy.query_gather(project, memory_proxy._route(project, NULL),
        query, query_embedding, project, levels, k, strategy, fusion, rrf_k, candidates, dense_weight,
        since, until, reference_time, filter, min_cosine, as_of, valid_at, unsupported);
    IF cardinality(got.missing) > 0 THEN
        RAISE WARNING 'degraded: partitions % are unreachable; answered from the others', got.missing
            USING DETAIL = pg_catalog.format('{"stage": "shard", "reason": "unreachable", "partitions": %s}',
                                             pg_catalog.to_jsonb(got.missing)),
                  HINT = '`poimen-memory shard status` names their servers.';
    END IF;
    IF project IS NOT NULL THEN
        RETURN QUERY SELECT * FROM unnest(got.got);
    ELSE
        RETURN QUERY SELECT * FROM memory_proxy._merge(got.got, k);
    END IF;
END $$;
COMMENT ON FUNCTION memory.query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text) IS
    'memory.query of the partition databases (its arguments and rows), through PL/Proxy: with project, on the partition holding it (08006 when that one is out of reach); without, on every partition, each one''s top k merged by final_score (docs/scaling.md), with a WARNING naming the partitions out of reach.';

-- memory.answer and the alias public.memory_query are made from memory.query's catalog
-- entry (as on a partition: sql/070_query.sql, sql/079_aliases.sql), so the three can never
-- disagree about a name, a type or a default.
DO $$
DECLARE
    query regprocedure := (SELECT p.oid FROM pg_catalog.pg_proc p
                           WHERE p.pronamespace = 'memory'::regnamespace AND p.proname = 'query');
    args text := pg_catalog.pg_get_function_arguments(query);
    call text := (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(n), ', ' ORDER BY i)
                  FROM pg_catalog.pg_proc p, pg_catalog.unnest(p.proargnames) WITH ORDINALITY AS a(n, i)
                  WHERE p.oid = query);
BEGIN
    EXECUTE pg_catalog.format($f$
CREATE OR REPLACE FUNCTION memory.answer(%1$s, evidence integer DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    got record;
BEGIN
    got := memory_proxy.answer_gather(project, memory_proxy._route(project, NULL), %2$s, evidence);
    IF project IS NOT NULL THEN
        RETURN got.got[1];
    END IF;
    RETURN memory_proxy._merge_docs(got.got, got.missing, coalesce(k, (got.got[1] -> 'plan' ->> 'k')::integer));
END $body$ $f$, args, call);
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION public.memory_query(%s) RETURNS SETOF memory.query_row '
        'LANGUAGE sql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp '
        'AS %L', args, pg_catalog.format('SELECT * FROM memory.query(%s)',
            (SELECT pg_catalog.string_agg('$' || i, ', ' ORDER BY i)
             FROM pg_catalog.generate_series(1, pg_catalog.cardinality(pg_catalog.string_to_array(call, ', '))) AS i)));
END $$;
COMMENT ON FUNCTION memory.answer(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text, integer) IS
    'memory.answer of the partition databases through PL/Proxy: with project, the document of the partition holding it (08006 when out of reach); without, every partition''s documents merged by memory_proxy._merge_docs (as memory._serve''s: results as memory.query merges them, evidence concatenated, counts summed, "partitions" {answered, missing}, and a degraded entry {"stage": "shard", "reason": "unreachable", "partitions": [...]} when some were out of reach).';

CREATE OR REPLACE FUNCTION memory_proxy._write_on(part integer, nodes jsonb, embeddings vector[], embed boolean, via text)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF via = 'add_nodes' THEN
        RETURN memory_proxy.add_nodes_at(part, NULL, nodes);
    END IF;
    RETURN memory_proxy._write_nodes_at(part, NULL, nodes, embeddings, embed);
END $$;
COMMENT ON FUNCTION memory_proxy._write_on(integer, jsonb, vector[], boolean, text) IS
    'One partition''s write: memory.add_nodes (via ''add_nodes'', embeddings and embed unused) or memory._write_nodes (via ''_write_nodes'') on partition part.';

CREATE OR REPLACE FUNCTION memory_proxy._write(nodes jsonb, embeddings vector[], embed boolean, via text)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g record;
    res jsonb;
    out_nodes jsonb := '[]';
    totals jsonb := '{"inserted": 0, "duplicates": 0, "updated": 0, "edges": 0}';
    unresolved jsonb := '[]';
BEGIN
    -- Not an array: the partition says so, as a single database would (22023).
    IF jsonb_typeof(nodes) IS DISTINCT FROM 'array' THEN
        RETURN memory_proxy._write_on(0, nodes, embeddings, embed, via);
    END IF;
    -- The nodes (and their vectors) grouped by the partition of their project, each group
    -- one remote call (all or nothing within it; a later group's failure leaves the
    -- earlier ones written, and writing them again answers "unchanged": docs/scaling.md).
    FOR g IN
        SELECT memory_proxy.partition_of(e.node ->> 'project') AS part,
               min(e.node ->> 'project') AS project,
               jsonb_agg(e.node ORDER BY e.ord) AS group_nodes,
               CASE WHEN embeddings IS NULL THEN NULL
                    ELSE array_agg(embeddings[e.ord] ORDER BY e.ord) END AS group_vectors,
               array_agg(e.ord ORDER BY e.ord) AS ords
        FROM jsonb_array_elements(nodes) WITH ORDINALITY AS e(node, ord)
        GROUP BY 1 ORDER BY 1 NULLS FIRST
    LOOP
        PERFORM memory_proxy._write_lock(coalesce(g.part, 0));
        BEGIN
            res := memory_proxy._write_on(coalesce(g.part, 0), g.group_nodes, g.group_vectors, embed, via);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            PERFORM memory_proxy._down(g.part, g.project, SQLERRM);
        END;
        -- Merged back into input order: nodes and unresolved numbered over the whole batch.
        out_nodes := out_nodes || coalesce((SELECT jsonb_agg(jsonb_build_object('ord', g.ords[i.ord]) || i.node)
                                            FROM jsonb_array_elements(res -> 'nodes') WITH ORDINALITY AS i(node, ord)), '[]');
        SELECT jsonb_object_agg(t.key, (t.value)::bigint + coalesce((res ->> t.key)::bigint, 0))
          INTO totals FROM jsonb_each_text(totals) t;
        unresolved := unresolved || coalesce(
            (SELECT jsonb_agg(jsonb_build_array(g.ords[(u ->> 0)::integer], u -> 1))
             FROM jsonb_array_elements(res -> 'unresolved') u), '[]');
    END LOOP;
    RETURN totals || jsonb_build_object(
        'nodes', (SELECT coalesce(jsonb_agg(n - 'ord' ORDER BY (n ->> 'ord')::bigint), '[]')
                  FROM jsonb_array_elements(out_nodes) n),
        'unresolved', (SELECT coalesce(jsonb_agg(u ORDER BY (u ->> 0)::bigint), '[]')
                       FROM jsonb_array_elements(unresolved) u));
END $$;
COMMENT ON FUNCTION memory_proxy._write(jsonb, vector[], boolean, text) IS
    'The write path of memory.add_nodes and memory._write_nodes (via names which): the nodes and their vectors grouped by the partition of their project, one call (all or nothing) per partition under its write lock, the answers merged in input order (unresolved numbered over the whole batch) and the counts summed; 08006 when a partition is out of reach.';

CREATE OR REPLACE FUNCTION memory.add_nodes(nodes jsonb)
RETURNS jsonb
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory_proxy._write(nodes, NULL, false, 'add_nodes');
COMMENT ON FUNCTION memory.add_nodes(jsonb) IS
    'memory.add_nodes of the partition databases through PL/Proxy: the nodes grouped by the partition of their project, one call (all or nothing) per partition, the answers merged in input order (unresolved numbered over the whole batch) and the counts summed (memory_proxy._write). Waits while a partition it writes is being moved; 08006 when one is out of reach.';

CREATE OR REPLACE FUNCTION memory.get_node(id text, project text DEFAULT NULL)
RETURNS SETOF memory.node_row
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    found memory.node_row[] := '{}';
    part integer;
BEGIN
    IF project IS NOT NULL THEN
        RETURN QUERY SELECT * FROM memory_proxy.get_node_at(memory_proxy.partition_of(project), project, id, project);
        RETURN;
    END IF;
    -- No project: the id must be unique among the readable projects of every partition.
    FOR part IN 0 .. memory_proxy.partitions() - 1 LOOP
        BEGIN
            found := found || ARRAY(SELECT r FROM memory_proxy.get_node_at(part, NULL, id, project) r);
        EXCEPTION WHEN SQLSTATE 'PM444' THEN
            NULL;
        END;
    END LOOP;
    IF cardinality(found) = 0 THEN
        RAISE EXCEPTION 'no current node %', id USING ERRCODE = 'PM444',
            HINT = 'Name its project; memory.history(project, id) lists its versions.';
    ELSIF cardinality(found) > 1 THEN
        RAISE EXCEPTION 'node id % is in several projects', id USING ERRCODE = 'PMA09',
            DETAIL = (SELECT string_agg(f.project, ', ' ORDER BY f.project) FROM unnest(found) f),
            HINT = 'Name the project.';
    END IF;
    RETURN QUERY SELECT * FROM unnest(found);
END $$;
COMMENT ON FUNCTION memory.get_node(text, text) IS
    'memory.get_node of the partition databases through PL/Proxy: with project, on the partition holding it; without, on each partition in turn (PM444 when none has it, PMA09 when several projects do).';

CREATE OR REPLACE FUNCTION memory.history(project text, external_id text)
RETURNS TABLE (revision integer, node_id bigint, current boolean, level text, sha256 text,
               title text, text text, source text, "timestamp" timestamptz, metadata jsonb,
               created_at timestamptz, expired_at timestamptz, end_reason text,
               written_by text, ended_by text, end_note text, erased_at timestamptz,
               valid_from timestamptz, valid_to timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM memory_proxy._need_project(project, 'memory.history(project, external_id): ids are unique per project.');
    RETURN QUERY SELECT * FROM memory_proxy.history_at(memory_proxy.partition_of(project), project,
        project, external_id);
END $$;
COMMENT ON FUNCTION memory.history(text, text) IS
    'memory.history of the partition databases through PL/Proxy, on the partition holding project.';

CREATE OR REPLACE FUNCTION memory.forget(
    project text,
    external_ids text[] DEFAULT NULL,
    source text DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    erase boolean DEFAULT false,
    reason text DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    level text DEFAULT NULL,
    dry_run boolean DEFAULT false,
    max_nodes integer DEFAULT 1000
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM memory_proxy._need_project(project, 'memory.forget names one project (through the proxy, it picks the partition).');
    PERFORM memory_proxy._write_lock(memory_proxy.partition_of(project));
    RETURN memory_proxy.forget_at(memory_proxy.partition_of(project), project, project, external_ids,
        source, since, until, erase, reason, filter, level, dry_run, max_nodes);
END $$;
COMMENT ON FUNCTION memory.forget(text, text[], text, text, text, boolean, text, jsonb, text, boolean, integer) IS
    'memory.forget of the partition databases through PL/Proxy, on the partition holding project (waits while it is being moved). max_nodes defaults to 1000, the partitions'' default (memory._forget_max_nodes()).';

CREATE OR REPLACE FUNCTION memory.forget(
    project text, external_id text, erase boolean DEFAULT false, reason text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM memory_proxy._need_project(project, 'memory.forget names one project (through the proxy, it picks the partition).');
    PERFORM memory_proxy._write_lock(memory_proxy.partition_of(project));
    RETURN memory_proxy.forget_at(memory_proxy.partition_of(project), project, project, external_id,
        erase, reason);
END $$;
COMMENT ON FUNCTION memory.forget(text, text, boolean, text) IS
    'memory.forget of one node through PL/Proxy, on the partition holding project (waits while it is being moved).';

-- ---------------------------------------------------------------------------------------
-- The HTTP service over the proxy (docs/scaling.md#the-http-service-over-the-proxy): what
-- the service calls beyond the public functions, with a single database's signatures, so
-- POIMEN_DATABASE_URL may name the proxy and the service does not change. Proxied to the
-- partitions: the query statements (memory._serve_start, _serve, _serve_finish), one node
-- (memory._get_node), the writer and its reads (memory._write_nodes, _stored_nodes,
-- _stored_hashes, configure_embedding) and the totals /healthz reads. Kept here, on the
-- proxy: the API keys (memory.api_keys, below), which the service reads before any call.
--
-- The caller's projects: the query statements carry them in caps (read_projects,
-- write_projects), as on a single database; they travel only for a member of
-- @proxy.service@ (memory_proxy._caps), as the session's settings do (memory_proxy._caller).

CREATE OR REPLACE FUNCTION memory_proxy._trusted()
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN coalesce(pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole('@proxy.service@'), 'MEMBER'), false);
COMMENT ON FUNCTION memory_proxy._trusted() IS
    'Whether the caller is a member of @proxy.service@, whose asserted projects travel to the partitions.';

CREATE OR REPLACE FUNCTION memory_proxy._caps(caps jsonb)
RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- Anyone else's caps assert nothing: the partition then applies the proxy role's grants
-- (none), as it would the caller's on a single database.
RETURN CASE WHEN memory_proxy._trusted() THEN caps
            ELSE caps - 'read_projects' - 'write_projects' END;
COMMENT ON FUNCTION memory_proxy._caps(jsonb) IS
    'The service''s caps as they travel: with read_projects / write_projects for a member of @proxy.service@ only.';

CREATE OR REPLACE FUNCTION memory._serve_start(req jsonb, caps jsonb)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    project text := req ->> 'project';
    part integer;
BEGIN
    caps := memory_proxy._caps(caps);
    -- No project: the plan of the first partition that answers, without its prefetched
    -- legs (their node ids are that partition's; every partition runs its own legs).
    FOREACH part IN ARRAY memory_proxy._route(project, caps ->> 'read_projects') LOOP
        BEGIN
            RETURN memory_proxy._serve_start_at(part, project, req, caps)
                || CASE WHEN project IS NULL
                        THEN jsonb_build_object('prefetched', jsonb_build_object('calls', '{}'::jsonb, 'stages', '{}'::jsonb))
                        ELSE '{}' END;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
        END;
    END LOOP;
    PERFORM memory_proxy._none_reachable();
END $$;
COMMENT ON FUNCTION memory._serve_start(jsonb, jsonb) IS
    'memory._serve_start of the partitions through PL/Proxy: with req.project, on the partition holding it (08006 when out of reach); without, the plan of the first reachable partition the caller''s projects are on, with no prefetched legs.';

-- The three-argument form of releases before the reranker's order: gone, so that calls
-- with three arguments are not ambiguous.
DROP FUNCTION IF EXISTS memory_proxy._merge_docs(jsonb[], integer[], integer);
CREATE OR REPLACE FUNCTION memory_proxy._merge_docs(
    docs jsonb[], missing integer[], k integer,
    parts integer[] DEFAULT NULL, result_order bigint[] DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    merged jsonb;
    entry jsonb;
    kept jsonb;
BEGIN
    -- The first partition's document; the results merged as memory.query merges rows (the
    -- k best by final_score, ties by query_score, project, each partition's rank; ranked
    -- again 1..k), the evidence lists concatenated, the counts summed. With result_order
    -- (a reranker's, in global ids; parts[i] is the partition of docs[i]) the results are
    -- ranked in its order instead, all of them (k NULL): each partition finished its own
    -- in that order, and the results in doubt it demoted (memory._finish) stay below the
    -- others, as on one database.
    SELECT coalesce(jsonb_agg(jsonb_build_object('i', m.i, 'rank', m.r -> 'rank', 'n', m.n, 'r', m.r) ORDER BY m.n), '[]')
      INTO kept
      FROM (SELECT d.i, r, row_number() OVER (
                ORDER BY
                    CASE WHEN result_order IS NOT NULL THEN
                        coalesce(d.doc -> 'plan' -> 'unsupported' ->> 'policy' = 'demote'
                                 AND r ->> 'support' IN ('stale', 'partial', 'none'), false) END,
                    array_position(result_order,
                                   memory_proxy._global_id(parts[d.i], (r ->> 'node_id')::bigint)),
                    (r ->> 'final_score')::float8 DESC NULLS LAST,
                    (r ->> 'query_score')::float8 DESC NULLS LAST,
                    r ->> 'project', (r ->> 'rank')::integer) AS n
            FROM unnest(docs) WITH ORDINALITY AS d(doc, i),
                 jsonb_array_elements(d.doc -> 'results') r) m
     WHERE m.n <= k OR (k IS NULL AND result_order IS NOT NULL);
    merged := docs[1] || jsonb_build_object(
        'results', (SELECT coalesce(jsonb_agg((x -> 'r') || jsonb_build_object('rank', x -> 'n')
                                              ORDER BY (x ->> 'n')::integer), '[]')
                    FROM jsonb_array_elements(kept) x),
        -- cited_by named the partition's own ranks: now the merged ones of its results that
        -- were kept (a rank not kept, or a deeper candidate's, is left out). NULL when no
        -- partition listed evidence (none asked, or it failed: evidence_failed says why).
        'evidence', (SELECT CASE WHEN bool_or(jsonb_typeof(d.doc -> 'evidence') = 'array') THEN
                                 coalesce(jsonb_agg(e.v || CASE WHEN jsonb_typeof(e.v -> 'cited_by') = 'array' THEN
                                     jsonb_build_object('cited_by', to_jsonb(ARRAY(
                                         SELECT (x ->> 'n')::integer
                                         FROM jsonb_array_elements(kept) x, jsonb_array_elements(e.v -> 'cited_by') c
                                         WHERE (x ->> 'i')::integer = d.i AND x -> 'rank' = c
                                         ORDER BY 1)))
                                     ELSE '{}' END ORDER BY d.i, e.o) FILTER (WHERE e.v IS NOT NULL), '[]') END
                     FROM unnest(docs) WITH ORDINALITY AS d(doc, i)
                     LEFT JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(d.doc -> 'evidence') = 'array'
                                                                 THEN d.doc -> 'evidence' ELSE '[]' END)
                               WITH ORDINALITY AS e(v, o) ON true),
        'counts', (SELECT coalesce(jsonb_object_agg(key, total), '{}')
                   FROM (SELECT key, CASE WHEN bool_and(jsonb_typeof(value) = 'number')
                                          THEN to_jsonb(sum((value #>> '{}')::numeric))
                                          ELSE (array_agg(value))[1] END AS total
                         FROM unnest(docs) d, jsonb_each(d -> 'counts')
                         GROUP BY key) t),
        'partitions', jsonb_build_object('answered', cardinality(docs), 'missing', to_jsonb(missing)));
    IF cardinality(missing) > 0 THEN
        entry := jsonb_build_object('stage', 'shard', 'reason', 'unreachable', 'partitions', to_jsonb(missing));
        merged := jsonb_set(merged, '{degraded}', coalesce(merged -> 'degraded', '[]') || entry);
        IF jsonb_typeof(merged -> 'plan') = 'object' THEN
            merged := jsonb_set(merged, '{plan,degraded}', coalesce(merged -> 'plan' -> 'degraded', '[]') || entry);
            merged := jsonb_set(merged, '{plan,why}', coalesce(merged -> 'plan' -> 'why', '[]')
                || to_jsonb(format('partitions %s are unreachable: answered from the others', missing)));
        END IF;
    END IF;
    RETURN merged;
END $$;
COMMENT ON FUNCTION memory_proxy._merge_docs(jsonb[], integer[], integer, integer[], bigint[]) IS
    'One answer document of several partitions'' (memory._serve''s, memory._serve_finish''s): the first one''s, results merged (k best by final_score, ranked again; with result_order, a reranker''s global ids of memory_proxy._global_id over parts, the partition of each document: in that order, results in doubt a partition demoted last), evidence concatenated (cited_by: the merged ranks of the partition''s results kept; NULL when no partition listed any), counts summed, "partitions" {answered, missing}, and a degraded entry {"stage": "shard", "reason": "unreachable", "partitions": [...]} (also in plan.degraded, which the HTTP answer lists) when some were out of reach.';

-- A reranker over every partition (a query naming no project): memory._serve through
-- 'candidates' gathers each partition's fused candidates and hands them to the service
-- with global node ids (memory_proxy._global_id), merged as the answers are; the service's
-- reranker orders them, and memory._serve_finish splits its order back by partition
-- (memory_proxy._local_id), has each partition finish its own in that order, and merges
-- the documents in the reranker's order. The remote calls of both halves carry each
-- partition's number (PL/Proxy's SPLIT: every partition gets its own element of the
-- arrays), so an answer is known to be its partition's.
-- The form with one prefetched for all (releases before each partition's own): gone.
DROP FUNCTION IF EXISTS memory_proxy._serve_each(integer[], text, text, text, jsonb, jsonb, vector, jsonb, text, jsonb);
CREATE OR REPLACE FUNCTION memory_proxy._serve_each(
    on_parts integer[], prefetcheds jsonb[], read_projects text, write_projects text, api_key text,
    req jsonb, caps jsonb, query_embedding vector, hits jsonb, through text
)
RETURNS TABLE (part integer, doc jsonb)
LANGUAGE plproxy
SET search_path = pg_catalog, pg_temp
AS $$
    CLUSTER 'memory';
    SPLIT on_parts, prefetcheds;
    RUN ON on_parts;
    SELECT (on_parts)[1] AS part,
           memory_shard._serve(read_projects, write_projects, api_key, req, caps, query_embedding,
                               hits, through, (prefetcheds)[1]) AS doc;
$$;
COMMENT ON FUNCTION memory_proxy._serve_each(integer[], jsonb[], text, text, text, jsonb, jsonb, vector, jsonb, text) IS
    'memory._serve on the partitions on_parts at once (PL/Proxy SPLIT: each gets its own number and its own element of prefetcheds, its legs run before or NULL), each answer with the partition that gave it.';

CREATE OR REPLACE FUNCTION memory_proxy._serve_finish_each(
    on_parts integer[], states jsonb[], orders text[], reranks jsonb[],
    read_projects text, write_projects text, api_key text, req jsonb, caps jsonb,
    query_embedding vector
)
RETURNS TABLE (part integer, doc jsonb)
LANGUAGE plproxy
SET search_path = pg_catalog, pg_temp
AS $$
    CLUSTER 'memory';
    SPLIT on_parts, states, orders, reranks;
    RUN ON on_parts;
    SELECT (on_parts)[1] AS part,
           memory_shard._serve_finish(read_projects, write_projects, api_key, req, caps,
                                      (states)[1], query_embedding,
                                      ((orders)[1])::bigint[], (reranks)[1]) AS doc;
$$;
COMMENT ON FUNCTION memory_proxy._serve_finish_each(integer[], jsonb[], text[], jsonb[], text, text, text, jsonb, jsonb, vector) IS
    'memory._serve_finish on the partitions on_parts at once (PL/Proxy SPLIT), each with its own element of states, orders (a bigint[] as text: its own ids in the reranker''s order) and reranks ({"node_id": score} of its own ids), each answer with the partition that gave it.';

-- The form without each partition's prefetched legs (releases before them): gone.
DROP FUNCTION IF EXISTS memory_proxy._serve_parts(integer[], jsonb, jsonb, vector, jsonb, text, jsonb[], text[], jsonb[]);
CREATE OR REPLACE FUNCTION memory_proxy._serve_parts(
    parts integer[], req jsonb, caps jsonb, query_embedding vector, hits jsonb, through text,
    states jsonb[] DEFAULT NULL, orders text[] DEFAULT NULL, reranks jsonb[] DEFAULT NULL,
    prefetcheds jsonb[] DEFAULT NULL,
    OUT answered integer[], OUT docs jsonb[], OUT missing integer[])
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record := memory_proxy._caller();
    i integer;
BEGIN
    -- memory._serve through => through, with prefetcheds[i] (through 'finish':
    -- memory._serve_finish with states[i], orders[i], reranks[i]) on each partition parts[i]:
    -- all at once, else (one is out of reach) each alone, to answer from the others and name
    -- the missing ones.
    prefetcheds := coalesce(prefetcheds, pg_catalog.array_fill(NULL::jsonb, ARRAY[coalesce(cardinality(parts), 0)]));
    answered := '{}';
    docs := '{}';
    missing := '{}';
    IF cardinality(parts) > 0 THEN
        BEGIN
            IF through = 'finish' THEN
                SELECT coalesce(array_agg(e.part ORDER BY e.part), '{}'), coalesce(array_agg(e.doc ORDER BY e.part), '{}')
                  INTO answered, docs
                  FROM memory_proxy._serve_finish_each(parts, states, orders, reranks, c.read_projects,
                           c.write_projects, c.api_key, req, caps, query_embedding) e;
            ELSE
                SELECT coalesce(array_agg(e.part ORDER BY e.part), '{}'), coalesce(array_agg(e.doc ORDER BY e.part), '{}')
                  INTO answered, docs
                  FROM memory_proxy._serve_each(parts, prefetcheds, c.read_projects, c.write_projects,
                           c.api_key, req, caps, query_embedding, hits, through) e;
            END IF;
            RETURN;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
        END;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(parts), 0) LOOP
        BEGIN
            IF through = 'finish' THEN
                docs := array_append(docs, memory_proxy._serve_finish_at(parts[i], NULL, req, caps,
                    states[i], query_embedding, orders[i]::bigint[], reranks[i]));
            ELSE
                -- SETOF: _serve is merged over partitions (one answer each)
                docs := array_append(docs, (SELECT d FROM memory_proxy._serve_at(parts[i], NULL, req, caps,
                    query_embedding, hits, through, prefetcheds[i]) d));
            END IF;
            answered := array_append(answered, parts[i]);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := array_append(missing, parts[i]);
        END;
    END LOOP;
    IF cardinality(answered) = 0 THEN
        PERFORM memory_proxy._none_reachable();
    END IF;
END $$;
COMMENT ON FUNCTION memory_proxy._serve_parts(integer[], jsonb, jsonb, vector, jsonb, text, jsonb[], text[], jsonb[], jsonb[]) IS
    'memory._serve (through, with prefetcheds[i]: the partition''s legs run before, or NULL) or, through => ''finish'', memory._serve_finish (with states[i], orders[i], reranks[i]) on each partition parts[i], all at once (memory_proxy._serve_each, _serve_finish_each) unless one is out of reach: the partitions that answered, their documents, and those out of reach (08006 when all are).';

CREATE OR REPLACE FUNCTION memory_proxy._merge_candidates(parts integer[], docs jsonb[], missing integer[])
RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Every partition's fused candidates with global node ids, the final_k best over all
    -- (final_k: the rerank depth the service asked; ordered as memory_proxy._merge_docs
    -- orders results, by the final score memory._finish would give each, ties by the
    -- semantic score and each partition's own order), and their texts. The state the
    -- service passes back: that list, each partition's own state without its candidates
    -- (memory._serve_finish takes them from the list), the partitions out of reach, k.
    WITH d AS (
        SELECT x.part, x.doc FROM unnest(parts, docs) AS x(part, doc)
    ), f AS (
        SELECT d.part, e.v, memory_proxy._global_id(d.part, (e.v ->> 'node_id')::bigint) AS gid,
               d.doc -> 'texts' -> (e.v ->> 'node_id') AS text,
               row_number() OVER (
                   ORDER BY (CASE WHEN d.doc -> 'plan' ->> 'search_strategy' = 'LexicalOnly' THEN e.v -> 'scores' ->> 1
                                  WHEN d.doc -> 'plan' ->> 'search_strategy' = 'SemanticOnly'
                                       OR e.v ->> 'fusion_method' = 'cascade' THEN e.v -> 'scores' ->> 0
                                  ELSE e.v ->> 'fused_score' END)::float8 DESC NULLS LAST,
                            (e.v -> 'scores' ->> 0)::float8 DESC NULLS LAST, e.o, d.part) AS n
        FROM d, jsonb_array_elements(d.doc -> 'state' -> 'fused') WITH ORDINALITY AS e(v, o)
    ), top AS (
        SELECT * FROM f WHERE f.n <= coalesce((docs[1] -> 'plan' ->> 'final_k')::integer, f.n)
    )
    SELECT jsonb_build_object(
        'plan', docs[1] -> 'plan',
        'state', jsonb_build_object(
            'fused', (SELECT coalesce(jsonb_agg(t.v || jsonb_build_object('node_id', t.gid) ORDER BY t.n), '[]') FROM top t),
            'partitions', (SELECT coalesce(jsonb_agg(jsonb_build_object('part', d.part, 'state', (d.doc -> 'state') - 'fused')
                                                     ORDER BY d.part), '[]') FROM d),
            'missing', to_jsonb(missing),
            'k', docs[1] -> 'plan' -> 'k'),
        'texts', (SELECT coalesce(jsonb_object_agg(t.gid::text, t.text), '{}') FROM top t WHERE t.text IS NOT NULL));
$$;
COMMENT ON FUNCTION memory_proxy._merge_candidates(integer[], jsonb[], integer[]) IS
    'The candidates document of several partitions'' memory._serve through => ''candidates'' (parts[i] gave docs[i]) for a reranker: the first plan; state {fused: the final_k best candidates over all, node ids global (memory_proxy._global_id), partitions: [{part, state without fused}], missing, k}; texts by global id.';

CREATE OR REPLACE FUNCTION memory._serve(
    req jsonb, caps jsonb, query_embedding vector, hits jsonb DEFAULT NULL,
    through text DEFAULT 'answer', prefetched jsonb DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    project text := req ->> 'project';
    parts integer[];
    own jsonb[];
    got record;
BEGIN
    caps := memory_proxy._caps(caps);
    IF project IS NULL THEN
        parts := memory_proxy._route(NULL, caps ->> 'read_projects');
        IF through = 'semantic' THEN
            -- Each partition's semantic leg, run while the service calls OpenSearch (all at
            -- once), by partition: the query statement gives each partition its own back.
            got := memory_proxy._serve_parts(parts, req, caps, query_embedding, NULL, through);
            RETURN jsonb_build_object('partitions', coalesce(
                (SELECT jsonb_object_agg(x.part::text, x.doc) FROM unnest(got.answered, got.docs) AS x(part, doc)),
                '{}'));
        END IF;
        -- Each partition's own prefetched legs (those of through => 'semantic'), or none.
        own := ARRAY(SELECT prefetched -> 'partitions' -> (u.p::text)
                     FROM unnest(parts) WITH ORDINALITY AS u(p, o) ORDER BY u.o);
        IF through = 'candidates' THEN
            -- For a reranker over every partition: the candidates with global node ids.
            got := memory_proxy._serve_parts(parts, req, caps, query_embedding, hits, through,
                                              prefetcheds => own);
            RETURN memory_proxy._merge_candidates(got.answered, got.docs, got.missing);
        ELSIF jsonb_typeof(prefetched -> 'partitions') = 'object' THEN
            got := memory_proxy._serve_parts(parts, req, caps, query_embedding, hits, through,
                                              prefetcheds => own);
            RETURN memory_proxy._merge_docs(got.docs, got.missing,
                coalesce((got.docs[1] -> 'plan' ->> 'k')::integer, (req ->> 'k')::integer));
        END IF;
        prefetched := NULL;
    END IF;
    -- Without a project: every partition holding the caller's projects (all at once for *).
    got := memory_proxy._serve_gather(project, memory_proxy._route(project, caps ->> 'read_projects'),
        req, caps, query_embedding, hits, through, prefetched);
    IF project IS NOT NULL THEN
        RETURN got.got[1];
    END IF;
    -- k as the partitions' plans read it (memory.check_k's default when req names none).
    RETURN memory_proxy._merge_docs(got.got, got.missing,
        coalesce((got.got[1] -> 'plan' ->> 'k')::integer, (req ->> 'k')::integer));
END $$;
COMMENT ON FUNCTION memory._serve(jsonb, jsonb, vector, jsonb, text, jsonb) IS
    'memory._serve of the partitions through PL/Proxy: with req.project, on the partition holding it (08006 when out of reach); without, on every partition holding the caller''s projects (all at once for *), their answers merged by memory_proxy._merge_docs with the unreachable ones named in degraded. Without a project, through => ''semantic'' runs every partition''s semantic leg (while the service calls OpenSearch) and answers {"partitions": {"<partition>": its prefetched legs}}, which prefetched gives back, each partition its own (memory_proxy._serve_parts); through => ''candidates'' (a reranker) gathers every partition''s candidates with global node ids (memory_proxy._merge_candidates).';

CREATE OR REPLACE FUNCTION memory._serve_finish(
    req jsonb, caps jsonb, state jsonb, query_embedding vector, result_order bigint[], rerank jsonb
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    project text := req ->> 'project';
    parts integer[];
    states jsonb[];
    orders text[];
    reranks jsonb[];
    got record;
BEGIN
    caps := memory_proxy._caps(caps);
    IF project IS NOT NULL THEN
        RETURN memory_proxy._serve_finish_at(memory_proxy.partition_of(project), project,
            req, caps, state, query_embedding, result_order, rerank);
    END IF;
    IF jsonb_typeof(state -> 'partitions') IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'state is not the candidates of memory._serve over the partitions'
            USING ERRCODE = '22023', HINT = 'Pass back the state memory._serve(..., through => ''candidates'') returned.';
    END IF;
    -- No order: the fused top k, as on one database.
    result_order := coalesce(result_order,
        ARRAY(SELECT (f.v ->> 'node_id')::bigint
              FROM jsonb_array_elements(state -> 'fused') WITH ORDINALITY AS f(v, o)
              ORDER BY f.o LIMIT (state ->> 'k')::integer));
    -- Each partition: its own state, its candidates (own ids, in the merged order), its
    -- own ids of the reranker's order and its own scores.
    SELECT array_agg(p.part ORDER BY p.part),
           array_agg(p.st || jsonb_build_object('fused', coalesce(
               (SELECT jsonb_agg(f.v || jsonb_build_object('node_id', l.id) ORDER BY f.o)
                FROM jsonb_array_elements(state -> 'fused') WITH ORDINALITY AS f(v, o),
                     memory_proxy._local_id((f.v ->> 'node_id')::bigint) l
                WHERE l.part = p.part), '[]')) ORDER BY p.part),
           array_agg(ARRAY(SELECT l.id
                           FROM unnest(result_order) WITH ORDINALITY AS r(g, o), memory_proxy._local_id(r.g) l
                           WHERE l.part = p.part ORDER BY r.o)::text ORDER BY p.part),
           array_agg(CASE WHEN jsonb_typeof(rerank) = 'object' THEN
               (SELECT coalesce(jsonb_object_agg(l.id::text, e.value), '{}')
                FROM jsonb_each(rerank) e, memory_proxy._local_id(e.key::bigint) l
                WHERE l.part = p.part) END ORDER BY p.part)
      INTO parts, states, orders, reranks
      FROM (SELECT (x ->> 'part')::integer AS part, x -> 'state' AS st
            FROM jsonb_array_elements(state -> 'partitions') x) p;
    got := memory_proxy._serve_parts(coalesce(parts, '{}'), req, caps, query_embedding, NULL, 'finish',
                                      states, orders, reranks);
    -- Out of reach: the partitions the candidates missed, and those that went since.
    RETURN memory_proxy._merge_docs(got.docs,
        ARRAY(SELECT DISTINCT m FROM unnest(ARRAY(SELECT jsonb_array_elements_text(coalesce(state -> 'missing', '[]'))::integer)
                                            || got.missing) m ORDER BY m),
        NULL, got.answered, result_order);
END $$;
COMMENT ON FUNCTION memory._serve_finish(jsonb, jsonb, jsonb, vector, bigint[], jsonb) IS
    'memory._serve_finish through PL/Proxy, after a reranker: with req.project, on the partition holding it; without, state is memory._serve''s candidates over the partitions (memory_proxy._merge_candidates): result_order and rerank (global node ids) are split by partition (memory_proxy._local_id), each partition finishes its own in the reranker''s order (all at once, memory_proxy._serve_parts), and the documents are merged in that order by memory_proxy._merge_docs (results ranked 1.. by result_order, node_id each partition''s own, evidence concatenated, counts summed, the partitions out of reach in degraded).';

CREATE OR REPLACE FUNCTION memory._get_node(p_id text, p_project text, p_projects text[])
RETURNS SETOF memory.node_row
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    found memory.node_row[] := '{}';
    missing integer[] := '{}';
    part integer;
BEGIN
    IF p_project IS NOT NULL THEN
        RETURN QUERY SELECT * FROM memory_proxy._get_node_at(memory_proxy.partition_of(p_project),
            p_project, p_id, p_project, p_projects);
        RETURN;
    END IF;
    -- No project: the id must name one node among the readable projects of every
    -- partition they are on (the API key's, else all).
    FOREACH part IN ARRAY memory_proxy._targets(
            coalesce(array_to_string(p_projects, ','), (memory_proxy._caller()).read_projects)) LOOP
        BEGIN
            found := found || ARRAY(SELECT r FROM memory_proxy._get_node_at(part, NULL, p_id, p_project, p_projects) r);
        EXCEPTION
            WHEN SQLSTATE 'PM444' THEN NULL;
            WHEN OTHERS THEN
                IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
                missing := missing || part;
        END;
    END LOOP;
    IF cardinality(found) = 0 AND cardinality(missing) > 0 THEN
        RAISE EXCEPTION 'no node with id "%" on the reachable partitions; partitions % are unreachable', p_id, missing
            USING ERRCODE = '08006', HINT = 'Name its project, or retry once they are back (`poimen-memory shard status`).';
    ELSIF cardinality(found) = 0 THEN
        RAISE EXCEPTION 'no node with id "%"', p_id USING ERRCODE = 'PM444',
            HINT = 'Ids are the ones given at ingest (external_id), unique per project.';
    ELSIF cardinality(found) > 1 THEN
        RAISE EXCEPTION 'id "%" names nodes in % projects', p_id, cardinality(found)
            USING ERRCODE = 'PMA09',
                  DETAIL = format('Projects: %s.', (SELECT string_agg(f.project, ', ' ORDER BY f.project) FROM unnest(found) f)),
                  HINT = 'Name the project (project => ...): ids are unique per project.';
    END IF;
    RETURN QUERY SELECT * FROM unnest(found);
END $$;
COMMENT ON FUNCTION memory._get_node(text, text, text[]) IS
    'memory._get_node of the partitions through PL/Proxy (GET /memory/nodes/{id}): with a project, on the partition holding it; without, on each partition of the readable projects (PM444 when none has it, PMA09 when several projects do, 08006 when none has it and some are out of reach).';

CREATE OR REPLACE FUNCTION memory._stored_nodes(projects text[], external_ids text[])
RETURNS TABLE (project text, external_id text, id bigint, level text, sha256 bytea, revision integer)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT memory_proxy.partition_of(x.p) AS part, min(x.p) AS first_project,
               array_agg(x.p ORDER BY x.i) AS ps, array_agg(x.e ORDER BY x.i) AS es
        FROM unnest(projects, external_ids) WITH ORDINALITY AS x(p, e, i)
        WHERE x.p IS NOT NULL
        GROUP BY 1 ORDER BY 1
    LOOP
        RETURN QUERY SELECT * FROM memory_proxy._stored_nodes_at(g.part, g.first_project, g.ps, g.es);
    END LOOP;
END $$;
COMMENT ON FUNCTION memory._stored_nodes(text[], text[]) IS
    'memory._stored_nodes of the partitions through PL/Proxy: the (project, id) pairs grouped by the partition of their project (08006 when one is out of reach). Ids (id) are each partition''s own.';

CREATE OR REPLACE FUNCTION memory._stored_hashes(hashes bytea[])
RETURNS TABLE (sha256 bytea, id bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record := memory_proxy._caller();
    shas bytea[];
    ids bigint[];
    part integer;
BEGIN
    -- A hash names its project (and id), so it is current on one partition at most; it
    -- carries no project, so every partition is asked. One out of reach is skipped: a node
    -- of its projects can only be written there, which then fails (08006).
    BEGIN
        SELECT array_agg(s.sha256), array_agg(s.id) INTO shas, ids
        FROM memory_proxy._stored_hashes_all(c.read_projects, c.write_projects, c.api_key, hashes) s;
    EXCEPTION WHEN OTHERS THEN
        IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
        shas := '{}';
        ids := '{}';
        FOR part IN 0 .. memory_proxy.partitions() - 1 LOOP
            BEGIN
                SELECT shas || coalesce(array_agg(s.sha256), '{}'), ids || coalesce(array_agg(s.id), '{}')
                  INTO shas, ids
                  FROM memory_proxy._stored_hashes_at(part, NULL, hashes) s;
            EXCEPTION WHEN OTHERS THEN
                IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            END;
        END LOOP;
    END;
    RETURN QUERY SELECT * FROM unnest(shas, ids);
END $$;
COMMENT ON FUNCTION memory._stored_hashes(bytea[]) IS
    'memory._stored_hashes of every partition through PL/Proxy (a hash is current on one partition at most); partitions out of reach are skipped.';

CREATE OR REPLACE FUNCTION memory.configure_embedding(model text, dim integer)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    part integer;
    answered integer := 0;
BEGIN
    -- Every partition records the model (PM409 from any that has another). One out of reach
    -- is skipped: writes to it fail meanwhile, and the first after it is back records it.
    FOR part IN 0 .. memory_proxy.partitions() - 1 LOOP
        BEGIN
            PERFORM memory_proxy.configure_embedding_at(part, NULL, model, dim);
            answered := answered + 1;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
        END;
    END LOOP;
    IF answered = 0 THEN
        PERFORM memory_proxy._none_reachable();
    END IF;
END $$;
COMMENT ON FUNCTION memory.configure_embedding(text, integer) IS
    'memory.configure_embedding on every reachable partition through PL/Proxy (the service calls it before each write).';

CREATE OR REPLACE FUNCTION memory._write_nodes(
    nodes jsonb,
    embeddings vector[] DEFAULT NULL,
    embed boolean DEFAULT false
)
RETURNS jsonb
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory_proxy._write(nodes, embeddings, embed, '_write_nodes');
COMMENT ON FUNCTION memory._write_nodes(jsonb, vector[], boolean) IS
    'memory._write_nodes of the partitions through PL/Proxy (POST /memory/nodes): the nodes and their vectors grouped by the partition of their project, one call (all or nothing) per partition, the answers merged in input order (unresolved numbered over the whole batch) and the counts summed; waits while a partition it writes is being moved, 08006 when one is out of reach. node_id is each partition''s own.';

CREATE OR REPLACE FUNCTION memory._count_nodes(
    p_project text, p_level text, p_source text, p_since text, p_until text,
    p_filter jsonb, p_projects text[]
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record := memory_proxy._caller();
    part integer;
    total bigint := 0;
BEGIN
    FOREACH part IN ARRAY memory_proxy._route(
            p_project, coalesce(array_to_string(p_projects, ','), c.read_projects)) LOOP
        BEGIN
            total := total + (SELECT n FROM memory_proxy._count_nodes_on(part, c.read_projects,
                c.write_projects, c.api_key, p_project, p_level, p_source, p_since, p_until,
                p_filter, p_projects) n);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            PERFORM memory_proxy._down(part, coalesce(p_project, array_to_string(p_projects, ',')), SQLERRM);
        END;
    END LOOP;
    RETURN total;
END $$;
COMMENT ON FUNCTION memory._count_nodes(text, text, text, text, text, jsonb, text[]) IS
    'memory._count_nodes summed over the partitions of the project (or of the readable projects), through PL/Proxy; 08006 when one is out of reach (a count must not be short).';

-- ---------------------------------------------------------------------------------------
-- Pages over several partitions (docs/scaling.md#the-http-service-over-the-proxy): a page
-- of nodes naming no project (GET /memory/nodes, memory._list_nodes) and the review queue
-- (GET /memory/review, POST /memory/review/claim and .../confirm: memory.review_list,
-- review_claim, review_confirm).
--
-- A page of nodes over several partitions walks them in ascending partition order, each in
-- its own order (node ids, newest first with p_newest_first: there is no write order across
-- partitions), filling the page from the next partition when one runs out. Its cursor names
-- the partition and that partition's own cursor (memory_proxy._list_cursor). A named
-- project, or readable projects all on one partition, pages as that one database does,
-- with its own cursors.
--
-- A review item's id through the proxy is global (memory_proxy._global_id), so that ids
-- are unique over the partitions and a keyset over them pages every partition at once;
-- its other ids (node_id) are each partition's own, as a query row's.
--
-- A partition out of reach fails a page (08006): a page that skipped one would move the
-- cursor past its rows for the rest of the walk.

CREATE OR REPLACE FUNCTION memory_proxy._down_over(part integer, why text, message text)
RETURNS void
-- VOLATILE: it only raises, and must never be folded into a plan as a constant.
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- 08006 (connection_failure): the service answers 503, as memory_proxy._down.
    RAISE EXCEPTION 'partition % is unreachable: %', part, why
        USING ERRCODE = '08006', DETAIL = message,
              HINT = '`poimen-memory shard status` names its server; retry once it is back (a project on another partition answers meanwhile).';
END $$;
COMMENT ON FUNCTION memory_proxy._down_over(integer, text, text) IS
    'Raises the typed error (08006, HTTP 503) of a partition out of reach that a call naming no project cannot do without (a page over several partitions, a review item of that partition); why says what it held.';

CREATE OR REPLACE FUNCTION memory_proxy._list_cursor(part integer, inner_cursor text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- URL-safe base64 without padding or line breaks, as a partition's own cursors.
RETURN pg_catalog.translate(pg_catalog.encode(pg_catalog.convert_to(
    'p1:' || part::text || ':' || inner_cursor, 'UTF8'), 'base64'), E'+/=\n', '-_');
COMMENT ON FUNCTION memory_proxy._list_cursor(integer, text) IS
    'The opaque cursor of a row of a page of nodes over several partitions: URL-safe base64 of p1:<partition>:<that partition''s own cursor> (memory_proxy._list_after reads it).';

CREATE OR REPLACE FUNCTION memory_proxy._list_after(cursor text, OUT part integer, OUT inner_cursor text)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    raw text;
    padded text := pg_catalog.translate(cursor, '-_', '+/');
    m text[];
BEGIN
    IF cursor IS NULL OR cursor = '' THEN
        RETURN;  -- from the start: part and inner_cursor NULL
    END IF;
    BEGIN
        padded := padded || pg_catalog.repeat('=', (4 - pg_catalog.length(padded) % 4) % 4);
        raw := pg_catalog.convert_from(pg_catalog.decode(padded, 'base64'), 'UTF8');
    EXCEPTION WHEN OTHERS THEN
        raw := NULL;
    END;
    m := pg_catalog.regexp_match(raw, '^p1:([0-9]{1,4}):([A-Za-z0-9_-]{1,200})$');
    IF m IS NULL OR m[1]::integer >= memory_proxy.partitions() THEN
        -- 22023 (HTTP 400), as a partition's memory._node_after.
        RAISE EXCEPTION 'after is not a cursor of a listing over several partitions: %', pg_catalog.left(cursor, 40)
            USING ERRCODE = '22023',
                  HINT = 'Pass the next_cursor (HTTP) or the cursor of the last row (SQL) of the previous page of the same listing (a listing of one project has cursors of its own).';
    END IF;
    part := m[1]::integer;
    inner_cursor := m[2];
END $$;
COMMENT ON FUNCTION memory_proxy._list_after(text) IS
    'The partition and that partition''s own cursor behind a cursor of memory_proxy._list_cursor (22023 for anything else, or a partition this proxy does not have); NULL or empty: from the start.';

CREATE OR REPLACE FUNCTION memory._list_nodes(
    p_project text, p_level text, p_source text, p_since text, p_until text, p_after text,
    p_limit integer, p_projects text[], p_filter jsonb DEFAULT NULL,
    p_newest_first boolean DEFAULT false
)
RETURNS SETOF memory.node_list_row
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record := memory_proxy._caller();
    targets integer[];
    part integer;
    start record;
    want integer := p_limit;
    got memory.node_list_row[];
    r memory.node_list_row;
BEGIN
    targets := memory_proxy._route(p_project, coalesce(array_to_string(p_projects, ','), c.read_projects));
    IF cardinality(targets) = 1 THEN
        -- One partition (a project named, or the readable projects all on it): its own
        -- pages and cursors, as one database answers them.
        part := targets[1];
        BEGIN
            RETURN QUERY SELECT * FROM memory_proxy._list_nodes_on(part, c.read_projects,
                c.write_projects, c.api_key, p_project, p_level, p_source, p_since, p_until, p_after,
                p_limit, p_projects, p_filter, p_newest_first);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            PERFORM memory_proxy._down(part, coalesce(p_project, array_to_string(p_projects, ',')), SQLERRM);
        END;
        RETURN;
    END IF;
    -- Several: the partitions in ascending order from the cursor's, each from its own
    -- cursor (the cursor's partition) or its start (the next ones), until the page is full.
    -- The first call checks the arguments (limit 1..100, level, dates) as one database.
    start := memory_proxy._list_after(p_after);
    FOREACH part IN ARRAY targets LOOP
        CONTINUE WHEN part < coalesce(start.part, -1);
        BEGIN
            got := ARRAY(SELECT x FROM memory_proxy._list_nodes_at(part, NULL, p_project, p_level,
                p_source, p_since, p_until, CASE WHEN part = start.part THEN start.inner_cursor END,
                want, p_projects, p_filter, p_newest_first) x);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            PERFORM memory_proxy._down_over(part, 'a page of nodes over several partitions does not skip one', SQLERRM);
        END;
        FOREACH r IN ARRAY got LOOP
            r.cursor := memory_proxy._list_cursor(part, r.cursor);
            RETURN NEXT r;
        END LOOP;
        want := want - cardinality(got);
        EXIT WHEN want <= 0;
    END LOOP;
END $$;
COMMENT ON FUNCTION memory._list_nodes(text, text, text, text, text, text, integer, text[], jsonb, boolean) IS
    'memory._list_nodes through PL/Proxy (GET /memory/nodes): with a project, or readable projects all on one partition, that partition''s page and its own cursors; over several partitions, a page walking them in ascending partition order, each in its own order (node ids; newest first with p_newest_first), filled from the next when one runs out, each row''s cursor URL-safe base64 of p1:<partition>:<that partition''s cursor> (memory_proxy._list_cursor; 22023 for a malformed one). 08006 when a partition the page needs is out of reach (a page never skips one). node_id is each partition''s own.';

CREATE OR REPLACE FUNCTION memory_proxy._local_after(after bigint, part integer)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- A partition's items with global ids above after are those with local ids above
-- floor((after - part) / @proxy.max_partitions@) (memory_proxy._global_id keeps the order).
RETURN pg_catalog.floor((after - part)::numeric / @proxy.max_partitions@)::bigint;
COMMENT ON FUNCTION memory_proxy._local_after(bigint, integer) IS
    'The bound of partition part''s own ids above which its rows have global ids (memory_proxy._global_id) above after; NULL for NULL.';

CREATE OR REPLACE FUNCTION memory_proxy._review_global(part integer, items memory.review_item[])
RETURNS SETOF memory.review_item
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r memory.review_item;
BEGIN
    FOREACH r IN ARRAY items LOOP
        r.item_id := memory_proxy._global_id(part, r.item_id);
        RETURN NEXT r;
    END LOOP;
END $$;
COMMENT ON FUNCTION memory_proxy._review_global(integer, memory.review_item[]) IS
    'Partition part''s review items as the proxy hands them out: item_id global (memory_proxy._global_id), the rest (node_id among them) the partition''s own.';

CREATE OR REPLACE FUNCTION memory.review_list(
    project text DEFAULT NULL, "limit" integer DEFAULT 50, after bigint DEFAULT NULL
)
RETURNS SETOF memory.review_item
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    part integer;
    got memory.review_item[] := '{}';
BEGIN
    IF project IS NOT NULL THEN
        part := memory_proxy.partition_of(project);
        RETURN QUERY SELECT * FROM memory_proxy._review_global(part, ARRAY(
            SELECT x FROM memory_proxy.review_list_at(part, project, project, "limit",
                                                      memory_proxy._local_after(after, part)) x));
        RETURN;
    END IF;
    -- Every partition of the readable projects, each its first items above after, merged:
    -- the "limit" smallest global ids (each partition's first "limit" hold them all).
    FOREACH part IN ARRAY memory_proxy._targets((memory_proxy._caller()).read_projects) LOOP
        BEGIN
            got := got || ARRAY(SELECT g FROM memory_proxy._review_global(part, ARRAY(
                SELECT x FROM memory_proxy.review_list_at(part, NULL, NULL, "limit",
                                                          memory_proxy._local_after(after, part)) x)) g);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            PERFORM memory_proxy._down_over(part, 'a page of the review queue over several partitions does not skip one', SQLERRM);
        END;
    END LOOP;
    RETURN QUERY SELECT * FROM unnest(got) u ORDER BY u.item_id LIMIT "limit";
END $$;
COMMENT ON FUNCTION memory.review_list(text, integer, bigint) IS
    'memory.review_list of the partitions through PL/Proxy, oldest first per partition and keyset-paged by global item ids (memory_proxy._global_id: the partition''s id * @proxy.max_partitions@ + partition; after is one of them): with project, on the partition holding it; without, on every partition of the readable projects, the "limit" smallest ids above after. 08006 when a partition the page needs is out of reach (a page never skips one). node_id is each partition''s own.';

CREATE OR REPLACE FUNCTION memory.review_claim(
    project text DEFAULT NULL, "limit" integer DEFAULT 1, visibility_timeout integer DEFAULT 300
)
RETURNS SETOF memory.review_item
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    part integer;
    parts integer[];
    skip integer;
    want integer := "limit";
    got memory.review_item[] := '{}';
    missing integer[] := '{}';
BEGIN
    IF project IS NOT NULL THEN
        part := memory_proxy.partition_of(project);
        -- A claim writes (vt, claims): it waits while `shard move` copies the partition,
        -- as every write does, so that it lands on the copy the move switches to.
        PERFORM memory_proxy._write_lock(part);
        RETURN QUERY SELECT * FROM memory_proxy._review_global(part, ARRAY(
            SELECT x FROM memory_proxy.review_claim_at(part, project, project, "limit", visibility_timeout) x));
        RETURN;
    END IF;
    -- The partitions of the readable projects in turn, from a random one (so that no
    -- partition's items wait behind another's), until "limit" items are claimed. Each
    -- partition's claim commits on its own (a PL/Proxy call): a claim over several is not
    -- atomic, and an error after the first leaves its items claimed, hidden from other
    -- workers until visibility_timeout passes (then they come back, as an unfinished claim's).
    -- A partition out of reach is skipped (a WARNING names it): a claim takes what is ready.
    parts := memory_proxy._targets((memory_proxy._caller()).read_projects);
    skip := floor(random() * cardinality(parts))::integer;
    parts := parts[skip + 1:] || parts[:skip];
    FOREACH part IN ARRAY parts LOOP
        BEGIN
            PERFORM memory_proxy._write_lock(part);
            got := got || ARRAY(SELECT g FROM memory_proxy._review_global(part, ARRAY(
                SELECT x FROM memory_proxy.review_claim_at(part, NULL, NULL, want, visibility_timeout) x)) g);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
            CONTINUE;
        END;
        want := "limit" - cardinality(got);
        EXIT WHEN want <= 0;
    END LOOP;
    IF cardinality(missing) = cardinality(parts) THEN
        PERFORM memory_proxy._none_reachable();
    ELSIF cardinality(missing) > 0 THEN
        RAISE WARNING 'degraded: partitions % are unreachable; nothing was claimed there', missing
            USING HINT = '`poimen-memory shard status` names their servers.';
    END IF;
    -- As one database orders a claim: L1 before L2, then the oldest.
    RETURN QUERY SELECT * FROM unnest(got) u ORDER BY u.level, u.enqueued_at, u.item_id;
END $$;
COMMENT ON FUNCTION memory.review_claim(text, integer, integer) IS
    'memory.review_claim of the partitions through PL/Proxy, item ids global (memory_proxy._global_id): with project, on the partition holding it (08006 when out of reach); without, the partitions of the readable projects in turn from a random one until limit items are claimed, returned L1 before L2, oldest first. Each partition''s claim commits on its own: a claim over several partitions is not atomic (an error after the first leaves its items hidden until visibility_timeout passes); one out of reach is skipped with a WARNING (08006 when all are). node_id is each partition''s own.';

CREATE OR REPLACE FUNCTION memory.review_confirm(item_id bigint, note text DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    loc record := memory_proxy._local_id(item_id);
    res jsonb;
    st text;
    msg text;
    det text;
    hnt text;
BEGIN
    IF item_id IS NULL OR loc.part NOT BETWEEN 0 AND memory_proxy.partitions() - 1 THEN
        RAISE EXCEPTION 'no open review item %', coalesce(item_id::text, 'NULL')
            USING ERRCODE = @vocabulary.sqlstate_unknown_review_item@,
                  HINT = 'memory.review_list shows the open items (their item_id, global through the proxy).';
    END IF;
    PERFORM memory_proxy._write_lock(loc.part);
    BEGIN
        res := memory_proxy.review_confirm_at(loc.part, NULL, loc.id, note);
    EXCEPTION WHEN OTHERS THEN
        IF memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN
            PERFORM memory_proxy._down_over(loc.part, pg_catalog.format('it holds review item %s', item_id), SQLERRM);
        END IF;
        -- The partition's own ids in what it said, as global ones (PL/Proxy prefixes the
        -- remote message, detail and hint: the partition's words are kept alone).
        GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT,
                                det = PG_EXCEPTION_DETAIL, hnt = PG_EXCEPTION_HINT;
        det := pg_catalog.regexp_replace(det, '^Remote detail: ', '');
        hnt := pg_catalog.regexp_replace(hnt, '^Remote hint: ', '');
        IF st = @vocabulary.sqlstate_unknown_review_item@ THEN
            RAISE EXCEPTION 'no open review item %', item_id USING ERRCODE = st, HINT = hnt;
        END IF;
        IF det ~ '^Its review item is [0-9]+\.$' THEN
            RAISE EXCEPTION '%', pg_catalog.regexp_replace(msg, '^.*REMOTE ERROR: ', '')
                USING ERRCODE = st, HINT = hnt,
                      DETAIL = pg_catalog.format('Its review item is %s.', memory_proxy._global_id(loc.part,
                          (pg_catalog.regexp_match(det, '([0-9]+)'))[1]::bigint));
        END IF;
        RAISE;
    END;
    RETURN res || jsonb_build_object(
        'item_id', item_id,
        'resolved', (SELECT coalesce(jsonb_agg(memory_proxy._global_id(loc.part, (e.x #>> '{}')::bigint) ORDER BY e.ord), '[]')
                     FROM jsonb_array_elements(coalesce(res -> 'resolved', '[]')) WITH ORDINALITY AS e(x, ord)));
END $$;
COMMENT ON FUNCTION memory.review_confirm(bigint, text) IS
    'memory.review_confirm through PL/Proxy: item_id is a global id (memory_proxy._global_id), confirmed on its partition (the unknown_review_item SQLSTATE, HTTP 404, for an id of no partition this proxy has, as for no open item; 08006 when its partition is out of reach; waits while it is being moved); the answer''s item_id and resolved are global ids, node_id the partition''s own.';

CREATE OR REPLACE FUNCTION memory_proxy.health(
    OUT nodes bigint, OUT embedding_model text, OUT outbox_depth bigint,
    OUT outbox_lag_s double precision, OUT scale_warnings bigint,
    OUT partitions integer, OUT missing integer[])
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h record;
    o record;
    part integer;
BEGIN
    nodes := 0; scale_warnings := 0; outbox_depth := 0; outbox_lag_s := NULL;
    partitions := memory_proxy.partitions();
    missing := '{}';
    FOR part IN 0 .. partitions - 1 LOOP
        -- Both calls first, then the totals: a variable assigned inside the block is not
        -- rolled back when a later call there fails, so a partition lost between the two
        -- would count in the totals and in missing at once.
        BEGIN
            SELECT * INTO h FROM memory_proxy.health_at(part, NULL);
            SELECT * INTO o FROM memory_proxy.outbox_state_at(part, NULL);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
            CONTINUE;
        END;
        nodes := nodes + h.nodes;
        scale_warnings := scale_warnings + h.scale_warnings;
        embedding_model := coalesce(embedding_model, h.embedding_model);
        outbox_depth := outbox_depth + o.depth;
        outbox_lag_s := greatest(outbox_lag_s, o.lag_s);
    END LOOP;
END $$;
COMMENT ON FUNCTION memory_proxy.health() IS
    'What /healthz reads, over the partitions: nodes, scale warnings and OpenSearch outbox rows summed over the reachable ones (nodes under the asserted projects), the age of the oldest outbox row of any, the first one''s embedding model, the partitions and those out of reach.';

-- OpenSearch over the proxy (docs/opensearch.md#over-a-pl-proxy-proxy). One index holds
-- every partition's documents: their _id is the node's content hash, whose canonical form
-- holds the project (poimen_core.nodes.node_sha256), and a project lives on one partition,
-- so no two partitions write one document. Each partition queues its own changes (its
-- outbox, filled by its triggers); the service's drain (and `poimen-memory opensearch
-- sync`) reads them through the proxy a batch at a time, partition by partition, keyset-
-- paged by global row ids (memory_proxy._global_id), and acknowledges them on their
-- partition. A remote call is a transaction of its own on the partition, so a batch's rows
-- are not locked while OpenSearch takes them: two drainers over the proxy may send a batch
-- twice, which rewrites the same documents (delivery is at least once, as on one database).

CREATE OR REPLACE FUNCTION memory.enable_outbox()
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    part integer;
    missing integer[] := '{}';
BEGIN
    FOR part IN 0 .. memory_proxy.partitions() - 1 LOOP
        BEGIN
            PERFORM memory_proxy.enable_outbox_at(part, NULL);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
        END;
    END LOOP;
    -- Every partition, or an error: a partition whose triggers stayed off would never
    -- queue its changes (the service's drain tries again, with its backoff).
    IF cardinality(missing) > 0 THEN
        RAISE EXCEPTION 'partitions % are unreachable: their OpenSearch outbox is not switched on', missing
            USING ERRCODE = '08006', HINT = '`poimen-memory shard status` names their servers; the others are on.';
    END IF;
END $$;
COMMENT ON FUNCTION memory.enable_outbox() IS
    'memory.enable_outbox on every partition through PL/Proxy: their OpenSearch outbox triggers on (08006 naming the partitions out of reach, after switching on the others).';

CREATE OR REPLACE FUNCTION memory_proxy.outbox_batch(after bigint, lim integer)
RETURNS TABLE (row_id bigint, node_id bigint, op text, sha256 text, body text, title text,
               breadcrumb text[], source text, level text, project text)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    last record := memory_proxy._local_id(coalesce(after, 0));
    parts integer[] := memory_proxy._targets((memory_proxy._caller()).read_projects);
    part integer;
    want integer := lim;
    n integer;
    missing integer[] := '{}';
BEGIN
    -- Partition by partition, each in its own order: the rest of the queue of the partition
    -- after (the last row's global id of the batch before, 0 first) names, then the next
    -- partitions' from their start, until lim rows: one remote call a batch, mostly.
    FOREACH part IN ARRAY parts LOOP
        CONTINUE WHEN part < last.part;
        EXIT WHEN want <= 0;
        BEGIN
            RETURN QUERY
                SELECT memory_proxy._global_id(part, x.row_id), x.node_id, x.op, x.sha256, x.body,
                       x.title, x.breadcrumb, x.source, x.level, x.project
                FROM memory_proxy.outbox_batch_at(part, NULL,
                         CASE WHEN part = last.part THEN last.id ELSE 0 END, want) x;
            GET DIAGNOSTICS n = ROW_COUNT;
            want := want - n;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
        END;
    END LOOP;
    IF cardinality(missing) > 0 AND cardinality(missing) = cardinality(ARRAY(SELECT u FROM unnest(parts) u WHERE u >= last.part)) THEN
        PERFORM memory_proxy._none_reachable();
    ELSIF cardinality(missing) > 0 THEN
        RAISE WARNING 'degraded: partitions % are unreachable; their OpenSearch outbox waits', missing
            USING HINT = '`poimen-memory shard status` names their servers.';
    END IF;
END $$;
COMMENT ON FUNCTION memory_proxy.outbox_batch(bigint, integer) IS
    'The OpenSearch drain''s batch over the partitions (queries.sql outbox_batch_after_proxy): up to lim outbox rows, each with its node''s document (node_id the partition''s own) and a global row id (memory_proxy._global_id), partition by partition from the one after names (after: the last row id of the batch before, 0 first), each in its own order; not locked (a remote call ends its transaction); a WARNING names the partitions out of reach (08006 when all it asked are).';

CREATE OR REPLACE FUNCTION memory_proxy._outbox_each(ids bigint[], error text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r record;
    n bigint := 0;
    missing integer[] := '{}';
BEGIN
    FOR r IN SELECT l.part, array_agg(l.id ORDER BY l.id) AS local_ids
             FROM unnest(ids) AS g(id), memory_proxy._local_id(g.id) l
             WHERE l.part BETWEEN 0 AND memory_proxy.partitions() - 1
             GROUP BY l.part ORDER BY l.part
    LOOP
        BEGIN
            -- Deletes and updates: they wait while `shard move` copies the partition.
            PERFORM memory_proxy._write_lock(r.part);
            n := n + CASE WHEN error IS NULL THEN memory_proxy.outbox_done_at(r.part, NULL, r.local_ids)
                          ELSE memory_proxy.outbox_failed_at(r.part, NULL, r.local_ids, error) END;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || r.part;
        END;
    END LOOP;
    IF cardinality(missing) > 0 THEN
        -- The rows stay queued: the next run sends them again (the same documents).
        RAISE WARNING 'degraded: partitions % are unreachable; their outbox rows stay queued', missing
            USING HINT = '`poimen-memory shard status` names their servers.';
    END IF;
    RETURN n;
END $$;
COMMENT ON FUNCTION memory_proxy._outbox_each(bigint[], text) IS
    'The outbox rows ids (global, memory_proxy._global_id) on their partitions: deleted when error is NULL, else attempts + 1 and last_error; how many; a WARNING names the partitions out of reach, whose rows stay queued.';

CREATE OR REPLACE FUNCTION memory_proxy.outbox_done(ids bigint[])
RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory_proxy._outbox_each(ids, NULL);
COMMENT ON FUNCTION memory_proxy.outbox_done(bigint[]) IS
    'Deletes the outbox rows ids (global row ids of memory_proxy.outbox_batch) that OpenSearch acknowledged, on their partitions; how many (queries.sql outbox_done_proxy).';

CREATE OR REPLACE FUNCTION memory_proxy.outbox_failed(ids bigint[], error text)
RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory_proxy._outbox_each(ids, coalesce(error, 'failed'));
COMMENT ON FUNCTION memory_proxy.outbox_failed(bigint[], text) IS
    'Records a failed try (attempts + 1, last_error) on the outbox rows ids (global row ids of memory_proxy.outbox_batch), on their partitions; how many (queries.sql outbox_failed_proxy).';

CREATE OR REPLACE FUNCTION memory_proxy.outbox_state(
    OUT depth bigint, OUT lag_s double precision, OUT missing integer[])
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    o record;
    part integer;
BEGIN
    depth := 0;
    missing := '{}';
    FOR part IN 0 .. memory_proxy.partitions() - 1 LOOP
        BEGIN
            SELECT * INTO o FROM memory_proxy.outbox_state_at(part, NULL);
            depth := depth + o.depth;
            lag_s := greatest(lag_s, o.lag_s);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
        END;
    END LOOP;
END $$;
COMMENT ON FUNCTION memory_proxy.outbox_state() IS
    'The OpenSearch outbox over the partitions: rows queued on the reachable ones, the age of the oldest (seconds, NULL when none), and the partitions out of reach.';

CREATE OR REPLACE FUNCTION memory_proxy.opensearch_docs(after bigint, lim integer)
RETURNS TABLE (node_id bigint, sha256 text, body text, title text, breadcrumb text[],
               source text, level text, project text)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    last record := memory_proxy._local_id(coalesce(after, 0));
    part integer;
    want integer := lim;
    n integer;
BEGIN
    -- A page of `opensearch reindex`: partition by partition, each in node id order, from
    -- the partition after (the last node's global id of the page before, 0 first) names. One
    -- out of reach fails the page (a reindex that skipped it would lose its documents).
    FOR part IN last.part .. memory_proxy.partitions() - 1 LOOP
        EXIT WHEN want <= 0;
        BEGIN
            RETURN QUERY
                SELECT memory_proxy._global_id(part, x.node_id), x.sha256, x.body, x.title,
                       x.breadcrumb, x.source, x.level, x.project
                FROM memory_proxy.opensearch_docs_at(part, NULL,
                         CASE WHEN part = last.part THEN last.id ELSE 0 END, want) x;
            GET DIAGNOSTICS n = ROW_COUNT;
            want := want - n;
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            PERFORM memory_proxy._down_over(part, 'an OpenSearch reindex does not skip one', SQLERRM);
        END;
    END LOOP;
END $$;
COMMENT ON FUNCTION memory_proxy.opensearch_docs(bigint, integer) IS
    'A page of `poimen-memory opensearch reindex` over the partitions (queries.sql opensearch_docs_proxy): up to lim nodes as OpenSearch documents, node ids global (memory_proxy._global_id), partition by partition from the one after names (after: the last node id of the page before, 0 first), each in node id order; 08006 when a partition is out of reach.';

-- MCP's resources/read of a project: its summary from its partition.
CREATE OR REPLACE FUNCTION memory._project_summary(p_project text)
RETURNS TABLE (current jsonb, ended bigint, latest_write timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM memory_proxy._need_project(p_project, 'memory._project_summary names one project.');
    RETURN QUERY SELECT * FROM memory_proxy._project_summary_at(memory_proxy.partition_of(p_project),
                                                                 p_project, p_project);
END $$;
COMMENT ON FUNCTION memory._project_summary(text) IS
    'memory._project_summary through PL/Proxy (MCP''s resources/read): from the partition holding the project (PM404 from it for a project the caller cannot see; 08006 when it is out of reach).';

CREATE OR REPLACE FUNCTION memory_proxy.project_names()
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    part integer;
    missing integer[] := '{}';
BEGIN
    FOREACH part IN ARRAY memory_proxy._targets((memory_proxy._caller()).read_projects) LOOP
        BEGIN
            RETURN QUERY SELECT * FROM memory_proxy.project_names_at(part, NULL);
        EXCEPTION WHEN OTHERS THEN
            IF NOT memory_proxy._unreachable(SQLERRM, SQLSTATE) THEN RAISE; END IF;
            missing := missing || part;
        END;
    END LOOP;
    IF cardinality(missing) > 0 THEN
        RAISE WARNING 'degraded: partitions % are unreachable; their projects are not listed', missing
            USING HINT = '`poimen-memory shard status` names their servers.';
    END IF;
END $$;
COMMENT ON FUNCTION memory_proxy.project_names() IS
    'The names of the projects the caller may read, from each partition of its projects (a WARNING names those out of reach, whose projects are left out).';

-- The service reads project names from memory.projects (MCP's resources/list): here a view
-- of every partition's, under the caller's asserted projects. Only names: ids are each
-- partition's own.
CREATE OR REPLACE VIEW memory.projects AS
    SELECT n.name FROM memory_proxy.project_names() AS n(name);
COMMENT ON VIEW memory.projects IS
    'The projects of every reachable partition the caller may read (memory_proxy.project_names()): their names only.';
REVOKE ALL ON TABLE memory.projects FROM PUBLIC;
GRANT SELECT ON TABLE memory.projects TO @proxy.service@;

-- The API keys stay on the proxy: the service reads them before any call (keys_active),
-- and `poimen-memory keys` writes them where POIMEN_DATABASE_URL points. The same table
-- as a single database's (migrations 0005, 0021); owner-only but for the service's SELECT.
CREATE TABLE IF NOT EXISTS memory.api_keys (
    id           integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_hash     bytea NOT NULL UNIQUE CHECK (length(key_hash) = 32),
    prefix       text NOT NULL,
    projects     text[] NOT NULL CHECK (cardinality(projects) > 0),
    can_write    boolean NOT NULL DEFAULT false,
    note         text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    set_aside_at timestamptz
);
COMMENT ON TABLE memory.api_keys IS
    'HTTP API keys of the service over the proxy (as a single database''s, migration 0005): SHA-256 of the key, its prefix, the projects it may read (and write, with can_write). The key''s id travels to the partitions as poimen.api_key (written_by api_key:<id>).';
REVOKE ALL ON TABLE memory.api_keys FROM PUBLIC;
GRANT SELECT ON TABLE memory.api_keys TO @proxy.service@;

-- On the default search_path, as on a partition (sql/079_aliases.sql); made above.
COMMENT ON FUNCTION public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text) IS
    'Alias of memory.query on the default search_path, as on a partition database.';

-- Grants: the proxy's service role calls the public functions; nobody else (PUBLIC's
-- EXECUTE is revoked on everything here, internals included).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
             WHERE p.pronamespace IN ('memory'::regnamespace, 'memory_proxy'::regnamespace)
                OR p.oid = 'public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text)'::regprocedure
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO @proxy.service@', f);
    END LOOP;
END $$;
REVOKE ALL ON TABLE memory_proxy.moves FROM PUBLIC;
GRANT SELECT ON TABLE memory_proxy.moves TO @proxy.service@;
