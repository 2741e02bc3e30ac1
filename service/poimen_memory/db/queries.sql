-- Every SQL statement the Python code sends, by name (loaded by queries.py).
-- Retrieval logic lives in sql/; these are thin calls into it plus the write path.

-- name: configure_embedding
SELECT memory.configure_embedding(%(model)s, %(dim)s);

-- name: embedding_model
SELECT model, dim FROM memory.embedding_model;

-- name: ensure_projects
SELECT memory._ensure_projects(%(names)s::text[]);

-- name: projects_existing
-- Which of these projects exist already: a bulk ingest names the ones it made up front.
SELECT name::text FROM memory.projects WHERE name = ANY (%(names)s::text[]);

-- name: project_exists
SELECT EXISTS (SELECT 1 FROM memory.projects WHERE name = %(name)s);

-- name: stored_hashes
SELECT sha256, id FROM memory._stored_hashes(%(shas)s::bytea[]);

-- name: stored_nodes
SELECT project, external_id, id, level, sha256, revision
FROM memory._stored_nodes(%(projects)s::text[], %(external_ids)s::text[]);

-- name: write_nodes
-- The one writer (sql/068_write.sql): a batch of new nodes with the vectors the service
-- computed (vector[], typed by pgvector's dumper whatever schema holds it), and their edges.
-- nodes is JSON text, as the write sequence (poimen_core.writes) makes it for both sides.
SELECT memory._write_nodes(%(nodes)s::jsonb, %(embeddings)s) AS report;

-- name: link_nodes
-- The same writer for nodes already stored: only their edges (no vectors, nothing embedded).
SELECT memory._write_nodes(%(nodes)s::jsonb) AS report;

-- name: outbox_on
SELECT memory.enable_outbox();

-- name: nodes_for_reembed
SELECT id, text FROM memory.nodes WHERE id > %(after)s ORDER BY id LIMIT %(limit)s;

-- name: update_embedding
UPDATE memory.nodes SET embedding = %(embedding)s WHERE id = %(id)s;

-- name: reset_embedding
SELECT memory.reset_embedding(%(model)s, %(dim)s);

-- name: count_nodes
SELECT count(*) FROM memory.nodes;

-- name: semantic_search
SELECT node_id, rank, query_score AS score
FROM memory.semantic_search(%(embedding)s, %(project)s, %(levels)s, %(k)s, %(ef_search)s,
                             since => %(since)s, before => %(before)s);

-- name: exact_search
SELECT node_id, rank, query_score AS score
FROM memory.exact_search(%(embedding)s, %(project)s, %(levels)s, %(k)s,
                          since => %(since)s, before => %(before)s);

-- name: lexical_search
SELECT node_id, rank, lexical_score AS score
FROM memory.lexical_search(%(query)s, %(project)s, %(levels)s, %(k)s,
                            since => %(since)s, before => %(before)s);

-- name: search_by_ids
SELECT node_id, rank, query_score AS score
FROM memory.search_by_ids(%(embedding)s, %(ids)s, %(project)s, %(levels)s, %(k)s,
                           since => %(since)s, before => %(before)s);

-- name: ids_for_sha256
SELECT id AS node_id, encode(sha256, 'hex') AS key FROM memory.nodes WHERE sha256 = ANY(%(shas)s::bytea[]);

-- name: fuse
SELECT node_id, ranks, scores, fused_score, fusion_method
FROM memory.fuse(%(lists)s, %(method)s, %(k)s, %(final_k)s);

-- name: hydrate
SELECT node_id, level, sha256, project, title, text, source, breadcrumb, "timestamp",
       query_score, provenance, provenance_truncated
FROM memory.hydrate(%(ids)s, %(embedding)s, project_name => %(project)s);

-- name: provenance_l0
SELECT w.root_id, n.external_id, encode(n.sha256, 'hex')
FROM memory.provenance_walk(%(ids)s, 4) w
JOIN memory.nodes n ON n.id = w.parent_id
WHERE n.level = 'L0';

-- name: begin_request
-- The first statement of every pooled transaction: its time budget and the caller's
-- projects (sql/085_tenants.sql; counted only for members of the database's service role).
SELECT set_config('statement_timeout', %(ms)s, true),
       set_config('poimen.read_projects', %(read)s, true),
       set_config('poimen.write_projects', %(write)s, true),
       set_config('poimen.api_key', %(key)s, true);

-- name: assert_projects_session
SELECT set_config('poimen.read_projects', %(read)s, false),
       set_config('poimen.write_projects', %(write)s, false),
       set_config('poimen.api_key', %(key)s, false);

-- name: database_roles
SELECT reader, writer, service FROM memory.roles();

-- name: service_role_exists
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = %(role)s);

-- name: create_service_login
CREATE ROLE {role} LOGIN;

-- name: grant_service_role
GRANT {group} TO {role};

-- name: outbox_batch
SELECT o.id, o.node_id, o.op, encode(coalesce(o.sha256, n.sha256), 'hex') AS sha256, n.text,
       n.title, n.breadcrumb, n.source, n.level, p.name AS project
FROM memory.opensearch_outbox o
LEFT JOIN memory.nodes n ON n.id = o.node_id
LEFT JOIN memory.projects p ON p.id = n.project_id
ORDER BY o.id
LIMIT %(limit)s
FOR UPDATE OF o SKIP LOCKED;

-- name: outbox_done
DELETE FROM memory.opensearch_outbox WHERE id = ANY(%(ids)s::bigint[]);

-- name: outbox_failed
UPDATE memory.opensearch_outbox
SET attempts = attempts + 1, last_error = %(error)s
WHERE id = ANY(%(ids)s::bigint[]);

-- name: outbox_depth
SELECT count(*) FROM memory.opensearch_outbox;

-- name: outbox_batch_after
-- Keyset variant of outbox_batch: one drain pass walks the queue once, so rows that just
-- failed are not picked up again in the same pass.
SELECT o.id, o.node_id, o.op, encode(coalesce(o.sha256, n.sha256), 'hex') AS sha256, n.text,
       n.title, n.breadcrumb, n.source, n.level, p.name AS project
FROM memory.opensearch_outbox o
LEFT JOIN memory.nodes n ON n.id = o.node_id
LEFT JOIN memory.projects p ON p.id = n.project_id
WHERE o.id > %(after)s
ORDER BY o.id
LIMIT %(limit)s
FOR UPDATE OF o SKIP LOCKED;

-- name: opensearch_docs
SELECT encode(n.sha256, 'hex'), n.text, n.title, n.breadcrumb, n.source, n.level, p.name
FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id
ORDER BY n.id;

-- name: outbox_batch_after_proxy
-- The OpenSearch drain and reindex over a PL/Proxy proxy (sql/proxy/proxy.sql,
-- docs/opensearch.md#over-a-pl-proxy-proxy), the *_proxy statements: the same rows as
-- outbox_batch_after, outbox_done, outbox_failed, outbox_depth, count_nodes and
-- opensearch_docs, from every partition, row and node ids global (memory_proxy._global_id).
SELECT row_id, node_id, op, sha256, body, title, breadcrumb, source, level, project
FROM memory_proxy.outbox_batch(%(after)s, %(limit)s);

-- name: outbox_done_proxy
SELECT memory_proxy.outbox_done(%(ids)s::bigint[]);

-- name: outbox_failed_proxy
SELECT memory_proxy.outbox_failed(%(ids)s::bigint[], %(error)s);

-- name: outbox_depth_proxy
-- The rows queued on the reachable partitions, and the partitions out of reach (whose rows
-- a run could not drain).
SELECT depth, missing FROM memory_proxy.outbox_state();

-- name: count_nodes_proxy
-- The nodes of the reachable partitions, and the partitions out of reach (a reindex that
-- would miss theirs must not drop the index first).
SELECT nodes, missing FROM memory_proxy.health();

-- name: proxy_trusted
-- Whether this session's role is one the proxy forwards asserted projects for (a member of
-- its service role): anyone else's calls see no partition's rows.
SELECT memory_proxy._trusted();

-- name: opensearch_docs_proxy
-- A page of documents, partition by partition, from the global node id after (the last of
-- the page before, 0 first); the node id first (the keyset).
SELECT node_id, sha256, body, title, breadcrumb, source, level, project
FROM memory_proxy.opensearch_docs(%(after)s, %(limit)s);

-- name: health
SELECT (SELECT count(*) FROM memory.nodes) AS nodes,
       (SELECT model FROM memory.embedding_model) AS embedding_model,
       (SELECT count(*) FROM memory.opensearch_outbox) AS outbox_depth,
       (SELECT extract(epoch FROM now() - min(enqueued_at)) FROM memory.opensearch_outbox)
           AS outbox_lag_s,
       -- what the store has outgrown (issue 28): counted here, listed by migrate --check
       (SELECT count(*) FROM memory.scale_warnings()) AS scale_warnings;

-- name: is_proxy
-- Whether this database is a PL/Proxy proxy in front of partition databases
-- (docs/scaling.md#the-http-service-over-the-proxy): /healthz then reads health_proxy.
SELECT to_regnamespace('memory_proxy') IS NOT NULL AS proxy;

-- name: health_proxy
-- The health query over the partitions of a proxy (sql/proxy/proxy.sql): the totals of the
-- reachable ones, and which are out of reach.
SELECT nodes, embedding_model, outbox_depth, outbox_lag_s, scale_warnings, partitions, missing
FROM memory_proxy.health();

-- name: vacuum_postings
VACUUM (ANALYZE) memory.postings;

-- name: analyze_nodes
ANALYZE memory.nodes;

-- name: fuse_legs
SELECT node_id, ranks, scores, fused_score, fusion_method
FROM memory.fuse_legs(%(semantic)s::jsonb, %(lexical)s::jsonb, %(strategy)s, %(fusion)s,
                      %(dense_weight)s, %(k)s, %(final_k)s);

-- name: policy
SELECT fusion, rrf_k, dense_weight, candidates, cascade_candidates, fusion_by_type, extracted_dates,
       evidence_budget, evidence_candidates, evidence_weight, evidence_neighbours, min_cosine
FROM memory.policy();

-- name: set_policy
SELECT memory.set_policy(%(key)s, %(value)s);

-- name: key_insert
INSERT INTO memory.api_keys (key_hash, prefix, projects, can_write, note)
VALUES (%(key_hash)s, %(prefix)s, %(projects)s, %(can_write)s, %(note)s)
RETURNING id;

-- name: keys_list
SELECT id, prefix, projects, can_write, note, created_at, revoked_at, set_aside_at
FROM memory.api_keys ORDER BY id;

-- name: key_revoke
UPDATE memory.api_keys SET revoked_at = now()
WHERE (id::text = %(key)s OR prefix = %(key)s) AND revoked_at IS NULL
RETURNING id, prefix;

-- name: keys_active
-- Revoked keys come too (with can_read false): once any key was ever made, the service
-- requires one, so revoking the last key locks the API instead of opening it. Keys set
-- aside by `poimen-memory keys anonymous` (revoked ones only) no longer count.
SELECT key_hash, projects, can_write, revoked_at IS NULL AS can_read, id FROM memory.api_keys
WHERE set_aside_at IS NULL;

-- name: keys_set_aside
-- `poimen-memory keys anonymous`: every revoked key set aside, in one statement that
-- changes nothing while a key is active (the CLI says which).
UPDATE memory.api_keys SET set_aside_at = now()
WHERE set_aside_at IS NULL AND revoked_at IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM memory.api_keys a WHERE a.revoked_at IS NULL)
RETURNING id;

-- name: primary_wal_lsn
SELECT pg_current_wal_lsn()::text AS lsn;

-- name: role_bypasses_rls
-- The pool's login role, and why PostgreSQL skips row-level security for it, if it does: a
-- superuser, a BYPASSRLS role, or the owner of the tables (or a member of it), which RLS
-- exempts because no table is FORCE ROW LEVEL SECURITY. NULL reason: RLS applies.
SELECT current_user AS role,
       CASE WHEN r.rolsuper THEN 'superuser'
            WHEN r.rolbypassrls THEN 'BYPASSRLS'
            WHEN pg_has_role(current_user, c.relowner, 'USAGE') THEN 'owner of memory.nodes'
       END AS reason
  FROM pg_roles r
  LEFT JOIN pg_class c ON c.oid = to_regclass('memory.nodes')
 WHERE r.rolname = current_user;

-- name: replica_state
-- On a standby: is it one, how far its replay is behind the primary's LSN (or, without one,
-- its own received WAL), and how long since it replayed the last commit.
SELECT pg_is_in_recovery() AS in_recovery,
       pg_wal_lsn_diff(coalesce(%(primary_lsn)s::pg_lsn, pg_last_wal_receive_lsn()),
                       pg_last_wal_replay_lsn())::float8 AS behind_bytes,
       extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8
           AS since_replay_s,
       CASE WHEN pg_is_in_recovery() THEN pg_is_wal_replay_paused() END AS paused;

