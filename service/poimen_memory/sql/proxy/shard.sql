-- On every partition database behind a PL/Proxy proxy (docs/scaling.md#pl-proxy): the
-- relays the proxy calls. A partition is a normal poimen-memory database (`poimen-memory
-- migrate` made it); this file adds schema memory_shard beside schema memory, applied by
-- `poimen-memory shard init | migrate` after migrate, so `migrate --check` on a partition
-- compares schema memory alone.
--
-- The caller's projects travel with the call: each relay takes the proxy caller's
-- poimen.read_projects, poimen.write_projects and poimen.api_key as its first three
-- arguments, sets them for the statement (set_config(..., true): PL/Proxy runs each remote
-- call as a statement of its own, so they end with it) and calls the public function of
-- the same name. Row-level security honours those settings only for members of this
-- database's @role.service@ (sql/015_policy.sql, sql/085_tenants.sql), and only that role
-- may execute a relay: the proxy's login role is made a member of it, and nobody else
-- gains anything here.
--
-- Each relay is made from its target's catalog entry (arguments, result), as the public
-- aliases are (sql/079_aliases.sql), so a relay can never disagree with what it calls.
-- Rendered markers: @role.service@ (the partition's service role).

CREATE SCHEMA IF NOT EXISTS memory_shard;
REVOKE ALL ON SCHEMA memory_shard FROM PUBLIC;
GRANT USAGE ON SCHEMA memory_shard TO @role.service@;
COMMENT ON SCHEMA memory_shard IS
    'Relays a PL/Proxy proxy calls (sql/proxy/shard.sql): the caller''s asserted projects, then the public function of the same name.';

CREATE OR REPLACE FUNCTION memory_shard._assert(read_projects text, write_projects text, api_key text)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- NULL from the proxy (a caller it does not trust) asserts nothing: the proxy's own
    -- role then sees only what is granted to it, which is nothing (docs/scaling.md).
    SELECT set_config('poimen.read_projects', coalesce(read_projects, ''), true),
           set_config('poimen.write_projects', coalesce(write_projects, ''), true),
           set_config('poimen.api_key', coalesce(api_key, ''), true);
$$;
COMMENT ON FUNCTION memory_shard._assert(text, text, text) IS
    'Sets the proxy caller''s poimen.read_projects, poimen.write_projects and poimen.api_key for the current statement (NULL: none).';
REVOKE ALL ON FUNCTION memory_shard._assert(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION memory_shard._assert(text, text, text) TO @role.service@;

DO $$
DECLARE
    f record;
    relay regprocedure;
    call text;
BEGIN
    FOR f IN
        SELECT p.oid, p.proname, p.pronargs, p.proargtypes
        FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'memory'::regnamespace
          AND p.proname IN ('query', 'answer', 'add_nodes', 'get_node', 'history', 'forget',
                            -- what the HTTP service calls beyond the public functions
                            -- (docs/scaling.md#the-http-service-over-the-proxy)
                            '_serve_start', '_serve', '_serve_finish', '_get_node',
                            '_write_nodes', '_stored_hashes', '_stored_nodes',
                            'configure_embedding', '_list_nodes', '_count_nodes',
                            -- the review queue (GET /memory/review, claim, confirm)
                            'review_list', 'review_claim', 'review_confirm',
                            -- MCP's resources/read of a project
                            '_project_summary')
    LOOP
        SELECT pg_catalog.string_agg('$' || (i + 3), ', ' ORDER BY i) INTO call
        FROM pg_catalog.generate_series(1, f.pronargs) AS i;
        EXECUTE pg_catalog.format(
            'CREATE OR REPLACE FUNCTION memory_shard.%I(read_projects text, write_projects text, '
            'api_key text, %s) RETURNS %s LANGUAGE sql VOLATILE PARALLEL UNSAFE '
            'SET search_path = pg_catalog, pg_temp AS %L',
            f.proname, pg_catalog.pg_get_function_identity_arguments(f.oid),
            pg_catalog.pg_get_function_result(f.oid),
            pg_catalog.format('SELECT memory_shard._assert($1, $2, $3); SELECT * FROM memory.%I(%s)',
                              f.proname, call));
        relay := pg_catalog.format('memory_shard.%I(text, text, text, %s)', f.proname,
                                   pg_catalog.oidvectortypes(f.proargtypes))::regprocedure;
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', relay);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO @role.service@', relay);
        EXECUTE pg_catalog.format('COMMENT ON FUNCTION %s IS %L', relay,
            pg_catalog.format('Relay of %s for the PL/Proxy proxy: the caller''s asserted projects (read, write, api key), then the call.',
                              f.oid::regprocedure));
    END LOOP;
END $$;

-- The HTTP service's /healthz over the proxy: this partition's totals under the asserted
-- projects (the service asserts '*' for them), as its health query reads a single database.
CREATE OR REPLACE FUNCTION memory_shard.health(read_projects text, write_projects text, api_key text)
RETURNS TABLE (nodes bigint, embedding_model text, scale_warnings bigint)
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    SELECT (SELECT count(*) FROM memory.nodes), (SELECT e.model FROM memory.embedding_model e),
           (SELECT count(*) FROM memory.scale_warnings());
$$;
COMMENT ON FUNCTION memory_shard.health(text, text, text) IS
    'For the proxy''s memory_proxy.health(): this partition''s node count (under the asserted projects), embedding model and scale warnings.';
REVOKE ALL ON FUNCTION memory_shard.health(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION memory_shard.health(text, text, text) TO @role.service@;

-- MCP's resources/list over the proxy (the service's project_names): the names of this
-- partition's projects the asserted projects may read.
CREATE OR REPLACE FUNCTION memory_shard.project_names(read_projects text, write_projects text, api_key text)
RETURNS SETOF text
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    SELECT p.name::text FROM memory.projects p;
$$;
COMMENT ON FUNCTION memory_shard.project_names(text, text, text) IS
    'For the proxy''s view memory.projects: the names of this partition''s projects, under the asserted projects (row-level security).';
REVOKE ALL ON FUNCTION memory_shard.project_names(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION memory_shard.project_names(text, text, text) TO @role.service@;

-- OpenSearch over the proxy (docs/opensearch.md#over-a-pl-proxy-proxy): the service's
-- drain and `poimen-memory opensearch sync | reindex` reach this partition's outbox and
-- nodes through these. Documents are keyed by content hash, whose canonical form holds the
-- project (poimen_core.nodes.node_sha256), and a project lives on one partition: every
-- partition's documents go into one index without colliding.
CREATE OR REPLACE FUNCTION memory_shard.enable_outbox(read_projects text, write_projects text, api_key text)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    SELECT memory.enable_outbox();
$$;
COMMENT ON FUNCTION memory_shard.enable_outbox(text, text, text) IS
    'For the proxy''s memory.enable_outbox(): switches this partition''s OpenSearch outbox triggers on.';

CREATE OR REPLACE FUNCTION memory_shard.outbox_batch(
    read_projects text, write_projects text, api_key text, after bigint, lim integer
)
RETURNS TABLE (row_id bigint, node_id bigint, op text, sha256 text, body text, title text,
               breadcrumb text[], source text, level text, project text)
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    -- The drain's batch (queries.sql outbox_batch_after) above this partition's own row id
    -- after. The row locks end with the remote call (a statement of its own here): they
    -- only keep rows a drainer on this database holds right now out of the batch.
    SELECT o.id, o.node_id, o.op, encode(coalesce(o.sha256, n.sha256), 'hex'), n.text,
           n.title, n.breadcrumb, n.source, n.level, p.name::text
    FROM memory.opensearch_outbox o
    LEFT JOIN memory.nodes n ON n.id = o.node_id
    LEFT JOIN memory.projects p ON p.id = n.project_id
    WHERE o.id > after
    ORDER BY o.id
    LIMIT lim
    FOR UPDATE OF o SKIP LOCKED;
$$;
COMMENT ON FUNCTION memory_shard.outbox_batch(text, text, text, bigint, integer) IS
    'For the proxy''s memory_proxy.outbox_batch: this partition''s first lim OpenSearch outbox rows above its own row id after, with their node''s document (as the drain''s outbox_batch_after reads them).';

CREATE OR REPLACE FUNCTION memory_shard.outbox_done(
    read_projects text, write_projects text, api_key text, ids bigint[]
)
RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    WITH d AS (DELETE FROM memory.opensearch_outbox o WHERE o.id = ANY (ids) RETURNING 1)
    SELECT count(*) FROM d;
$$;
COMMENT ON FUNCTION memory_shard.outbox_done(text, text, text, bigint[]) IS
    'For the proxy''s memory_proxy.outbox_done: deletes this partition''s outbox rows ids (OpenSearch acknowledged them); how many.';

CREATE OR REPLACE FUNCTION memory_shard.outbox_failed(
    read_projects text, write_projects text, api_key text, ids bigint[], error text
)
RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    WITH u AS (UPDATE memory.opensearch_outbox o SET attempts = o.attempts + 1, last_error = error
               WHERE o.id = ANY (ids) RETURNING 1)
    SELECT count(*) FROM u;
$$;
COMMENT ON FUNCTION memory_shard.outbox_failed(text, text, text, bigint[], text) IS
    'For the proxy''s memory_proxy.outbox_failed: attempts + 1 and last_error on this partition''s outbox rows ids; how many.';

CREATE OR REPLACE FUNCTION memory_shard.outbox_state(read_projects text, write_projects text, api_key text)
RETURNS TABLE (depth bigint, lag_s double precision)
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    SELECT count(*), extract(epoch FROM now() - min(o.enqueued_at))::double precision
    FROM memory.opensearch_outbox o;
$$;
COMMENT ON FUNCTION memory_shard.outbox_state(text, text, text) IS
    'For the proxy''s /healthz and /metrics: this partition''s OpenSearch outbox depth and the age of its oldest row in seconds (NULL when empty).';

CREATE OR REPLACE FUNCTION memory_shard.opensearch_docs(
    read_projects text, write_projects text, api_key text, after bigint, lim integer
)
RETURNS TABLE (node_id bigint, sha256 text, body text, title text, breadcrumb text[],
               source text, level text, project text)
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory_shard._assert(read_projects, write_projects, api_key);
    -- `opensearch reindex`'s documents (queries.sql opensearch_docs), a page at a time.
    SELECT n.id, encode(n.sha256, 'hex'), n.text, n.title, n.breadcrumb, n.source, n.level,
           p.name::text
    FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id
    WHERE n.id > after
    ORDER BY n.id
    LIMIT lim;
$$;
COMMENT ON FUNCTION memory_shard.opensearch_docs(text, text, text, bigint, integer) IS
    'For the proxy''s memory_proxy.opensearch_docs (`opensearch reindex`): this partition''s first lim nodes above its own node id after, as OpenSearch documents.';

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'memory_shard.enable_outbox(text, text, text)',
        'memory_shard.outbox_batch(text, text, text, bigint, integer)',
        'memory_shard.outbox_done(text, text, text, bigint[])',
        'memory_shard.outbox_failed(text, text, text, bigint[], text)',
        'memory_shard.outbox_state(text, text, text)',
        'memory_shard.opensearch_docs(text, text, text, bigint, integer)']::regprocedure[]
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO @role.service@', f);
    END LOOP;
END $$;
