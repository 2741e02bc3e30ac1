-- The row memory.query returns, declared once (memory._declare_row): memory.query, its
-- implementation and the public.memory_query alias all return SETOF memory.query_row.
-- Declared here, like the functions, rather than in a migration: it holds no data. Its older
-- shapes, and the query functions' older signatures, were dropped by a run-once migration
-- (migrations/0022_drop_old_signatures.sql). The functions themselves: sql/070_query.sql.
SELECT memory._declare_row('query_row',
    'rank integer, node_id bigint, external_id text, level text, sha256 text, project text, '
    'title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, '
    'query_score double precision, lexical_score double precision, final_score double precision, '
    'semantic_rank integer, lexical_rank integer, fusion_method text, search_strategy text, '
    'provenance jsonb, provenance_truncated boolean, metadata jsonb, support text, '
    'changed_parents jsonb, uncited_reason text');