-- name: wal_receiver_status
SELECT status FROM pg_stat_wal_receiver;

-- name: serve_start
-- The plan of a query (sql/066_plan.sql) under the tenant's projects, and its Postgres
-- lexical legs, run while the service embeds the query: one round trip. Its prefetched
-- comes apart, as text: the service gives it back to memory._serve as it came, unread.
SELECT s - 'prefetched', (s -> 'prefetched')::text
FROM memory._serve_start(%(req)s::jsonb, %(caps)s::jsonb) AS s;

-- name: serve_semantic
-- With OpenSearch: the plan's semantic leg, run while OpenSearch answers; serve takes it back.
SELECT memory._serve(%(req)s::jsonb, %(caps)s::jsonb, %(embedding)s, NULL, 'semantic',
                     %(prefetched)s::jsonb);

-- name: serve
-- The whole query in one statement: the plan run by the executor (sql/071_execute.sql).
SELECT memory._serve(%(req)s::jsonb, %(caps)s::jsonb, %(embedding)s, %(hits)s::jsonb, %(through)s,
                     %(prefetched)s::jsonb);

-- name: serve_finish
-- After a reranker: the answer in its order.
SELECT memory._serve_finish(%(req)s::jsonb, %(caps)s::jsonb, %(state)s::jsonb, %(embedding)s,
                            %(order)s::bigint[], %(rerank)s::jsonb);

