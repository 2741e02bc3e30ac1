-- memory.embed: text to vector inside PostgreSQL, with the model the service runs
-- (poimen_core.minilm, the same code as the service's local embedder). `make setup`
-- installs its packages for the server's own Python; `poimen-memory migrate` records
-- where (memory.config plpython_deps) and copies the tokenizer beside poimen_core.

CREATE OR REPLACE FUNCTION memory.embed(query text)
RETURNS vector
-- STABLE: the vector depends on the configured model, not only on the text. PARALLEL
-- UNSAFE: plpy.execute runs in a subtransaction.
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
code = plpy.execute("SELECT memory.plpython_load() AS p")[0]["p"]
try:
    from poimen_core.embedentry import embed_for_sql
except ImportError as e:
    plpy.error("the PL/Python embedding module cannot be imported on this host", sqlstate="PM503",
               detail="%s (memory.config plpython_path = %s)" % (e, code),
               hint="Run `poimen-memory migrate` on this database host, or pass query_embedding.")
cfg = plpy.execute("SELECT (SELECT value FROM memory.config WHERE key = 'plpython_deps') AS deps,"
                   " (SELECT model FROM memory.embedding_model) AS model")[0]
return embed_for_sql(plpy, GD, query, configured_model=cfg["model"], deps_root=cfg["deps"],
                     code_dir=code)
$$;
COMMENT ON FUNCTION memory.embed(text) IS
    'The text''s embedding from the database''s model (all-MiniLM-L6-v2 int8, loaded once per backend: see docs/sql-api.md for the cost). PM503 with a hint when the model or its packages are missing on this host.';
