-- Grants last, after every function exists. Access goes through two roles:
-- memory_reader (query functions) and memory_writer (reader + table writes).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'memory_reader') THEN
        CREATE ROLE memory_reader NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'memory_writer') THEN
        CREATE ROLE memory_writer NOLOGIN IN ROLE memory_reader;
    END IF;
END $$;

REVOKE ALL ON SCHEMA memory FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA memory FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA memory FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION public.memory_optimize_query(text) FROM PUBLIC;

GRANT USAGE ON SCHEMA memory TO memory_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA memory TO memory_reader;
-- Key hashes are the service owner's alone (the table exists from migration 0005 on).
DO $$
BEGIN
    IF to_regclass('memory.api_keys') IS NOT NULL THEN
        REVOKE ALL ON memory.api_keys FROM memory_reader, memory_writer;
    END IF;
END $$;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA memory TO memory_reader;
-- The policy is the DBA's (owner's) to change; readers and writers only read it.
REVOKE EXECUTE ON FUNCTION memory.set_policy(text, text), memory.reset_policy(text) FROM memory_reader;
GRANT EXECUTE ON FUNCTION public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision) TO memory_reader;
GRANT EXECUTE ON FUNCTION public.memory_optimize_query(text) TO memory_reader;
-- Writers change content only. memory.config holds the path PL/Python imports code from
-- (as the server's OS user), so it, the ledger and the statistics stay owner-only; the
-- statistics triggers are SECURITY DEFINER for that reason.
GRANT INSERT, UPDATE, DELETE ON memory.nodes, memory.edges, memory.projects,
    memory.opensearch_outbox TO memory_writer;