-- name: get_node
-- One node by id (sql/090_nodes.sql), under the projects begin_request asserted.
-- projects: the API key's (NULL: anonymous), a filter beside row-level security.
SELECT to_jsonb(g) FROM memory._get_node(%(id)s, %(project)s, %(projects)s) g;

-- name: list_nodes
-- A page of nodes (sql/090_nodes.sql), under the projects begin_request asserted, in the
-- order the function returns it (node ids on one database; over the proxy's partitions,
-- each partition in turn, whose node ids are each its own: docs/scaling.md).
SELECT coalesce(jsonb_agg(to_jsonb(g) - 'ordinality' ORDER BY g.ordinality), '[]')
FROM memory._list_nodes(%(project)s, %(level)s, %(source)s, %(since)s, %(until)s,
                        %(after)s, %(limit)s, %(projects)s, %(filter)s, %(newest_first)s)
     WITH ORDINALITY AS g;

-- name: count_listed
-- How many nodes list_nodes would list over all its pages (memory.count_nodes), under the
-- projects begin_request asserted.
SELECT to_jsonb(memory._count_nodes(%(project)s, %(level)s, %(source)s, %(since)s, %(until)s,
                                    %(filter)s, %(projects)s));

-- name: project_names
-- The projects the caller may read, for MCP's resources/list (api/operations.py
-- list_projects). projects: the API key's (NULL: anonymous), a filter beside row-level
-- security, which shows the service's role no other project either.
SELECT p.name::text FROM memory.projects p
WHERE %(projects)s::text[] IS NULL OR p.name = ANY (%(projects)s::text[])
ORDER BY p.name;

-- name: project_summary
-- One project's summary for MCP's resources/read (sql/090_nodes.sql): its current nodes per
-- level, the versions that ended (superseded or forgotten), and the latest write; PM404 for
-- a project the caller cannot see. Over a proxy, from the project's partition.
SELECT current, ended, latest_write FROM memory._project_summary(%(project)s);
