-- memory.add_nodes: writing from SQL with the CLI's guarantees. The body is a shim into
-- poimen_core.addnodes, which validates with the very code the CLI and the HTTP service
-- run (poimen_core.nodes) and embeds with memory.embed (sql/065_embed.sql).

CREATE OR REPLACE FUNCTION memory.add_nodes(nodes jsonb)
RETURNS jsonb
-- VOLATILE: it writes. PARALLEL UNSAFE: writes, and plpy.execute opens subtransactions.
-- Not STRICT: NULL gets the same 22023 as any other non-array, not a silent NULL.
-- SECURITY INVOKER (the default): row-level security applies to the caller, so a writer
-- writes only the projects granted to it (sql/085_tenants.sql).
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE
-- Every name in the shim's statements is schema-qualified; nothing resolves through a
-- caller's schemas.
SET search_path = pg_catalog, pg_temp
AS $$
plpy.execute("SELECT memory.plpython_load()")
add_nodes_for_sql = GD["poimen_entry"](
    "addnodes", "add_nodes_for_sql", "ingest",
    "Run `poimen-memory migrate` on this database host, or write through the service.")
return add_nodes_for_sql(plpy, nodes)
$$;
COMMENT ON FUNCTION memory.add_nodes(jsonb) IS
    'Writes a JSON array of nodes in the JSONL format of `poimen-memory ingest` (docs/ingest.md), with its guarantees: every node validated first by the same code (22023 naming the node and field; nothing written), content-hash keys (a node already stored counts as a duplicate), parents linked by id within the array or among the project''s stored nodes, vectors from memory.embed, all in the calling statement (all or nothing). Returns {"inserted", "duplicates", "edges", "unresolved"}. The first write into an empty database records the model, which only the owner or memory_service may do (PM412 otherwise). Row-level security applies: 42501 names the node whose project the caller may not write.';
