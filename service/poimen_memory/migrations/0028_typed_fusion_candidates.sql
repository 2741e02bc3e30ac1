-- memory._after_fusion takes the fused candidates typed (memory.fused_row[]) since issue 42:
-- as a JSON list, every candidate's scores were converted to numeric and back between
-- memory._run_legs and it. sql/040_fusion.sql makes the new signature; the old one goes,
-- once (migration 0022 says why signatures are dropped here, not in sql/). Without SET
-- search_path: the signature names pgvector's type as migrate's search_path finds it.
DO $$
DECLARE
    f regprocedure;
BEGIN
    BEGIN
        f := pg_catalog.to_regprocedure('memory._after_fusion(jsonb, jsonb, vector)');
    EXCEPTION WHEN undefined_object THEN
        f := NULL;  -- no vector type on the path: neither is the function
    END;
    IF f IS NOT NULL THEN
        EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
    END IF;
END $$;
